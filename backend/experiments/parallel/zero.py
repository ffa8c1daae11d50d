"""parallel.zero: ZeRO-1/2/3 over our ring collectives; memory and bytes against 2ψ/2ψ/3ψ."""
from __future__ import annotations

import dataclasses

from backend.config import ConfigError, setting
from backend.experiments import define
from backend.limits import plus_cpu
from backend.experiments.parallel import dp_model
from backend.parallel.loop import start_rank, train
from backend.parallel.workload import PRECISIONS, WorkloadConfig
from backend.parallel.zero import ZeRO


@dataclasses.dataclass
class ZeroConfig(WorkloadConfig):
    stage: int = setting(1, min=1, max=3, help="ZeRO stage: 1 optimizer states, 2 and gradients, 3 and parameters")
    precision: str = setting("fp64", choices=("fp64", "bf16_mixed"),
                             help="fp64 throughout, or bf16 compute with fp32 master weights and Adam states (the MLP: stages 1, 2; "
                                  "tiny_llama: the mesh's bf16 mixed precision, fp32 gradient sums, every stage)")
    offload: bool = setting(False, help="ZeRO-Offload (stages 1, 2): master shard, Adam states and the Adam step on the host pool")
    model: str = dp_model.model_setting()

    def check(self) -> None:
        super().check()
        if self.precision == "bf16_mixed" and self.stage == 3 and self.model == "mlp":
            raise ConfigError("precision", "bf16_mixed with model=mlp is built for stages 1 and 2 (allowed with stage=3: "
                                           "fp64, or model=tiny_llama)")
        if self.offload and self.stage == 3:
            raise ConfigError("offload", "ZeRO-Offload is built on stages 1 and 2 (allowed with stage=3: false)")
        dp_model.check_plan(self, f"zero{self.stage}", MLP_ONLY)

    def estimate(self):
        """With tiny_llama, the mesh plan's. Else the workload's, plus the ring steps: a reduce-scatter and an all-gather
        a step (stages 1, 2), or per layer an all-gather in the forward, one in the backward and a reduce-scatter (3)."""
        if self.model == "tiny_llama":
            return dp_model.mesh_plan(self, f"zero{self.stage}").estimate()
        return plus_cpu(super().estimate(), self.ring_cpu_s(3 * self.layers if self.stage == 3 else 2))


MLP_ONLY = {}


def run_rank(rank, world, config: ZeroConfig, ctx):
    if config.model == "tiny_llama":
        return dp_model.run_rank(rank, world, config, ctx, f"zero{config.stage}")
    mesh, tracer = start_rank(rank, world)
    return train(ZeRO(config.workload, mesh, tracer, PRECISIONS[config.precision], stage=config.stage,
                      offload=config.offload), ctx.progress)


EXPERIMENT = define(__name__, ZeroConfig, "ZeRO-1/2/3 with Adam over our ring collectives: memory per rank and bytes sent vs 2ψ/2ψ/3ψ",
                    rank_fn=run_rank, lanes=("compute", "collective", "comm"),
                    combine=lambda config, reports: dp_model.combine(config, reports, f"zero{config.stage}", f"zero{config.stage}")
                    if config.model == "tiny_llama" else dp_model.combine_mlp(config, reports),
                    schema=dp_model.result_schema())
