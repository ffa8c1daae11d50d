"""parallel.ddp: our DDP beside torch DistributedDataParallel, checked against one process."""
from __future__ import annotations

import dataclasses

from backend.config import Estimate, setting
from backend.experiments import define
from backend.parallel import ddp
from backend.parallel.reconcile import make_combine
from backend.parallel.workload import WorkloadConfig


@dataclasses.dataclass
class DDPConfig(WorkloadConfig):
    bucket_kb: int = setting(25, min=1, max=1 << 20, help="bucket size in KiB")
    overlap: bool = setting(True, help="launch each bucket's all-reduce during backward")
    comm_delay_ms: int = setting(0, min=0, max=1000, help="simulated slow network: extra time per bucket all-reduce")

    cost_drivers = ("comm_delay_ms",) + WorkloadConfig.cost_drivers

    def estimate(self):
        """The workload's, plus the simulated network's delay on every bucket of every step."""
        base = super().estimate()
        buckets = -(-self.layers * (self.hidden * self.hidden + self.hidden) * 8 // (self.bucket_kb * 1024))
        return Estimate(base.memory_bytes, base.seconds + 2 * self.steps * buckets * self.comm_delay_ms / 1000)


EXPERIMENT = define(__name__, DDPConfig, "our DDP (hooks, reverse-order buckets, overlapped async all-reduce) beside torch DDP",
                    rank_fn=ddp.run_rank, combine=make_combine(lambda c: "ddp"), lanes=("compute", "collective"))
