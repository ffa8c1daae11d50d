"""parallel.mesh: the tiny LLaMA trained on a pp x dp x tp mesh, against one process on the whole batch."""
from __future__ import annotations

import dataclasses

import torch

from backend.config import DYNAMO_IMPORT_S, ConfigError, setting
from backend.experiments import define
from backend.experiments.parallel.tp import TPConfig, decoder_cost
from backend.parallel.mesh import DeviceMesh
from backend.parallel.mesh_train import reference_training, train_rank
from backend.parallel.sp import activation_elements
from backend.parallel.tp import cut
from backend.parallel.wire import ring_bytes
from backend.result import Check, Result

TOL = 1e-9  # float64 after a few Adam steps: sums regrouped over ranks, then divided by √v
# Seed 002's picture: 8 GPUs as two 4-stage pipelines with data parallel between them.
PRESETS = {"seed 002: two 4-stage pipelines, data parallel between (8 ranks)": {"world_size": 8, "pp": 4, "tp": 1, "layers": 4}}


@dataclasses.dataclass
class MeshConfig(TPConfig):
    world_size: int = setting(4, min=1, max=8, help="ranks: pp x dp x tp")
    tp: int = setting(2, min=1, max=8, help="tensor-parallel degree (innermost: neighbouring ranks)")
    pp: int = setting(2, min=1, max=8, help="pipeline stages (outermost); dp = world_size / (tp x pp)")
    microbatches: int = setting(2, min=1, max=16, help="micro-batches per step per data-parallel rank (GPipe)")
    batch: int = setting(4, min=1, max=64, help="sequences in the global batch")
    seq: int = setting(8, min=2, max=256, help="tokens per sequence")
    layers: int = setting(4, min=1, max=16, help="decoder blocks (split over the stages)")
    steps: int = setting(3, min=1, max=50, help="training steps (Adam)")
    lr: float = setting(0.01, min=0.0, max=1.0, help="Adam learning rate")

    cost_drivers = ("steps", "d_model", "seq", "batch", "layers", "d_ff", "vocab", "world_size")

    def estimate(self):
        """The leader trains the whole model on the whole batch as the reference, and every rank its part (counted
        as the whole, for the bubbles and re-sends); each of these processes makes an Adam, whose first use imports
        torch._dynamo: the leader's as in any run, each rank's ~2.5 s more of CPU (measured) on the shared cores."""
        return decoder_cost(self, self.world_size + 1, passes=self.steps, seconds=DYNAMO_IMPORT_S + 2.5 * self.world_size)

    @property
    def tp_degree(self):
        return "tp", self.tp

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp)

    def check(self) -> None:
        if self.world_size % (self.tp * self.pp):
            raise ConfigError("tp", f"tp x pp = {self.tp * self.pp} does not divide world_size={self.world_size} "
                                    f"(allowed: tp x pp a divisor of world_size)")
        super().check()
        if self.layers % self.pp:
            raise ConfigError("layers", f"{self.layers} does not divide into pp={self.pp} stages (allowed: a multiple of {self.pp})")
        if self.batch < self.dp * self.microbatches:
            raise ConfigError("batch", f"{self.batch} sequences cannot give dp={self.dp} ranks {self.microbatches} micro-batches "
                                       f"each (allowed: >= {self.dp * self.microbatches})")


def run_rank(rank, world, config: MeshConfig, ctx):
    return train_rank(rank, world, config, ctx.progress)


def combine(config: MeshConfig, payloads) -> Result:
    ref = reference_training(config)
    last = next(p for p in payloads if p["last_stage"])
    param_err = max((torch.from_numpy(v) - cut(ref["state"], p["sources"])[k]).abs().max().item()
                    for p in payloads for k, v in p["params"].items())
    loss_err = max(abs(a - b) for a, b in zip(last["losses"], ref["losses"]))
    covered = {ref_name for p in payloads for _, pieces in p["sources"].values() for ref_name, _ in pieces}
    checks = [Check("final parameters: every rank's shard equals one process on the whole batch", param_err, TOL,
                    reference="TinyDecoder, float64, torch Adam, one process"),
              Check("every step's loss equals the reference", loss_err, TOL, reference="one process"),
              Check("the shards cover every reference parameter", len(set(ref["state"]) - covered), 0, reference="state_dict names")]
    dp, m = config.dp, config.microbatches
    for p in payloads:
        sizes = [len(s) for s in torch.arange(config.batch).tensor_split(dp)[p["coords"]["dp"]].tensor_split(m)]
        act = sum(b * config.seq * config.d_model * 8 for b in sizes)  # one activation (or its gradient) per micro-batch
        stage = p["coords"]["pp"]
        pp_model = config.steps * act * ((stage < config.pp - 1) + (stage > 0))
        dp_model = config.steps * (ring_bytes("all_reduce", -(-p["flat_numel"] // dp) * dp, dp, 8) if dp > 1 else 0)
        checks.append(Check(f"rank {p['rank']}: pipeline and data-parallel bytes equal the model",
                            abs(p["bytes"]["pp"] - pp_model) + abs(p["bytes"]["dp"] - dp_model), 0,
                            reference="activations forward and gradients backward per micro-batch per stage boundary; "
                                      "2(dp-1)/dp of the local gradient vector"))
    memory = []
    for p in payloads:
        sizes = [len(s) for s in torch.arange(config.batch).tensor_split(dp)[p["coords"]["dp"]].tensor_split(m)]
        formula = sum(p["layers_here"] * sum(activation_elements(b, config.seq, config.d_model, config.n_heads,
                                                                 config.n_heads * config.d_head, config.d_ff, config.tp, False).values())
                      + config.seq * config.d_head for b in sizes) * 8
        for cat, got in p["memory"].items():
            memory.append({"rank": p["rank"], "category": cat, "measured_bytes": got,
                           "formula_bytes": formula if cat == "activations" else None})
    acts = [r for r in memory if r["category"] == "activations"]
    checks.append(Check("activations held at GPipe's peak within 10 % of the formula",
                        max(abs(r["measured_bytes"] / r["formula_bytes"] - 1) for r in acts), 0.10,
                        reference="sp.activation_elements x layers on the stage x micro-batches (+ RoPE tables)"))
    loss = [{"step": i, "loss": v, "run": f"mesh pp={config.pp} dp={dp} tp={config.tp}"} for i, v in enumerate(last["losses"])] + \
           [{"step": i, "loss": v, "run": "reference (1 process)"} for i, v in enumerate(ref["losses"])]
    ranks = [{"rank": p["rank"], **p["coords"], "layers": p["layers_here"], **{f"{k} bytes sent": v for k, v in p["bytes"].items()}}
             for p in payloads]
    metrics = {"pp": config.pp, "dp": dp, "tp": config.tp, "steps": config.steps, "final_loss": last["losses"][-1]}
    return Result(metrics=metrics, checks=checks, tables={"loss": loss, "ranks": ranks, "memory": memory,
                                                          "groups": _groups(config)},
                  trace_events=[e for p in payloads for e in p["trace"]["events"]])


def _groups(config) -> list[dict]:
    shape = DeviceMesh.layout(config.world_size, pp=config.pp, dp=config.dp, tp=config.tp)
    return [{"dimension": d, "group": i, "ranks": ranks} for d in ("pp", "dp", "tp") if shape[d] > 1
            for i, ranks in enumerate(DeviceMesh.lines(shape, d))]


EXPERIMENT = define(__name__, MeshConfig, "3D parallel: the tiny LLaMA trained on a pp x dp x tp mesh (GPipe stages, TP shards, "
                    "DP all-reduce), equal to one process on the whole batch",
                    rank_fn=run_rank, combine=combine, lanes=("compute", "collective", "comm"))
