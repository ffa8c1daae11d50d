"""parallel.fsdp: PyTorch FSDP2 on the same workload, the peer of our ZeRO-3."""
from __future__ import annotations

import dataclasses

from backend.config import setting
from backend.experiments import define
from backend.experiments.parallel import dp_model
from backend.limits import plus_cpu
from backend.parallel.fsdp import FSDP2
from backend.parallel.loop import start_rank, train
from backend.parallel.workload import WorkloadConfig


@dataclasses.dataclass
class FSDPConfig(WorkloadConfig):
    offload: bool = setting(False, help="FSDP2's CPUOffloadPolicy: sharded parameters, gradients and Adam states on the host")
    model: str = dp_model.model_setting()

    def check(self) -> None:
        super().check()
        dp_model.check_plan(self, "fsdp2", {"offload": (False, "CPUOffloadPolicy's two pools are accounted on the MLP loop")})

    def estimate(self):
        """The workload's, plus FSDP2's DTensor machinery on every rank (~1.2 s of CPU a rank: 7.1 s at the defaults
        against 2.8 s for our ZeRO-1 on the same workload, measured) and gloo's ring steps: per layer an all-gather in
        the forward, one in the backward (resharded after the forward) and a reduce-scatter."""
        if self.model == "tiny_llama":
            return dp_model.mesh_plan(self, "fsdp2").estimate()
        base = super().estimate()
        return plus_cpu(base, 1.2 * self.world_size + self.ring_cpu_s(3 * self.layers))


def run_rank(rank, world, config: FSDPConfig, ctx):
    if config.model == "tiny_llama":
        return dp_model.run_rank(rank, world, config, ctx, "fsdp2")
    mesh, tracer = start_rank(rank, world)
    return train(FSDP2(config.workload, mesh, tracer, offload=config.offload), ctx.progress)


EXPERIMENT = define(__name__, FSDPConfig, "PyTorch FSDP2 (fully_shard per layer) on the same workload: the peer of our ZeRO-3",
                    rank_fn=run_rank, lanes=("compute", "collective"),
                    combine=lambda config, reports: dp_model.combine(config, reports, "fsdp2", "fsdp2")
                    if config.model == "tiny_llama" else dp_model.combine_mlp(config, reports),
                    preload=("torch.distributed.fsdp",), schema=dp_model.result_schema())
