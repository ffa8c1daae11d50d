"""parallel.fsdp: PyTorch FSDP2 (fully_shard on the tiny LLaMA, through the mesh), the peer of our ZeRO-3."""
from __future__ import annotations

import dataclasses

from backend.config import setting
from backend.experiments import define
from backend.experiments.parallel import dp_model
from backend.limits import plus_cpu


@dataclasses.dataclass
class FSDPConfig(dp_model.DPConfig):
    offload: bool = setting(False, help="FSDP2's CPUOffloadPolicy: sharded parameters, gradients and Adam states on the host")

    def check(self) -> None:
        super().check()
        dp_model.check_plan(self, "fsdp2")

    def estimate(self):
        """The mesh plan's, plus FSDP2's DTensor machinery on every rank (~0.6 s of CPU a rank: 13.4 s measured at the
        largest settings, 8 ranks, against 13.0 for the plan alone, at load 15)."""
        return plus_cpu(dp_model.mesh_plan(self, "fsdp2").estimate(), 0.6 * self.world_size)


def run_rank(rank, world, config: FSDPConfig, ctx):
    return dp_model.run_rank(rank, world, config, ctx, "fsdp2")


EXPERIMENT = define(__name__, FSDPConfig, "PyTorch FSDP2 (fully_shard per stage) on the tiny LLaMA: the peer of our ZeRO-3",
                    rank_fn=run_rank, lanes=("compute", "collective"),
                    combine=lambda config, reports: dp_model.combine(config, reports, "fsdp2", "fsdp2"),
                    preload=("torch.distributed.fsdp",), schema=dp_model.result_schema())
