"""parallel.dp_ps: parameter servers (seeds 000 and 002) training the tiny LLaMA, push and pull over our P2P."""
from __future__ import annotations

import dataclasses

from backend.config import ConfigError, setting
from backend.limits import with_wait
from backend.experiments import define
from backend.experiments.parallel import dp_model
from backend.parallel import dp_ps
from backend.result import Schema


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


RESULT = Schema(
    metrics=("strategy", "world_size", "workers", "final_eval_loss", "updates"),
    tables={"staleness": ("update", "worker", "step", "based_on", "staleness"), "eval": ("update", "loss"),
            "volume": ("rank", "sent_bytes", "recv_bytes")},
)

EXPERIMENT = define(__name__, PSConfig, "parameter servers training the tiny LLaMA: rank 0 or dedicated; synchronous, "
                    "asynchronous, bounded staleness", rank_fn=run_rank,
                    combine=lambda config, payloads: dp_ps.combine_ps(config, plan(config), payloads),
                    lanes=("compute", "collective", "send", "recv"), schema=RESULT)
