"""parallel.ddp: our DDP beside torch DistributedDataParallel, checked against one process."""
from __future__ import annotations

import dataclasses

from backend.config import ConfigError, setting
from backend.limits import SLEEP_CPU, plus_cpu, with_wait
from backend.experiments import define
from backend.experiments.parallel import dp_model
from backend.parallel.ddp import DDP, TorchDDP
from backend.parallel.loop import start_rank, train
from backend.parallel.workload import WorkloadConfig
from backend.trace import Tracer


@dataclasses.dataclass
class DDPConfig(WorkloadConfig):
    bucket_kb: int = setting(25, min=1, max=1 << 20, help="bucket size in KiB")
    overlap: bool = setting(True, help="launch each bucket's all-reduce during backward")
    comm_delay_ms: int = setting(0, min=0, max=1000, help="simulated slow network: extra time per bucket all-reduce")
    precision: str = setting("fp64", choices=("fp64", "bf16_mixed"),
                             help="tiny_llama: fp64 throughout, or the mesh's bf16 mixed precision (bf16 compute, fp32 "
                                  "master weights, Adam states and gradient sums)")
    model: str = dp_model.model_setting()

    cost_drivers = ("comm_delay_ms",) + WorkloadConfig.cost_drivers

    def check(self) -> None:
        super().check()
        if self.model == "mlp" and self.precision != "fp64":
            raise ConfigError("precision", f"{self.precision} with model=mlp: the MLP loop's DDP runs float64 (allowed: "
                                           "fp64, or model=tiny_llama)")
        dp_model.check_plan(self, "ddp", MLP_ONLY)

    def estimate(self):
        """With tiny_llama, the mesh plan's plus torch's DDP peer. Else the workload's, plus torch's DDP peer on every rank
        (~1.2 s of CPU a rank: 7.9 s at the defaults against 2.8 s for ZeRO-1 on the same workload, measured), plus the
        simulated network's delay on every bucket of every step."""
        if self.model == "tiny_llama":
            return plus_cpu(dp_model.mesh_plan(self, "ddp").estimate(), 1.2 * self.world_size)
        base = super().estimate()
        buckets = -(-self.layers * (self.hidden * self.hidden + self.hidden) * 8 // (self.bucket_kb * 1024))
        rings = self.ring_cpu_s(2 * 2 * buckets)  # ours and torch's peer: an all-reduce per bucket each
        return with_wait(plus_cpu(base, 1.2 * self.world_size + rings), 2 * self.steps * buckets * self.comm_delay_ms / 1000, SLEEP_CPU)


MLP_ONLY = {"comm_delay_ms": (0, "the simulated slow network is the MLP loop's, for its overlap view")}


def run_rank(rank, world, config: DDPConfig, ctx):
    if config.model == "tiny_llama":
        return dp_model.run_rank(rank, world, config, ctx, "ddp", peer=True)
    mesh, tracer = start_rank(rank, world)
    ours = train(DDP(config.workload, mesh, tracer, bucket_kb=config.bucket_kb, overlap=config.overlap,
                     comm_delay_ms=config.comm_delay_ms), ctx.progress)
    peer = train(TorchDDP(config.workload, mesh, Tracer(rank), bucket_kb=config.bucket_kb))
    ours.extra["peer_params"] = peer.params
    return ours


EXPERIMENT = define(__name__, DDPConfig, "our DDP (hooks, reverse-order buckets, overlapped async all-reduce) beside torch DDP",
                    rank_fn=run_rank, combine=lambda config, reports: dp_model.combine(config, reports, "ddp", "ddp") if config.model == "tiny_llama"
                    else dp_model.combine_mlp(config, reports, peer="torch DistributedDataParallel"),
                    lanes=("compute", "collective"), schema=dp_model.result_schema())
