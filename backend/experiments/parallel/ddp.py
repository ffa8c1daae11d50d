"""parallel.ddp: our DDP (the mesh's, on the tiny LLaMA) beside torch DistributedDataParallel, checked against one process."""
from __future__ import annotations

import dataclasses

from backend.config import setting
from backend.limits import plus_cpu
from backend.experiments import define
from backend.experiments.parallel import dp_model


@dataclasses.dataclass
class DDPConfig(dp_model.DPConfig):
    bucket_kb: int = setting(25, min=1, max=1 << 20, help="bucket size in KiB")
    overlap: bool = setting(True, help="launch each bucket's all-reduce during backward")
    comm_delay_ms: int = setting(0, min=0, max=1000, help="simulated slow network: extra time per bucket all-reduce, on "
                                                          "the dp wire (overlapped with the backward when overlap is on)")
    precision: str = setting("fp64", choices=("fp64", "bf16_mixed"),
                             help="fp64 throughout, or the mesh's bf16 mixed precision (bf16 compute, fp32 master weights, "
                                  "Adam states and gradient sums)")

    cost_drivers = ("comm_delay_ms",) + dp_model.DPConfig.cost_drivers

    def check(self) -> None:
        super().check()
        dp_model.check_plan(self, "ddp")

    def estimate(self):
        """The mesh plan's (the slow link's waits included) plus torch's DDP peer (~1.2 s of CPU a rank)."""
        return plus_cpu(dp_model.mesh_plan(self, "ddp").estimate(), 1.2 * self.world_size)


def run_rank(rank, world, config: DDPConfig, ctx):
    return dp_model.run_rank(rank, world, config, ctx, "ddp", peer=True)


EXPERIMENT = define(__name__, DDPConfig, "our DDP (hooks, reverse-order buckets, overlapped async all-reduce) beside torch DDP",
                    rank_fn=run_rank, combine=lambda config, reports: dp_model.combine(config, reports, "ddp", "ddp"),
                    lanes=("compute", "collective"), schema=dp_model.result_schema())
