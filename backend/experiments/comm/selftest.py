"""comm.selftest: the smallest distributed run, and a way to see how the launcher handles faults.

Each rank all-reduces its rank id; the sum is checked against n(n-1)/2. With `fault`, one rank
raises (crash), exits without a word (exit), or sleeps past the timeout (hang), so a user can
watch the run end as failed with that rank named, and tests can prove no process is left behind.
"""
from __future__ import annotations

import dataclasses
import os
import time

from backend.config import Config, ConfigError, setting
from backend.limits import cost
from backend.experiments import define
from backend.result import Check, Result, Schema
from backend.trace import Tracer


@dataclasses.dataclass
class SelftestConfig(Config):
    world_size: int = setting(2, min=1, max=8, help="number of ranks")
    fault: str = setting("none", choices=("none", "crash", "exit", "hang"), help="what the faulty rank does")
    fault_rank: int = setting(1, min=0, max=7, help="which rank misbehaves")

    cost_drivers = ("world_size",)

    def estimate(self):
        return cost(ranks=self.world_size)

    def check(self) -> None:
        if self.fault != "none" and self.fault_rank >= self.world_size:
            raise ConfigError("fault_rank", f"{self.fault_rank} is not a rank (allowed: 0..{self.world_size - 1})")


def rank_main(rank: int, world: int, config: SelftestConfig, ctx) -> dict:
    import torch
    import torch.distributed as dist

    tracer = Tracer(rank)
    tracer.align(dist.barrier)
    if rank == config.fault_rank:
        if config.fault == "crash":
            raise RuntimeError(f"injected crash on rank {rank}")
        if config.fault == "exit":
            os._exit(3)
        if config.fault == "hang":
            time.sleep(10_000)
    x = torch.tensor([float(rank)])
    if rank == 0:  # what a stopped run still shows: how far it got, and what it had
        ctx.progress(0.5, "rank 0 in the all-reduce, waiting for every rank")
        ctx.partial("Rank 0 reached the all-reduce with its input; a rank that did not is named in the error.",
                    metrics={"rank 0 input": x.item()})
    with tracer.span("collective", "all_reduce"):
        dist.all_reduce(x)
    return {"sum": x.item(), "trace": tracer.payload()}


def combine(config: SelftestConfig, payloads: list[dict]) -> Result:
    n = len(payloads)
    expected = n * (n - 1) / 2
    err = max(abs(p["sum"] - expected) for p in payloads)
    return Result(
        metrics={"world_size": n, "sum": payloads[0]["sum"]},
        checks=[Check("all_reduce of rank ids equals n(n-1)/2", err, 0.0, reference="closed form")],
        trace_events=[e for p in payloads for e in p["trace"]["events"]],
    )


RESULT = Schema(metrics=("world_size", "sum"), tables={})

EXPERIMENT = define(__name__, SelftestConfig,
    "all-reduce of rank ids on gloo; optional injected crash, silent exit or hang on one rank",
    rank_fn=rank_main, combine=combine, lanes=("collective",), schema=RESULT,
)
