"""parallel.mesh: the tiny LLaMA trained on a pp x dp x cp x tp mesh, against one process on the whole batch."""
from __future__ import annotations

import dataclasses

import torch

from backend.config import DYNAMO_IMPORT_S, OP_S, ConfigError, setting
from backend.experiments import define
from backend.experiments.parallel.tp import TPConfig, decoder_cost
from backend.parallel.mesh import DeviceMesh
from backend.parallel.mesh_train import reference_training, train_rank
from backend.parallel.sp import activation_elements
from backend.parallel.tp import cut
from backend.parallel.tp_model import expected_collectives
from backend.parallel.wire import ring_bytes
from backend.result import Check, Result

TOL = 1e-9  # float64 after a few Adam steps: sums regrouped over ranks, then divided by √v
# Seed 002's picture: 8 GPUs as two 4-stage pipelines with data parallel between them.
PRESETS = {"seed 002: two 4-stage pipelines, data parallel between (8 ranks)": {"world_size": 8, "pp": 4, "tp": 1, "layers": 4}}


@dataclasses.dataclass
class MeshConfig(TPConfig):
    world_size: int = setting(4, min=1, max=8, help="ranks: pp x dp x cp x tp")
    tp: int = setting(2, min=1, max=8, help="tensor-parallel degree (innermost: neighbouring ranks)")
    pp: int = setting(2, min=1, max=8, help="pipeline stages (outermost); dp = world_size / (tp x pp x cp)")
    cp: int = setting(1, min=1, max=8, help="context-parallel degree: each sequence's positions split over cp ranks "
                                            "(zigzag), keys and values passed round a ring")
    microbatches: int = setting(2, min=1, max=16, help="micro-batches per step per data-parallel rank (GPipe)")
    batch: int = setting(4, min=1, max=64, help="sequences in the global batch")
    seq: int = setting(8, min=2, max=256, help="tokens per sequence")
    layers: int = setting(4, min=1, max=16, help="decoder blocks (split over the stages)")
    steps: int = setting(3, min=1, max=50, help="training steps (Adam)")
    lr: float = setting(0.01, min=0.0, max=1.0, help="Adam learning rate")

    cost_drivers = ("steps", "d_model", "seq", "batch", "layers", "d_ff", "vocab", "world_size", "cp", "microbatches")

    def estimate(self):
        """The leader trains the whole model on the whole batch as the reference, and every rank its part (counted
        as the whole, for the bubbles and re-sends). The leader's torch.optim.Adam imports torch._dynamo; the ranks'
        hand-written Adam does not. Each ring attention step is a few Python-level sends and block updates: 3cp - 2
        of them per layer per micro-batch per step on every rank."""
        base = decoder_cost(self, self.world_size + 1, passes=self.steps, seconds=DYNAMO_IMPORT_S)
        ring_steps = self.world_size * self.steps * self.microbatches * self.layers * (3 * self.cp - 2) if self.cp > 1 else 0
        return dataclasses.replace(base, seconds=base.seconds + ring_steps * 200 * OP_S)

    @property
    def tp_degree(self):
        return "tp", self.tp

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp * self.cp)

    def check(self) -> None:
        model_parallel = self.tp * self.pp * self.cp
        if self.world_size % model_parallel:
            # name the largest mesh dimension and the largest value of it that fits beside the other two
            name = max(("tp", "pp", "cp"), key=lambda d: getattr(self, d))
            others = model_parallel // getattr(self, name)
            fits = [v for v in range(getattr(self, name), 0, -1) if self.world_size % (v * others) == 0]
            hint = (f"allowed with the other settings as they are: {name} = {fits[0]}" if fits
                    else "allowed: tp x pp x cp a divisor of world_size")
            raise ConfigError(name, f"{getattr(self, name)}: tp x pp x cp = {model_parallel} does not divide "
                                    f"world_size={self.world_size} ({hint})")
        super().check()
        if self.cp > 1 and self.seq % (2 * self.cp):
            raise ConfigError("seq", f"{self.seq} does not split into 2 x cp = {2 * self.cp} zigzag chunks "
                                     f"(allowed: a multiple of {2 * self.cp})")
        if self.layers % self.pp:
            raise ConfigError("layers", f"{self.layers} does not divide into pp={self.pp} stages (allowed: a multiple of {self.pp})")
        if self.batch < self.dp * self.microbatches:
            raise ConfigError("batch", f"{self.batch} sequences cannot give dp={self.dp} ranks {self.microbatches} micro-batches "
                                       f"each (allowed: >= {self.dp * self.microbatches})")


def run_rank(rank, world, config: MeshConfig, ctx):
    return train_rank(rank, world, config, ctx.progress)


def _microbatch_sizes(config: MeshConfig, dp_index: int) -> list[int]:
    return [len(s) for s in torch.arange(config.batch).tensor_split(config.dp)[dp_index].tensor_split(config.microbatches)]


def predicted_bytes(config: MeshConfig, payload: dict) -> dict[str, int]:
    """What one rank sends per run, dimension by dimension, from the shapes alone."""
    s, h, steps = config.seq // config.cp, config.d_model, config.steps
    sizes = _microbatch_sizes(config, payload["coords"]["dp"])
    stage = payload["coords"]["pp"]
    act = sum(b * s * h * 8 for b in sizes)  # one activation (or its gradient) per micro-batch
    kv_block = sum(2 * b * (config.n_kv_heads // config.tp) * s * config.d_head * 8 for b in sizes)
    n = payload["flat_numel"]

    def gradients(k: int) -> int:
        return steps * ring_bytes("all_reduce", -(-n // k) * k, k, 8) if k > 1 else 0
    tp = sum(r["sent_bytes"] for b in sizes if config.tp > 1
             for r in expected_collectives(config, config.tp, False, batch=b, seq=s, layers=payload["layers_here"],
                                           first=stage == 0, last=stage == config.pp - 1, index=payload["coords"]["tp"]))
    return {"tp": steps * tp, "pp": steps * act * ((stage < config.pp - 1) + (stage > 0)),
            # per layer: forward cp-1 K/V blocks; backward cp-1 K/V blocks and cp dK/dV blocks (the last one home)
            "cp ring": steps * payload["layers_here"] * kv_block * (3 * config.cp - 2) if config.cp > 1 else 0,
            "dp gradients": gradients(config.dp), "cp gradients": gradients(config.cp)}


def activation_formula(config: MeshConfig, payload: dict) -> float:
    """sp.activation_elements x the blocks on this stage x micro-batches (+ RoPE's tables), in bytes."""
    s = config.seq // config.cp
    ring = config.n_kv_heads * config.d_head if config.cp > 1 else None
    per_block = lambda b: sum(activation_elements(b, s, config.d_model, config.n_heads, config.n_heads * config.d_head,  # noqa: E731
                                                  config.d_ff, config.tp, False, ring).values())
    return sum(payload["layers_here"] * per_block(b) + s * config.d_head
               for b in _microbatch_sizes(config, payload["coords"]["dp"])) * 8


def combine(config: MeshConfig, payloads) -> Result:
    # one thread: a tiny model's ops are far too small to split, and two threads spinning on two shared cores made
    # the reference 10x slower (0.6 s against 8 s measured at load 10)
    torch.set_num_threads(1)
    ref = reference_training(config)
    last = next(p for p in payloads if p["last_stage"])
    param_err = max((torch.from_numpy(v) - cut(ref["state"], p["sources"])[k]).abs().max().item()
                    for p in payloads for k, v in p["params"].items())
    loss_err = max(abs(a - b) for a, b in zip(last["losses"], ref["losses"]))
    covered = {ref_name for p in payloads for _, pieces in p["sources"].values() for ref_name, _ in pieces}
    checks = [Check("final parameters: every rank's shard equals one process on the whole batch", param_err, TOL,
                    reference="TinyDecoder, float64, torch.optim.Adam, one process"),
              Check("every step's loss equals the reference", loss_err, TOL, reference="one process"),
              Check("the shards cover every reference parameter", len(set(ref["state"]) - covered), 0, reference="state_dict names")]
    for p in payloads:
        model = predicted_bytes(config, p)
        checks.append(Check(f"rank {p['rank']}: tensor, pipeline, ring and gradient bytes equal the model",
                            sum(abs(p["bytes"][k] - v) for k, v in model.items()), 0,
                            reference="TP: tp_model.expected_collectives per micro-batch on this stage; PP: activations "
                                      "forward and gradients backward per micro-batch per stage boundary; CP: per layer 3cp-2 "
                                      "K/V-sized ring messages; 2(k-1)/k of the gradient vector over dp and cp"))
    memory = []
    for p in payloads:
        formula = activation_formula(config, p)
        for cat, got in p["memory"].items():
            memory.append({"rank": p["rank"], "category": cat, "measured_bytes": got,
                           "formula_bytes": formula if cat == "activations" else None})
    acts = [r for r in memory if r["category"] == "activations"]
    checks.append(Check("activations held at GPipe's peak within 10 % of the formula",
                        max(abs(r["measured_bytes"] / r["formula_bytes"] - 1) for r in acts), 0.10,
                        reference="sp.activation_elements x layers on the stage x micro-batches (+ RoPE tables)"))
    label = " ".join(f"{d}={v}" for d, v in (("pp", config.pp), ("dp", config.dp), ("cp", config.cp), ("tp", config.tp)))
    loss = [{"step": i, "loss": v, "run": f"mesh {label}"} for i, v in enumerate(last["losses"])] + \
           [{"step": i, "loss": v, "run": "reference (1 process)"} for i, v in enumerate(ref["losses"])]
    ranks = [{"rank": p["rank"], **p["coords"], "layers": p["layers_here"], **{f"{k} bytes sent": v for k, v in p["bytes"].items()}}
             for p in payloads]
    metrics = {"pp": config.pp, "dp": config.dp, "cp": config.cp, "tp": config.tp, "steps": config.steps,
               "final_loss": last["losses"][-1]}
    return Result(metrics=metrics, checks=checks, tables={"loss": loss, "ranks": ranks, "memory": memory,
                                                          "groups": _groups(config)},
                  trace_events=[e for p in payloads for e in p["trace"]["events"]])


def _groups(config) -> list[dict]:
    shape = DeviceMesh.layout(config.world_size, pp=config.pp, dp=config.dp, cp=config.cp, tp=config.tp)
    return [{"dimension": d, "group": i, "ranks": ranks} for d in ("pp", "dp", "cp", "tp") if shape[d] > 1
            for i, ranks in enumerate(DeviceMesh.lines(shape, d))]


EXPERIMENT = define(__name__, MeshConfig, "3D parallel: the tiny LLaMA trained on a pp x dp x cp x tp mesh (GPipe stages, TP "
                    "shards, ring attention over sequence shards, DP all-reduce), equal to one process on the whole batch",
                    rank_fn=run_rank, combine=combine, lanes=("compute", "collective", "comm"))
