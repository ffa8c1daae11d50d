"""parallel.cp: ring attention over context-parallel ranks, against full attention (torch SDPA)."""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F

from backend.config import Config, ConfigError, setting
from backend.limits import cost
from backend.experiments import define
from backend.parallel.cp import RingAttention, positions
from backend.parallel.mesh import start_rank
from backend.parallel.pp.recompute import saved_activations
from backend.parallel.wire import Wire
from backend.result import Check, Result, Schema

TOL = 1e-12


@dataclasses.dataclass
class CPConfig(Config):
    world_size: int = setting(2, min=2, max=8, help="context-parallel ranks")
    batch: int = setting(1, min=1, max=8, help="sequences")
    heads: int = setting(2, min=1, max=16, help="attention heads")
    seq: int = setting(256, min=2, max=8192, help="sequence length (split over the ranks)")
    d_head: int = setting(32, min=1, max=256, help="head dimension")
    causal: bool = setting(True, help="causal mask (by global positions)")
    split: str = setting("zigzag", choices=("zigzag", "contiguous"), help="zigzag: rank r holds chunks r and 2n-1-r of 2n")
    seed: int = setting(0, min=0, max=2**31 - 1, help="inputs")

    cost_drivers = ("seq", "batch", "heads", "d_head", "world_size")

    def estimate(self):
        """Every rank runs torch SDPA on the whole sequence as its reference (float64, the S×S scores materialised,
        forward and backward), then its share of the ring; the ring's steps are Python-level sends and block updates."""
        scores = self.batch * self.heads * self.seq ** 2
        n = self.world_size
        return cost(data_bytes=n * (scores * 8 * 4 + 12 * self.batch * self.heads * self.seq * self.d_head * 8),
                    flops=(n + 1) * 3 * 4 * scores * self.d_head, moved_bytes=(n + 1) * scores * 8 * 8,
                    ops=n * n * 4 * 50 + n * 500, ranks=n, seconds=0.3 * n)  # 2.6 s of CPU at 2 ranks, 6.6 s at 8 measured

    def check(self) -> None:
        parts = 2 * self.world_size if self.split == "zigzag" else self.world_size
        if self.seq % parts:
            raise ConfigError("seq", f"{self.seq} does not divide into {parts} chunks for split={self.split} with "
                                     f"world_size={self.world_size} (allowed: a multiple of {parts})")


def _inputs(c: CPConfig):
    g = torch.Generator().manual_seed(c.seed)
    shape = (c.batch, c.heads, c.seq, c.d_head)
    return [torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(4)]  # q, k, v, upstream gradient


def run_rank(rank, world, config: CPConfig, ctx):
    mesh, tracer = start_rank(rank, world, cp=world)
    q, k, v, grad = _inputs(config)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    reference = F.scaled_dot_product_attention(*full, is_causal=config.causal)
    reference.backward(grad)
    pos = [positions(config.seq, j, world, config.split) for j in range(world)]
    mine = pos[rank]
    local = [t[:, :, mine].clone().requires_grad_() for t in (q, k, v)]
    ring = Wire.along(mesh, "cp", tracer)
    tracer.align(dist.barrier)  # time zero once every rank has its chunk: the trace is the ring alone
    steps = []
    ctx.progress(0.3, "ring forward")
    with saved_activations([]) as saved:
        out = RingAttention.apply(*local, pos, ring, config.causal, steps)
    ctx.progress(0.6, "ring backward")
    out.backward(grad[:, :, mine])
    forward_ms = sum(e["dur"] for e in tracer.events if e["lane"] == "compute" and e["name"].startswith("attend")) / 1e3
    unmasked = int(sum((p[None, :] <= mine[:, None]).sum() if config.causal else len(mine) * len(p) for p in pos))
    return {"rank": rank, "positions": mine.tolist(),
            "output_error": (out - reference[:, :, mine]).abs().max().item(),
            "grad_errors": {name: (a.grad - b.grad[:, :, mine]).abs().max().item() for name, a, b in zip("qkv", local, full)},
            "steps": steps, "ring": [{**r, "what": r["name"]} for r in ring.log], "forward_compute_ms": forward_ms,
            "unmasked_scores": unmasked, "activation_bytes": saved.live, "trace": tracer.payload()}


def combine(config: CPConfig, payloads) -> Result:
    n = config.world_size
    block = 2 * config.batch * config.heads * (config.seq // n) * config.d_head * 8  # K and V of one chunk, float64
    checks = [Check("ring attention output equals full attention", max(p["output_error"] for p in payloads), TOL,
                    reference="torch scaled_dot_product_attention on the whole sequence" + (", causal" if config.causal else "")),
              Check("dQ, dK, dV equal full attention's", max(max(p["grad_errors"].values()) for p in payloads), TOL,
                    reference="autograd through torch SDPA")]
    for p in payloads:
        fwd = sum(r["sent_bytes"] for r in p["ring"] if "backward" not in r["what"] and "dK" not in r["what"])
        bwd = sum(r["sent_bytes"] for r in p["ring"]) - fwd
        checks.append(Check(f"rank {p['rank']}: bytes sent equal the model", abs(fwd - (n - 1) * block) + abs(bwd - (2 * n - 1) * block), 0,
                            reference="forward: n-1 K/V blocks; backward: n-1 K/V blocks and n dK/dV blocks (the last one home)"))
    local = config.batch * config.heads * (config.seq // n)
    checks.append(Check("saved for backward: this rank's Q, K, V, output and log-sum-exp only (no S x S scores)",
                        max(abs(p["activation_bytes"] - (4 * local * config.d_head + local) * 8) for p in payloads), 0,
                        reference="4·b·h·(S/n)·d + b·h·(S/n) float64 values"))
    work = [p["unmasked_scores"] for p in payloads]
    metrics = {"unmasked scores, max / mean over ranks": max(work) / (sum(work) / n),
               "forward compute ms, max / mean over ranks": max(p["forward_compute_ms"] for p in payloads)
               / (sum(p["forward_compute_ms"] for p in payloads) / n),
               "K/V block bytes": block}
    if config.causal and config.split == "zigzag":
        checks.append(Check("zigzag: every rank computes the same number of unmasked scores", max(work) - min(work), 0,
                            reference="2n chunks, rank r holds r and 2n-1-r"))
    steps = [{"rank": p["rank"], **s} for p in payloads for s in p["steps"]]
    ring = with_hidden([{"rank": p["rank"], **r} for p in payloads for r in p["ring"]])
    layout = [{"rank": p["rank"], "position": x} for p in payloads for x in p["positions"]]
    notes = ["PyTorch's own context parallel (torch.distributed.tensor.experimental.context_parallel) replaces only the "
             "CUDA SDPA ops (aten._scaled_dot_product_flash / efficient / cudnn_attention and their backwards); on a CPU "
             "SDPA runs aten._scaled_dot_product_flash_attention_for_cpu, which it does not handle. So this ring is ours, "
             "checked against SDPA on the whole sequence instead."]
    return Result(metrics=metrics, checks=checks, tables={"steps": steps, "ring": ring, "layout": layout,
                                                          "work": [{"rank": p["rank"], "unmasked scores": p["unmasked_scores"],
                                                                    "forward compute ms": p["forward_compute_ms"],
                                                                    "activation_bytes": p["activation_bytes"]} for p in payloads]},
                  notes=notes, trace_events=[e for p in payloads for e in p["trace"]["events"]])


def with_hidden(ring: list[dict]) -> list[dict]:
    """Each K/V transfer's time in flight split in two: `blocked_us` the rank waited for it (the Wire's exposed tail),
    `hidden_us` the rest, which ran while the rank computed on the previous block."""
    for r in ring:
        r["hidden_us"] = r["in_flight_us"] - r["blocked_us"]
    return ring


RESULT = Schema(
    metrics=("unmasked scores, max / mean over ranks", "forward compute ms, max / mean over ranks", "K/V block bytes"),
    tables={"steps": ("rank", "step", "block_of_rank", "computed", "running_lse_last_query"),
            "ring": ("rank", "what", "name", "op", "phase", "numel", "payload_bytes", "sent_bytes", "blocked_us", "in_flight_us",
                     "hidden_us"),
            "layout": ("rank", "position"),
            "work": ("rank", "unmasked scores", "forward compute ms", "activation_bytes")},
    version=2, upgrades={1: lambda result: with_hidden(result["tables"]["ring"])},  # v1: the page subtracted
)

EXPERIMENT = define(__name__, CPConfig, "ring attention: K/V blocks round the ring overlapping compute, log-sum-exp merge, "
                    "zigzag causal split; forward and backward against full SDPA",
                    rank_fn=run_rank, combine=combine, lanes=("compute", "comm"), schema=RESULT)
