"""parallel.zero: ZeRO-1/2/3 (the mesh's, on the tiny LLaMA) over our ring collectives; memory and bytes against 2ψ/2ψ/3ψ."""
from __future__ import annotations

import dataclasses

from backend.config import ConfigError, setting
from backend.experiments import define
from backend.experiments.parallel import dp_model


@dataclasses.dataclass
class ZeroConfig(dp_model.DPConfig):
    stage: int = setting(1, min=1, max=3, help="ZeRO stage: 1 optimizer states, 2 and gradients, 3 and parameters")
    precision: str = setting("fp64", choices=("fp64", "bf16_mixed"),
                             help="fp64 throughout, or the mesh's bf16 mixed precision: bf16 compute, fp32 master weights, "
                                  "Adam states and gradient sums")
    offload: bool = setting(False, help="ZeRO-Offload (stages 1, 2): master shard, Adam states and the Adam step on the host pool")

    def check(self) -> None:
        super().check()
        if self.offload and self.stage == 3:
            raise ConfigError("offload", "ZeRO-Offload is built on stages 1 and 2 (allowed with stage=3: false)")
        dp_model.check_plan(self, f"zero{self.stage}")

    def estimate(self):
        """The mesh plan's."""
        return dp_model.mesh_plan(self, f"zero{self.stage}").estimate()


def run_rank(rank, world, config: ZeroConfig, ctx):
    return dp_model.run_rank(rank, world, config, ctx, f"zero{config.stage}")


EXPERIMENT = define(__name__, ZeroConfig, "ZeRO-1/2/3 with Adam over our ring collectives: memory per rank and bytes sent vs 2ψ/2ψ/3ψ",
                    rank_fn=run_rank, lanes=("compute", "collective", "comm"),
                    combine=lambda config, reports: dp_model.combine(config, reports, f"zero{config.stage}", f"zero{config.stage}"),
                    schema=dp_model.result_schema())
