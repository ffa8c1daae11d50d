"""parallel.dp_ps: parameter servers (seeds 000 and 002) training the tiny LLaMA, push and pull over our P2P."""
from __future__ import annotations

import dataclasses

import torch

from backend.config import ConfigError, setting
from backend.limits import with_wait
from backend.experiments import define
from backend.experiments.parallel import dp_model
from backend.experiments.parallel._reference import reference_training
from backend.parallel import dp_ps
from backend.parallel.precision import Adam, flat_params, load_flat
from backend.parallel.tp_model import reference_model
from backend.result import Check, Result, Schema


@dataclasses.dataclass
class PSConfig(dp_model.DPConfig):
    mode: str = setting("sync", choices=("sync", "async", "stale"), help="synchronous, asynchronous, or bounded staleness")
    staleness: int = setting(1, min=0, max=16, help="stale mode: how many pushes a worker may run ahead of the slowest")
    server: str = setting("dedicated", choices=("rank0", "dedicated"), help="rank 0 also works (seed's GPU0 DP), or only serves")
    straggler_ms: int = setting(0, min=0, max=1000, help="extra time per step on the last worker")

    cost_drivers = ("straggler_ms",) + dp_model.DPConfig.cost_drivers

    def estimate(self):
        """The mesh plan's (the same model, ranks and steps; its reference is the sync check's), plus the straggler's
        wait on every step."""
        return with_wait(plan(self).estimate(), 2 * self.steps * self.straggler_ms / 1000)

    def check(self) -> None:
        super().check()
        if self.server == "rank0" and self.mode != "sync":
            raise ConfigError("mode", f"{self.mode!r} needs server=dedicated (allowed with server=rank0: sync, seed 000's DP)")
        dp_model.check_plan(self, "allreduce")


def plan(config: PSConfig):
    """The tiny LLaMA's shape and tokens, as the data-parallel pages' dp-only mesh plan holds them."""
    return dp_model.mesh_plan(config, "allreduce")


def run_rank(rank, world, config: PSConfig, ctx):
    return dp_ps.run_rank(rank, world, config, plan(config), ctx)


def sync_error(plan, params) -> float:
    """Largest |difference| between the server's flat parameters and one float64 process training the whole batch
    with torch.optim.Adam (_reference.reference_training, the mesh's own reference), parameter by parameter."""
    ref, model = reference_training(plan)["state"], reference_model(plan)
    load_flat(model, torch.from_numpy(params))
    return max((p.detach() - ref[name]).abs().max().item() for name, p in model.named_parameters())


def combine_ps(config, plan, payloads: list[dict]) -> Result:
    torch.set_num_threads(1)  # the reference or replay: a tiny model's ops are too small to split (as the mesh's)
    n, server = config.world_size, payloads[0]
    P, workers = server["params"].size, len(dp_ps.worker_ranks(config, n))
    checks, notes = [], []
    if config.mode == "sync":
        checks.append(Check("synchronous server's parameters equal one process on the whole batch",
                            sync_error(plan, server["params"]), 1e-9,
                            reference="single-process PyTorch, float64, torch.optim.Adam on the whole batch "
                                      "(the mesh's reference)"))
    else:
        # What asynchronous updates must satisfy is not a convergence speed but their semantics: every gradient
        # applied exactly once, each computed on the parameter version it says, in the order the server applied them.
        # Replaying that sequence in one process must give the server's parameters exactly.
        replayed = replay_updates(config, plan, server["updates"])
        err = (torch.from_numpy(server["params"]) - replayed).abs().max().item()
        checks.append(Check("the server's parameters equal a one-process replay of its update log", err, 1e-12,
                            reference="one process: each logged gradient recomputed on the version it was based on, "
                                      "Adam applied in the server's order"))
        applied = sorted((u["worker"], u["step"]) for u in server["updates"])
        expected = sorted((w, s) for w in dp_ps.worker_ranks(config, n) for s in range(config.steps))
        checks.append(Check("every worker's gradient of every step applied exactly once", int(applied != expected), 0,
                            reference="workers × steps", detail=f"{len(applied)} updates"))
        first, last = server["eval"][0]["loss"], server["eval"][-1]["loss"]
        notes.append(f"Loss on the global batch {first:.4f} after the first update, {last:.4f} after the last.")
        stale = [u["staleness"] for u in server["updates"]]
        if config.mode == "stale":
            bound = (workers - 1) * (config.staleness + 1)
            checks.append(Check("bounded staleness holds: no gradient older than (W-1)(s+1) updates",
                                max(0, max(stale) - bound), 0, reference="the stale-synchronous bound",
                                detail=f"max staleness {max(stale)}, bound {bound}"))
        notes.append(f"Staleness over {len(stale)} updates: mean {sum(stale) / len(stale):.2f}, max {max(stale)}.")
    if config.server == "rank0":
        formula = (n - 1) * P * 8 * config.steps
        checks.append(Check("rank 0 receives (n-1)ψ and sends (n-1)ψ per step (seed 000's DP)",
                            abs(server["recv"] - formula) + abs(server["sent"] - formula), 0, reference="seed 000",
                            detail="bytes counted by our send/recv on the wire"))
    sent, received = sum(pl["sent"] for pl in payloads), sum(pl["recv"] for pl in payloads)
    checks.append(Check("every byte a rank sent another received (each side logged by its own send/recv)",
                        abs(sent - received), 0, reference="conservation over the wire", detail=f"{sent:,} B sent"))
    volume = [{"rank": pl["rank"], "sent_bytes": pl["sent"], "recv_bytes": pl["recv"]} for pl in payloads]
    return Result(metrics={"strategy": f"parameter server ({config.mode}, {config.server})", "world_size": n,
                           "workers": workers, "final_eval_loss": server["eval"][-1]["loss"],
                           "updates": len(server["eval"])},
                  checks=checks, notes=notes,
                  tables={"staleness": server["updates"], "eval": server["eval"], "volume": volume},
                  trace_events=[e for pl in payloads for e in pl["trace"]["events"]])


def replay_updates(config, plan, updates: list[dict]) -> torch.Tensor:
    """One process replays the server's log: update k applies the gradient worker w computed for its step on the
    parameters of version `based_on`, with the same Adam, in the logged order."""
    ranks = dp_ps.worker_ranks(config, config.world_size)
    model = reference_model(plan)
    flat = flat_params(model)
    m, v, adam = torch.zeros_like(flat), torch.zeros_like(flat), Adam(config.lr)
    versions = [flat.clone()]
    for u in updates:
        grad = dp_ps.worker_gradient(model, versions[u["based_on"]], plan, ranks.index(u["worker"]), len(ranks))
        adam.update(flat, grad, m, v)
        versions.append(flat.clone())
    return flat


RESULT = Schema(
    metrics=("strategy", "world_size", "workers", "final_eval_loss", "updates"),
    tables={"staleness": ("update", "worker", "step", "based_on", "staleness"), "eval": ("update", "loss"),
            "volume": ("rank", "sent_bytes", "recv_bytes")},
)

EXPERIMENT = define(__name__, PSConfig, "parameter servers training the tiny LLaMA: rank 0 or dedicated; synchronous, "
                    "asynchronous, bounded staleness", rank_fn=run_rank,
                    combine=lambda config, payloads: combine_ps(config, plan(config), payloads),
                    lanes=("compute", "collective", "send", "recv"), schema=RESULT)
