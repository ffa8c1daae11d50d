"""parallel.fsdp: PyTorch FSDP2 on the same workload, the peer of our ZeRO-3."""
from __future__ import annotations

import dataclasses

from backend.experiments import define
from backend.parallel import fsdp
from backend.parallel.reconcile import make_combine
from backend.parallel.workload import WorkloadConfig


@dataclasses.dataclass
class FSDPConfig(WorkloadConfig):
    pass


EXPERIMENT = define(__name__, FSDPConfig, "PyTorch FSDP2 (fully_shard per layer) on the same workload: the peer of our ZeRO-3",
                    rank_fn=fsdp.run_rank, combine=make_combine(lambda c: "fsdp"), lanes=("compute",))
