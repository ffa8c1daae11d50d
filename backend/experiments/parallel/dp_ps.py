"""parallel.dp_ps: parameter servers (seeds 000 and 002) on the shared data-parallel workload."""
from __future__ import annotations

import dataclasses

from backend.config import ConfigError, setting
from backend.limits import with_wait
from backend.experiments import define
from backend.parallel import dp_ps
from backend.parallel.dp_ps import combine_ps
from backend.parallel.workload import WorkloadConfig
from backend.result import Schema


@dataclasses.dataclass
class PSConfig(WorkloadConfig):
    mode: str = setting("sync", choices=("sync", "async", "stale"), help="synchronous, asynchronous, or bounded staleness")
    staleness: int = setting(1, min=0, max=16, help="stale mode: how many pushes a worker may run ahead of the slowest")
    server: str = setting("dedicated", choices=("rank0", "dedicated"), help="rank 0 also works (seed's GPU0 DP), or only serves")
    straggler_ms: int = setting(0, min=0, max=1000, help="extra time per step on the last worker")

    cost_drivers = ("straggler_ms",) + WorkloadConfig.cost_drivers

    def estimate(self):
        """The workload's, plus the straggler's wait on every step."""
        base = super().estimate()
        return with_wait(base, 2 * self.steps * self.straggler_ms / 1000)

    def check(self) -> None:
        super().check()
        if self.server == "rank0" and self.mode != "sync":
            raise ConfigError("mode", f"{self.mode!r} needs server=dedicated (allowed with server=rank0: sync, seed 000's DP)")


RESULT = Schema(
    metrics=("strategy", "world_size", "workers", "final_eval_loss", "updates"),
    tables={"staleness": ("update", "worker", "step", "based_on", "staleness"), "eval": ("update", "loss"),
            "volume": ("rank", "sent_bytes", "recv_bytes")},
)

EXPERIMENT = define(__name__, PSConfig, "parameter servers: rank 0 or dedicated; synchronous, asynchronous, bounded staleness",
                    rank_fn=dp_ps.run_rank, combine=combine_ps, lanes=("compute", "collective", "send", "recv"), schema=RESULT)
