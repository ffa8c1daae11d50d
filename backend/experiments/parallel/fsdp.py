"""parallel.fsdp: PyTorch FSDP2 on the same workload, the peer of our ZeRO-3."""
from __future__ import annotations

import dataclasses

from backend.config import setting
from backend.experiments import define
from backend.limits import plus_cpu
from backend.parallel.fsdp import FSDP2
from backend.parallel.loop import start_rank, train
from backend.parallel.reconcile import combine
from backend.parallel.workload import WorkloadConfig


@dataclasses.dataclass
class FSDPConfig(WorkloadConfig):
    offload: bool = setting(False, help="FSDP2's CPUOffloadPolicy: sharded parameters, gradients and Adam states on the host")

    def estimate(self):
        """The workload's, plus FSDP2's DTensor machinery on every rank (~1.2 s of CPU a rank: 7.1 s at the defaults
        against 2.8 s for our ZeRO-1 on the same workload, measured)."""
        base = super().estimate()
        return plus_cpu(base, 1.2 * self.world_size)


def run_rank(rank, world, config: FSDPConfig, ctx):
    mesh, tracer = start_rank(rank, world)
    return train(FSDP2(config.workload, mesh, tracer, offload=config.offload), ctx.progress)


EXPERIMENT = define(__name__, FSDPConfig, "PyTorch FSDP2 (fully_shard per layer) on the same workload: the peer of our ZeRO-3",
                    rank_fn=run_rank, combine=combine, lanes=("compute",),
                    preload=("torch.distributed.fsdp",))
