"""parallel.ep: an MoE layer with its experts spread over the ranks, against the same MoE in one process."""
from __future__ import annotations

import dataclasses
from collections import Counter

import torch

from backend.config import Config, ConfigError, setting
from backend.limits import cost
from backend.experiments import define
from backend.models import moe_reference
from backend.models.moe import MoELayer
from backend.parallel.ep import ExpertParallelMoE
from backend.parallel.mesh import start_rank
from backend.parallel.parallelize import sources, tag_sources
from backend.parallel.pp.recompute import saved_activations
from backend.parallel.wire import Wire
from backend.result import Check, Result, Schema

TOL = 1e-12


@dataclasses.dataclass
class EPConfig(Config):
    world_size: int = setting(2, min=2, max=8, help="expert-parallel ranks (each also holds a slice of the tokens)")
    tokens: int = setting(64, min=2, max=4096, help="tokens in the global batch (split over the ranks, unevenly if need be)")
    d_model: int = setting(16, min=2, max=512, help="hidden size")
    d_ff: int = setting(32, min=2, max=2048, help="each expert's hidden size (SwiGLU)")
    experts: int = setting(4, min=1, max=64, help="routed experts E (split over the ranks)")
    top_k: int = setting(2, min=1, max=8, help="experts per token")
    capacity_factor: float = setting(1.0, min=0.1, max=16.0, help="an expert takes at most ceil(cf·T·k/E) of a rank's T tokens")
    seed: int = setting(0, min=0, max=2**31 - 1, help="weights and tokens")

    cost_drivers = ("tokens", "d_ff", "d_model", "experts", "capacity_factor", "world_size")

    def estimate(self):
        """Every rank builds the whole layer twice (its reference, then its own experts kept) in float64 and runs the
        reference on all tokens, forward and backward; expert buffers hold up to capacity_factor·tokens·top_k rows."""
        n, d, f = self.world_size, self.d_model, self.d_ff
        weights = (self.experts + 1) * 3 * d * f + d * self.experts  # SwiGLU experts: gate, up, down
        rows = self.tokens * self.top_k * max(1.0, self.capacity_factor)
        return cost(data_bytes=n * (4 * weights + rows * (2 * d + 4 * f) * 2) * 8,
                    flops=(n + 1) * 6 * rows * 3 * d * f, ops=2 * n * (self.experts + 2 * n) * 60, ranks=n)

    def check(self) -> None:
        if self.experts % self.world_size:
            raise ConfigError("experts", f"{self.experts} does not divide by world_size={self.world_size} (allowed: a multiple of it)")
        if self.top_k > self.experts:
            raise ConfigError("top_k", f"{self.top_k} is more than experts={self.experts} (allowed: 1..{self.experts})")
        if self.tokens < self.world_size:
            raise ConfigError("tokens", f"{self.tokens} is fewer than world_size={self.world_size} (allowed: >= world_size)")


def _model(c: EPConfig) -> MoELayer:
    torch.manual_seed(c.seed)
    return MoELayer(c.d_model, c.d_ff, c.experts, n_shared=1, top_k=c.top_k, capacity_factor=c.capacity_factor).double()


def _data(c: EPConfig):
    g = torch.Generator().manual_seed(c.seed + 1)
    return torch.randn(c.tokens, c.d_model, generator=g, dtype=torch.float64), torch.randn(c.tokens, c.d_model, generator=g, dtype=torch.float64)


def grouped_reference(layer: MoELayer, x: torch.Tensor, groups: int) -> tuple[torch.Tensor, list[dict]]:
    """The layer in one process, routing `groups` slices of the tokens separately (as that many ranks route theirs,
    the capacity being per group): output, and per group the assignments routed and kept per expert."""
    outs, stats = [], []
    for group in x.tensor_split(groups):
        routing = layer.route(group)
        outs.append(layer(group, routing))
        routed = torch.bincount(routing.indices.flatten(), minlength=len(layer.experts))
        stats.append({"routed": routed.tolist(), "kept": routing.load(len(layer.experts)).tolist()})
    return torch.cat(outs), stats


def run_rank(rank, world, config: EPConfig, ctx):
    mesh, tracer = start_rank(rank, world, ep=world)
    x_all, target = _data(config)
    x_all.requires_grad_()  # as if earlier layers produced it: the dispatch's backward runs too
    reference = _model(config)
    ref_y, ref_stats = grouped_reference(reference, x_all, groups=world)
    (((ref_y - target) ** 2).sum() / config.tokens).backward()

    wire = Wire.along(mesh, "ep", tracer)
    model = ExpertParallelMoE(tag_sources(_model(config)), wire)
    x = x_all.detach().tensor_split(world)[rank].requires_grad_()
    t = target.tensor_split(world)[rank]
    ctx.progress(0.3, "dispatch, experts, combine")
    with tracer.span("compute", "MoE forward", kind="forward"), saved_activations(model.parameters()) as saved:
        y = model(x)
        loss = ((y - t) ** 2).sum() / config.tokens
    with tracer.span("compute", "MoE backward", kind="backward"):
        loss.backward()
    for p in model.replicated_parameters():  # replicated: sum over the ranks' tokens
        p.grad = wire.all_reduce(p.grad, "backward", "router and shared-expert gradients")
    ref_slice = ref_y.tensor_split(world)[rank]
    reference_params, held = dict(reference.named_parameters()), sources(model)
    grad_error = max((p.grad - reference_params[held[name][1][0][0]].grad).abs().max().item()
                     for name, p in model.named_parameters())
    return {"rank": rank, "output_error": (y - ref_slice).abs().max().item(), "grad_error": grad_error,
            "input_grad_error": (x.grad - x_all.grad.tensor_split(world)[rank]).abs().max().item(),
            "stats": model.stats[0], "activation_bytes": saved.live, "reference_stats": ref_stats[rank],
            "log": wire.log, "trace": tracer.payload()}


def combine(config: EPConfig, payloads) -> Result:
    n, d, per = config.world_size, config.d_model, config.experts // config.world_size
    checks = [Check("MoE output equals the same MoE in one process", max(p["output_error"] for p in payloads), TOL,
                    reference="one process, every expert local, tokens routed in the same groups"),
              Check("router, shared-expert and expert gradients equal one process's", max(p["grad_error"] for p in payloads), TOL,
                    reference="single-process autograd"),
              Check("input gradients (through both all-to-alls' backward) equal one process's",
                    max(p["input_grad_error"] for p in payloads), TOL, reference="single-process autograd")]
    # drops, counted independently: an expert routed r assignments with capacity C (exact, in integers) drops max(0, r - C)
    for p in payloads:
        p["stats"]["capacity"] = moe_reference.capacity(p["stats"]["tokens"], config.top_k, config.experts, config.capacity_factor)
    drop_err = max(sum(abs(d - max(0, r - p["stats"]["capacity"])) for d, r in zip(p["stats"]["dropped"], p["reference_stats"]["routed"]))
                   for p in payloads)
    checks.append(Check("dropped assignments equal Σ max(0, routed − capacity) per expert", drop_err, 0,
                        reference="bincount of the reference's top-k choices"))
    # rows rank i sends rank j: its kept assignments to j's experts, from the reference's routing of group i
    matrix = [[sum(p["reference_stats"]["kept"][j * per:(j + 1) * per]) for j in range(n)] for p in payloads]
    for p in payloads:
        i = p["rank"]
        out_rows = sum(matrix[i][j] for j in range(n) if j != i)
        in_rows = sum(matrix[j][i] for j in range(n) if j != i)
        model = {("forward", "dispatch"): out_rows, ("forward", "combine"): in_rows,
                 ("backward", "combine"): out_rows, ("backward", "dispatch"): in_rows}
        measured = Counter()
        for r in p["log"]:
            measured[r["phase"], r["name"]] += r["sent_bytes"]
        err = sum(abs(measured[k] - v * d * 8) for k, v in model.items())
        checks.append(Check(f"rank {i}: all-to-all bytes equal the rows routed to other ranks x d x 8", err, 0,
                            reference="the routing matrix of the one-process reference"))
    experts = [{"source rank": p["rank"], "expert": e, "on rank": e // per, "routed": p["stats"]["routed"][e],
                "kept": p["stats"]["kept"][e], "dropped": p["stats"]["dropped"][e], "capacity": p["stats"]["capacity"]}
               for p in payloads for e in range(config.experts)]
    a2a = [{"from rank": i, "to rank": j, "rows": matrix[i][j], "bytes": matrix[i][j] * d * 8} for i in range(n) for j in range(n)]
    load = [{"rank": p["rank"], "expert": e, "rows computed": rows} for p in payloads for e, rows in p["stats"]["computed_here"].items()]
    dropped = sum(r["dropped"] for r in experts)
    metrics = {"dropped assignments": dropped, "assignments": config.tokens * config.top_k,
               "drop rate": dropped / (config.tokens * config.top_k),
               "max / mean rows per rank": max(sum(r["rows computed"] for r in load if r["rank"] == k) for k in range(n))
               / (sum(r["rows computed"] for r in load) / n)}
    notes = ["Dropped assignments still reach the shared expert (and their token's other experts); a token whose every "
             "choice overflowed keeps only the shared expert's output, as Switch Transformers passes it by the residual."]
    memory = [{"rank": p["rank"], "activation_bytes": p["activation_bytes"]} for p in payloads]
    return Result(metrics=metrics, checks=checks, tables={"experts": experts, "all_to_all": a2a, "load": load, "memory": memory}, notes=notes,
                  trace_events=[e for p in payloads for e in p["trace"]["events"]])


RESULT = Schema(
    metrics=("dropped assignments", "assignments", "drop rate", "max / mean rows per rank"),
    tables={"experts": ("source rank", "expert", "on rank", "routed", "kept", "dropped", "capacity"),
            "all_to_all": ("from rank", "to rank", "rows", "bytes"), "load": ("rank", "expert", "rows computed"),
            "memory": ("rank", "activation_bytes")},
)

EXPERIMENT = define(__name__, EPConfig, "expert parallel MoE: top-k routing with capacity and drops, uneven all-to-all dispatch "
                    "and combine, a shared expert; equal to one process",
                    rank_fn=run_rank, combine=combine, lanes=("compute", "collective", "comm"), schema=RESULT)
