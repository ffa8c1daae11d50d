"""parallel.fsdp: PyTorch FSDP2 (fully_shard on the tiny LLaMA, through the mesh), the peer of our ZeRO-3."""
from __future__ import annotations

import dataclasses

from backend.config import setting
from backend.experiments import define
from backend.experiments.parallel import dp_model


@dataclasses.dataclass
class FSDPConfig(dp_model.DPConfig):
    offload: bool = setting(False, help="FSDP2's CPUOffloadPolicy: sharded parameters, gradients and Adam states on the host")

    def check(self) -> None:
        super().check()
        dp_model.check_plan(self, "fsdp2")

    def estimate(self):
        """The mesh plan's."""
        return dp_model.mesh_plan(self, "fsdp2").estimate()


def run_rank(rank, world, config: FSDPConfig, ctx):
    return dp_model.run_rank(rank, world, config, ctx, "fsdp2")


EXPERIMENT = define(__name__, FSDPConfig, "PyTorch FSDP2 (fully_shard per stage) on the tiny LLaMA: the peer of our ZeRO-3",
                    rank_fn=run_rank, lanes=("compute", "collective"),
                    combine=lambda config, reports: dp_model.combine(config, reports, "fsdp2", "fsdp2"),
                    preload=("torch.distributed.fsdp",), schema=dp_model.result_schema())
