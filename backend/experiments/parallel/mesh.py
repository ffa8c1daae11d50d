"""parallel.mesh: the tiny LLaMA (dense, or MoE) trained on a pp x dp x cp x ep x tp mesh, against one process on the
whole batch."""
from __future__ import annotations

import dataclasses
import math
from collections import Counter
from statistics import fmean
from typing import ClassVar

import networkx as nx
import torch

from backend.config import ConfigError, setting
from backend.graph.dot import to_dot
from backend.limits import DYNAMO_IMPORT_S, OP_S, plus_cpu, with_wait
from backend.experiments import define
from backend.checkpoint import mesh_checks, mesh_run
from backend.experiments.parallel.tp import TPConfig, decoder_cost
from backend.parallel.ep import moe_activation_elements
from backend.parallel.mesh import DIMS, DeviceMesh
from backend.parallel.mesh_dp import STRATEGIES
from backend.parallel.mesh_train import peak_in_flight, train_rank
from backend.experiments.parallel._recompute import MIN_TIMED_CPU_MS, time_check
from backend.experiments.parallel._reference import reference_training
from backend.parallel.pp.schedules import SCHEDULES, is_action
from backend.parallel.recompute import MODES as RECOMPUTE, core_flops
from backend.experiments.parallel.pipeline import bubbles, least_costs, mark_least_cpu, model_against_replay, replayed
from backend.parallel.sp import activation_elements
from backend.parallel.pp.makespan import makespan
from backend.experiments.parallel._step_split import (CATEGORIES, drawn, match_calls, mean_action_costs,
                                                      measured_costs, parts, replay_split, replay_step, step_items)
from backend.parallel.tp import cut, part
from backend.parallel.tp_model import expected_collectives
from backend.parallel.token_split import TokenSplit, token_split
from backend.comm.collectives import ring_bytes
from backend.parallel.precision import PRECISIONS
from backend.result import Check, Result, Schema

TOL = 1e-9  # float64 after a few Adam steps: sums regrouped over ranks, then divided by √v
# Other precisions: the ranks regroup every sum (tp shards' partial products added in the ring's order, micro-batches'
# and dp slices' gradients summed apart), so each rounds differently from one process. Adam passes that on unevenly:
# an element whose gradient is smaller than the rounding noise may change sign, and its first steps move it by ±lr
# either way. So the final weights are compared as ‖p − p_ref‖ ÷ ‖p_ref − p_ref(0)‖ (a share of the update), and the
# losses (computed in fp32 from the logits, models.llama.at_least_fp32) relative to the loss, in eps of the compute
# dtype (bf16 2^-7, fp16 2^-10, fp32 2^-23). Measured on the test configurations, the defaults and the Megatron preset:
# bf16 0.050-0.059 of the update, loss within 0.07 eps (0.23 against float64); fp16 0.016-0.019, 0.08 eps; fp32
# 5e-7-3e-5, 3.6 eps (5.4 against float64). The bounds leave a margin of 2.5-16x; a lost master copy at lr 1e-3 (updates
# under a bf16 ulp of most weights) measures 0.22 of the update (tests/test_mesh_precision.py).
PRECISION_TOL = {  # against one process running the same recipe: (share of the update, loss in eps, why)
    "fp32": (5e-4, 32, "fp32 sums regrouped over ranks, then passed through Adam's m/√v"),
    "bf16_mixed": (0.15, 0.5, "bf16 activations and weight copies rounded in another order over ranks, then passed "
                              "through Adam's m/√v on the fp32 master"),
    "fp16_mixed": (0.15, 0.5, "fp16 activations and weight copies rounded in another order over ranks, then passed through "
                              "Adam's m/√v on the fp32 master")}
FP64_BOUND = {  # against float64: the recipe's own rounding of weights, activations and gradients (a bound, not equality)
    "fp32": (1e-3, 64, "fp32 rounding of everything float64 holds exactly enough"),
    "bf16_mixed": (0.25, 1, "bf16 rounding of weights, activations and gradients; fp32 master and Adam"),
    "fp16_mixed": (0.25, 1, "fp16 rounding of weights, activations and gradients; fp32 master and Adam; the steps the loss "
                            "scale skipped skipped there too")}
# Presets at tiny scale: each fills the settings it names (one line each, in PRESET_NOTES). The real systems run these
# shapes at thousands of GPUs; here every dimension is 2 so each strategy is live and checked on 4 or 8 ranks.
PRESETS = {
    "seed002": {"world_size": 8, "pp": 4, "tp": 1, "layers": 4},
    "3d8": {"world_size": 8, "pp": 2, "tp": 2},
    "moe_ep": {"world_size": 4, "pp": 2, "tp": 1, "ep": 2, "experts": 4},
    "megatron": {"world_size": 8, "tp": 2, "sp": True, "pp": 2, "schedule": "interleaved_1f1b", "virtual_stages": 2,
                 "dp_strategy": "zero1", "precision": "bf16_mixed"},
    "megatron4": {"world_size": 4, "tp": 1, "pp": 2, "schedule": "interleaved_1f1b", "virtual_stages": 2, "dp_strategy": "zero1",
                  "precision": "bf16_mixed"},
    "torchtitan": {"world_size": 8, "tp": 2, "pp": 2, "schedule": "1f1b", "dp_strategy": "fsdp2"},
    "torchtitan4": {"world_size": 4, "tp": 1, "pp": 2, "schedule": "1f1b", "dp_strategy": "fsdp2"},
    "torchtitan_cp": {"world_size": 8, "tp": 1, "cp": 2, "pp": 2, "schedule": "1f1b", "dp_strategy": "fsdp2"},
    "llama3": {"world_size": 8, "tp": 2, "cp": 2, "pp": 2, "schedule": "1f1b"},
    "deepseek_v3": {"world_size": 8, "tp": 1, "pp": 2, "ep": 2, "experts": 4, "schedule": "dualpipe_v",
                    "microbatches": 4, "batch": 16, "d_model": 16, "d_ff": 32, "dp_strategy": "zero1"},
    "ddp4": {"world_size": 4, "tp": 1, "pp": 2, "schedule": "1f1b", "dp_strategy": "ddp", "bucket_kb": 4},
}
PRESET_NOTES = {
    "seed002": "seed 002: 8 ranks as two 4-stage pipelines (GPipe) with data parallel between them",
    "3d8": "pp 2 x dp 2 x tp 2 on 8 ranks, every dimension live",
    "moe_ep": "MoE: 4 experts over ep 2, pipeline 2 (4 ranks)",
    "megatron": "Megatron-LM style: TP 2 + SP + interleaved 1F1B (2 chunks) + distributed optimizer (ZeRO-1) + bf16 with fp32 "
                "master weights and gradient sums, pp 2 x dp 2 (8 ranks)",
    "megatron4": "Megatron-LM style on 4 ranks: interleaved 1F1B (2 chunks) + ZeRO-1 over dp 2 + bf16 mixed precision (tp 1 to fit)",
    "torchtitan": "torchtitan style: FSDP2 (PyTorch's fully_shard, gathered once per step under PP) + TP 2 + 1F1B, pp 2 x dp 2 (8 ranks)",
    "torchtitan4": "torchtitan style on 4 ranks: FSDP2 (fully_shard) + 1F1B, pp 2 x dp 2",
    "torchtitan_cp": "torchtitan style with context parallel: FSDP2 (fully_shard) + CP 2 (ring, zigzag) + 1F1B, pp 2 x dp 2 (8 ranks)",
    "llama3": "Llama 3's dimensions tp 2, cp 2, pp 2 with 1F1B (8 ranks; dp 1 at this size; this mesh nests dp outside cp, "
              "Llama 3 puts dp outermost, the same groups when dp = 1)",
    "deepseek_v3": "DeepSeek-V3 style: EP 2 (4 experts) + DualPipe-V (4 micro-batches) + ZeRO-1, pp 2 x dp 2 (8 ranks; d_model 16 "
                   "to fit the run budget; fp64: MoE routing in bf16 flips near ties, so the exact routing checks need it)",
    "ddp4": "DDP with 4 KiB gradient buckets over dp 2, 1F1B over pp 2 (4 ranks)",
}


@dataclasses.dataclass
class MeshConfig(TPConfig):
    world_size: int = setting(4, min=1, max=8, help="ranks: pp x dp x cp x ep x tp")
    tp: int = setting(2, min=1, max=8, help="tensor-parallel degree (innermost: neighbouring ranks)")
    sp: bool = setting(False, help="sequence parallel (Megatron-LM) over the tp ranks: norms on sequence shards (of the "
                                   "cp shard, beside cp), each all-reduce a reduce-scatter and an all-gather, stages hand "
                                   "on sequence shards, MoE layers route only their shard's tokens")
    pp: int = setting(2, min=1, max=8, help="pipeline stages (outermost); dp = world_size / (tp x pp x cp x ep)")
    cp: int = setting(1, min=1, max=8, help="context-parallel degree: each sequence's positions split over cp ranks "
                                            "(zigzag), keys and values passed round a ring")
    ep: int = setting(1, min=1, max=8, help="expert-parallel degree: the MoE experts split over ep ranks, which "
                                            "also split the batch (needs experts > 0)")
    experts: int = setting(0, min=0, max=16, help="routed experts per MoE feed-forward (0: dense SwiGLU); each as wide "
                                                  "as d_ff, plus one shared expert")
    top_k: int = setting(2, min=1, max=4, help="experts per token (dropless routing)")
    schedule: str = setting("gpipe", choices=tuple(n for n, s in SCHEDULES.items() if not s.asynchronous),
                            help="pipeline schedule over the pp dimension, run by the pipeline page's executor")
    virtual_stages: int = setting(1, min=1, max=4, help="model chunks per pp rank (interleaved_1f1b; zb_v and "
                                                        "dualpipe_v hold 2 in a V)")
    microbatches: int = setting(2, min=1, max=16, help="micro-batches per step per data-parallel rank")
    dp_strategy: str = setting("allreduce", choices=STRATEGIES,
                               help="over dp: all-reduce the gradients; DDP (the same sum in buckets); ZeRO-1 (reduce-scatter, "
                                    "Adam on this rank's shard, all-gather the weights); ZeRO-2 (and keep only the gradient "
                                    "shard); ZeRO-3 (and the weights sharded between steps, gathered at each step's start); FSDP2 (PyTorch's "
                                    "fully_shard on each stage over the dp group, reshard_after_forward=False under pp)")
    recompute: str = setting("none", choices=RECOMPUTE, help="activation recompute per stage: full keeps only each "
                             "stage's input from F to B and reruns its forward, with its tp, cp and ep collectives, in the "
                             "backward (in I under a split backward, held to W); selective (Korthikanti) recomputes only "
                             "each attention core softmax(QKᵀ)V, keeping q, k, v (cp = 1). Its price is measured against "
                             "the same plan without it")
    compare_schedules: bool = setting(False, help="also run this plan under every other pipeline schedule the mesh can "
                                      "run with it (interleaved with 2 chunks): replayed step time, bubble and peak "
                                      "activations per rank side by side, each run checked as usual")
    precision: str = setting("fp64", choices=("fp64", "fp32", "bf16_mixed", "fp16_mixed"),
                             help="fp64 throughout (exact checks); fp32 throughout; bf16_mixed: bf16 weights, activations "
                                  "and tp/sp/cp/ep/pp messages, fp32 master weights, Adam m and v, and fp32 gradient sums "
                                  "over cp, ep and dp (FSDP's MixedPrecision(reduce_dtype=fp32), Megatron's fp32 main grads); "
                                  "fp16_mixed: the same in fp16, with dynamic loss scaling (GradScaler's rule: overflowing "
                                  "steps skipped, the scale halved). The loss is computed in fp32")
    init_loss_scale: int = setting(2 ** 16, min=1, max=2 ** 24, help="fp16_mixed: the loss scale S of the first step, a "
                                   "power of 2 (GradScaler's default 65536); too large and the first steps overflow and are skipped. A step whose "
                                   "largest gradient comes within rounding of fp16's max may overflow on the ranks and not in one "
                                   "process: the scale check then fails, showing each step's peak")
    bucket_kb: int = setting(4, min=1, max=1024, help="DDP's gradient bucket size (KiB), cut in reverse parameter order")
    offload: bool = setting(False, help="ZeRO-1/2: ZeRO-Offload, the master shard, Adam's m and v and the Adam step in the "
                            "host pool; the gradient shard down and the updated weight shard up each step. FSDP2: "
                            "PyTorch's CPUOffloadPolicy, the sharded parameters, gradients and Adam states on the host")
    overlap: bool = setting(False, help="DDP: start each bucket's all-reduce as soon as its gradients are final, during "
                            "the last micro-batch's backward, on a communication thread (else after the backward)")
    comm_delay_ms: int = setting(0, min=0, max=1000, help="DDP: a simulated slow network, every collective on the dp wire "
                                 "(each bucket's all-reduce) waits this long first")
    preset: str = setting("none", choices=("none", *PRESETS), help="fill the mesh, schedule and dp strategy from a preset "
                                                                   "(the settings it names left at their defaults): " +
                          "; ".join(f"{k}: {v}" for k, v in PRESET_NOTES.items()))
    batch: int = setting(4, min=1, max=64, help="sequences in the global batch")
    seq: int = setting(8, min=2, max=256, help="tokens per sequence")
    layers: int = setting(4, min=1, max=16, help="decoder blocks (split over the stages)")
    steps: int = setting(3, min=1, max=50, help="training steps (Adam)")
    lr: float = setting(0.01, min=0.0, max=1.0, help="Adam learning rate")
    checkpoint_every: int = setting(0, min=0, max=50, help="save a sharded DCP checkpoint of the model's tensors every N "
                                    "steps (0: none)")
    kill_rank: int = setting(-1, min=-1, max=7, help="rank killed by SIGKILL mid-step (-1: none); the spawner restarts "
                             "every rank from the last checkpoint, checked bit for bit against the run without the kill")
    kill_step: int = setting(1, min=0, max=49, help="step in which that rank is killed (after its backwards)")
    reshard_tp: int = setting(0, min=0, max=8, help="continue the last checkpoint before the end on a mesh with this tp "
                              "(with reshard_pp; dp takes the rest; 0: no)")
    reshard_pp: int = setting(0, min=0, max=8, help="that mesh's pp (0: no)")
    reshard_cp: int = setting(0, min=0, max=8, help="that mesh's cp, e.g. ring attention's cp 2 continued on cp 1 (0: this "
                              "run's)")
    reshard_ep: int = setting(0, min=0, max=8, help="that mesh's ep, e.g. experts over ep 2 continued on ep 1 (0: this "
                              "run's)")
    reshard_strategy: str = setting("same", choices=("same", *STRATEGIES), help="that mesh's dp strategy (same: this "
                                    "run's), e.g. an FSDP2 checkpoint continued under ZeRO-1")
    checkpoint_save: str = setting("sync", choices=("sync", "async"), help="dcp.save blocks the step; dcp.async_save "
                                   "stages a copy and writes it in a thread while the next step runs")

    presets: ClassVar[dict] = PRESETS  # (for the page, through the registry)
    preset_notes: ClassVar[dict] = PRESET_NOTES

    def __post_init__(self):
        """A preset fills the settings it names that are still at their defaults (a value chosen beside it stays)."""
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        for name, value in PRESETS.get(self.preset, {}).items():
            if getattr(self, name) == defaults[name]:
                setattr(self, name, value)

    cost_drivers = ("steps", "d_model", "seq", "batch", "layers", "d_ff", "vocab", "world_size", "cp", "microbatches", "experts",
                    "compare_schedules", "recompute", "checkpoint_every", "kill_rank", "reshard_tp", "checkpoint_save",
                    "comm_delay_ms")

    def estimate(self):
        """The leader trains the whole model on the whole batch as the reference, and every rank its part (counted
        as the whole, for the bubbles and re-sends). The leader's torch.optim.Adam imports torch._dynamo; the ranks'
        hand-written Adam does not. Each ring attention step is a few Python-level sends and block updates: 3cp - 2
        of them per layer per micro-batch per step on every rank. The executor's actions (a micro-batch through a
        layer on a rank: sends, receives, bookkeeping) ~10 ms of CPU each (5.3 s of CPU at the defaults, 18.4 s at 49 steps,
        measured at load 3.5-5). A kill adds the uninterrupted run and the restarted ranks; a reshard the steps after
        the last checkpoint before the end; each save or load some DCP planning and file writes per rank."""
        passes = self.steps + 6 * min(self.steps, 2) * self.compare_schedules  # the other schedules run the same plan
        passes += 4 * (self.recompute != "none")  # recompute's price: 4 steps with and without it
        killing = self.kill_rank >= 0
        passes += self.steps * killing  # the uninterrupted run the resumed one must equal
        if self.reshard_tp and self.checkpoint_every:
            passes += self.steps - self.checkpoint_every * ((self.steps - 1) // self.checkpoint_every)
        saves = self.steps // self.checkpoint_every + 2 if self.checkpoint_every else 0
        base = decoder_cost(self, self.world_size + 1, passes=passes,  # (the restarted ranks replace the killed group)
                            seconds=DYNAMO_IMPORT_S + saves * self.world_size * 0.2 + killing * self.world_size * 1.0)
        ring_steps = self.world_size * passes * self.microbatches * self.layers * (3 * self.cp - 2) if self.cp > 1 else 0
        actions = self.world_size * passes * self.microbatches * self.layers
        params = self.layers * (4 * self.d_model ** 2 + 3 * self.d_model * self.d_ff) + 2 * self.vocab * self.d_model
        buckets = -(-params * 8 // (self.bucket_kb * 1024))  # comm_delay_ms: each bucket's all-reduce waits first
        return with_wait(plus_cpu(base, (ring_steps * 200 + actions * 400) * OP_S), passes * buckets * self.comm_delay_ms / 1000)

    @property
    def max_restarts(self) -> int:
        """The spawner's restarts (backend/experiments.run): one when a rank is killed."""
        return 1 if self.kill_rank >= 0 else 0

    @property
    def tp_degree(self):
        return "tp", self.tp

    @property
    def tp_divided(self) -> tuple[str, ...]:
        """What apply_tp splits here: heads, SwiGLU columns and vocabulary; the sequence only under SP. d_model is never
        split (pp 2 x tp 2 with seq 7 and d_model 18 runs and passes every check)."""
        return ("n_heads", "n_kv_heads", "d_ff", "vocab") + (("seq",) if self.sp else ())

    @property
    def plan(self):
        return SCHEDULES[self.schedule]

    @property
    def num_stages(self) -> int:
        return self.pp * self.plan.chunks(self.virtual_stages)

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp * self.cp * self.ep)

    def check(self) -> None:
        if self.ep > 1 and not self.experts:
            raise ConfigError("ep", f"{self.ep}: expert parallel needs MoE blocks (allowed: 1 while experts = 0)")
        if self.experts and self.experts % self.ep:
            raise ConfigError("experts", f"{self.experts} does not divide by ep={self.ep} (allowed: a multiple of {self.ep})")
        if self.experts and self.top_k > self.experts:
            raise ConfigError("top_k", f"{self.top_k} is more than experts={self.experts} (allowed: 1..{self.experts})")
        model_parallel = self.tp * self.pp * self.cp * self.ep
        if self.world_size % model_parallel:
            # name the largest mesh dimension and the largest value of it that fits beside the others
            name = max(("tp", "pp", "cp", "ep"), key=lambda d: getattr(self, d))
            others = model_parallel // getattr(self, name)
            fits = [v for v in range(getattr(self, name), 0, -1) if self.world_size % (v * others) == 0]
            hint = (f"allowed with the other settings as they are: {name} = {fits[0]}" if fits
                    else "allowed: tp x pp x cp x ep a divisor of world_size")
            raise ConfigError(name, f"{getattr(self, name)}: tp x pp x cp x ep = {model_parallel} does not divide "
                                    f"world_size={self.world_size} ({hint})")
        super().check()
        self._check_strategies()
        self._check_sequence_and_schedule()
        mesh_run.check_settings(self)

    def _check_strategies(self) -> None:
        """Precision, loss scale, dp strategy, offload and overlap: the combinations that do not hold together."""
        if self.init_loss_scale & (self.init_loss_scale - 1):
            raise ConfigError("init_loss_scale", f"{self.init_loss_scale} is not a power of 2 (allowed: 1, 2, 4, ..., 2^24; "
                                                 "dividing by a power of 2 unscales the gradients exactly)")
        if self.init_loss_scale != 2 ** 16 and self.precision != "fp16_mixed":
            raise ConfigError("init_loss_scale", f"{self.init_loss_scale} with precision {self.precision}: only fp16 is "
                                                 "loss-scaled (allowed: 65536, or any power of 2 with fp16_mixed)")
        if self.precision != "fp64" and self.experts:
            raise ConfigError("precision", f"{self.precision} with MoE blocks: top-k routing on rounded activations flips "
                                           "near-tied experts between the ranks and one process, and the routing and expert "
                                           "byte checks compare the same routing (allowed: fp64 with experts > 0)")
        if self.precision != "fp64" and self.dp_strategy == "fsdp2":
            raise ConfigError("precision", f"{self.precision} with dp_strategy fsdp2: FSDP2 in the mesh runs float64 only "
                                           "(its MixedPrecisionPolicy is not wired) (allowed: fp64 with fsdp2, or another "
                                           "dp_strategy)")
        if self.offload and self.dp_strategy not in ("zero1", "zero2", "fsdp2"):
            raise ConfigError("offload", f"true with dp_strategy {self.dp_strategy}: ZeRO-Offload is built on ZeRO-1 and "
                                         "ZeRO-2's shards, CPU offload on FSDP2's (allowed: false, or true with dp_strategy "
                                         "zero1, zero2 or fsdp2)")
        if self.comm_delay_ms and (self.dp_strategy != "ddp" or self.dp == 1):
            raise ConfigError("comm_delay_ms", f"{self.comm_delay_ms} with dp_strategy {self.dp_strategy} and dp {self.dp}: "
                                               "the simulated slow link delays DDP's bucket all-reduces (allowed: 0, or > 0 "
                                               "with dp_strategy ddp and dp > 1)")
        if self.offload and self.checkpoint_every:
            raise ConfigError("offload", "true with checkpoint_every: the checkpoint is not wired to the host pool "
                                         "(allowed: false with checkpoint_every > 0)")
        if self.overlap and self.dp_strategy != "ddp":
            raise ConfigError("overlap", f"true with dp_strategy {self.dp_strategy}: only DDP's buckets overlap the backward "
                                         "(allowed: false, or true with dp_strategy ddp)")
        if self.overlap and self.sp:
            raise ConfigError("overlap", "true with sp: the norm weights' gradients are summed over tp after the backward, "
                                         "after their buckets would have left (allowed with sp: false)")

    def _check_sequence_and_schedule(self) -> None:
        """The sequence's split over cp and tp, recompute with cp, and the schedule's stages and micro-batches."""
        if self.cp > 1 and self.seq % (2 * self.cp):
            raise ConfigError("seq", f"{self.seq} does not split into 2 x cp = {2 * self.cp} zigzag chunks "
                                     f"(allowed: a multiple of {2 * self.cp})")
        if self.sp and self.seq % (self.cp * self.tp):
            unit = math.lcm(2 * self.cp if self.cp > 1 else 1, self.cp * self.tp)
            raise ConfigError("seq", f"{self.seq}: under sequence parallel each cp shard's {self.seq // self.cp} positions "
                                     f"split over tp={self.tp} (allowed: a multiple of {unit})")
        plan = self.plan
        if self.recompute == "selective" and self.cp > 1:
            raise ConfigError("recompute", f"selective with cp = {self.cp}: ring attention keeps no a·s² scores to drop, "
                                           "and recomputing it would send the K/V ring again (allowed: none or full, or "
                                           "selective with cp = 1)")
        if self.compare_schedules and self.pp == 1:
            raise ConfigError("compare_schedules", "true with pp = 1: there is no pipeline to schedule (allowed: false, "
                                                   "or true with pp > 1)")
        if self.virtual_stages > 1 and not plan.interleaved:
            raise ConfigError("virtual_stages", f"{self.virtual_stages} needs an interleaved schedule (allowed with "
                                                f"{self.schedule}: 1)")
        if self.layers % self.num_stages:
            raise ConfigError("layers", f"{self.layers} does not divide into {self.num_stages} stages (pp={self.pp} x "
                                        f"{plan.chunks(self.virtual_stages)} chunks; allowed: a multiple of {self.num_stages})")
        least = plan.min_microbatches_fn(self.pp) if plan.min_microbatches_fn else 1
        if plan.interleaved and self.virtual_stages > 1:  # torch's ScheduleInterleaved1F1B: rounds of m // pp (>= 1)
            rounds = max(1, self.microbatches // self.pp)
            if self.microbatches % rounds:
                raise ConfigError("microbatches", f"{self.microbatches} is not a multiple of its {rounds} rounds (m // pp); "
                                                  "allowed: fewer than 2 pp, a multiple of pp, or m with m % (m // pp) == 0")
        if self.microbatches < least:
            raise ConfigError("microbatches", f"{self.microbatches}: {plan.title} on pp={self.pp} needs at least {least} "
                                              f"micro-batches (allowed: >= {least})")
        slices = self.dp * self.ep  # the batch is split over dp x ep ranks, then into micro-batches
        if self.batch < slices:
            raise ConfigError("batch", f"{self.batch} sequences cannot give dp x ep = {slices} ranks one each "
                                       f"(allowed: >= {slices})")
        if self.batch < slices * plan.microbatches(self.microbatches):
            raise ConfigError("microbatches", f"{self.microbatches}: {self.batch} sequences over dp x ep = {slices} ranks "
                                              f"give each {self.batch // slices} (allowed with the other settings as they "
                                              f"are: microbatches = {self.batch // slices})")


def run_rank(rank, world, config: MeshConfig, ctx):
    if config.checkpoint_every:
        payload = mesh_run.train_with_checkpoints(rank, world, config, ctx, train_rank)
    else:
        payload = train_rank(rank, world, config, ctx.progress)
    if config.compare_schedules:
        payload["schedules"] = {name: train_rank(rank, world, cfg) for name, cfg in schedule_plans(config).items()
                                if not isinstance(cfg, str) and name != config.schedule}
    return payload


def schedule_plans(config: MeshConfig) -> dict[str, "MeshConfig | str"]:
    """This plan under every synchronous schedule (interleaved with 2 chunks per rank), for at most 2 steps (the replay
    reads the last; the first carries one-time costs): the config, or why it is refused."""
    out = {}
    for name, plan in SCHEDULES.items():
        if plan.asynchronous or config.pp == 1:
            continue
        try:
            out[name] = dataclasses.replace(config, schedule=name, virtual_stages=2 if plan.interleaved else 1,
                                            compare_schedules=False, preset="none", steps=min(config.steps, 2)).validate()
        except ConfigError as err:
            out[name] = str(err)
    return out


def split_of(config: MeshConfig, coords: dict) -> TokenSplit:
    """The tokens the rank at `coords` holds (parallel/token_split.py: the split mesh_train feeds it)."""
    return token_split(config.batch, config.seq, config.plan.microbatches(config.microbatches),
                       {d: getattr(config, d) for d in DIMS}, coords, config.sp)


def predicted_bytes(config: MeshConfig, payload: dict, rows: list[torch.Tensor]) -> dict[str, int]:
    """What one rank sends per run, dimension by dimension, from the shapes alone."""
    split = split_of(config, payload["coords"])
    s, h, steps, sizes = len(split.positions), config.d_model, config.steps, split.microbatch_sizes
    c, r_ = _item(config, "compute"), _item(config, "reduce")  # bytes per element: activations, gradient sums
    plan, me, S = config.plan, payload["coords"]["pp"], config.num_stages
    act = sum(b * len(split.sp_positions) * h * c for b in sizes)  # per micro-batch (SP: a sequence shard)
    # stage boundaries that cross to another pp rank (a V's turn, stage pp-1 to pp, stays on its rank)
    crossings = sum((st < S - 1 and plan.rank_of(st + 1, config.pp) != me) + (st > 0 and plan.rank_of(st - 1, config.pp) != me)
                    for st in payload["stages"])
    kv_block = sum(2 * b * (config.n_kv_heads // config.tp) * s * config.d_head * c for b in sizes)

    def gradients(numel: int, k: int) -> int:  # one ring all-reduce a step of the vector padded to a multiple of k
        return steps * ring_bytes("all_reduce", -(-numel // k) * k, k, r_) if k > 1 else 0
    forwards = 2 if config.recompute == "full" else 1  # full recompute runs each forward again inside B

    split = {(st, mb) for kind, mb, st in payload["order_actions"] if kind == "W"}  # backwards run as I then W

    def times(r: dict, st: int, mb: int) -> int:
        """How often a collective of one forward and backward runs: a forward's twice under full recompute; under SP
        a split backward's W (on stages past the first, whose I took the input gradient) reruns each gathering
        linear's one backward (sp.GatherLinear computes both gradients), its re-gather and reduce-scatter again."""
        if r["phase"] == "forward":
            return forwards
        rerun = config.sp and st > 0 and (st, mb) in split and (r["name"].endswith("(re-gather)") or r["op"] == "reduce_scatter")
        return 2 if rerun else 1
    tp = sum(r["sent_bytes"] * times(r, st, mb)
             for mb, b in enumerate(sizes) if config.tp > 1 for st, layers in payload["stages"].items()
             for r in expected_collectives(config, config.tp, config.sp, batch=b, seq=s, layers=len(layers),
                                           first=st == 0, last=st == S - 1, index=payload["coords"]["tp"],
                                           dense_ffn=not config.experts, item=c, loss_item=max(c, 4))
             if r["name"] != "norm weight gradients")
    if config.sp and config.tp > 1:  # the norms' (and MoE layers') gradients, summed over tp once a step
        tp += sum(ring_bytes("all_reduce", numel, config.tp, c, payload["coords"]["tp"])
                  for st, layers in payload["stages"].items() for numel in sequence_parallel_numels(config, len(layers), st == S - 1))
    return {"tp": steps * tp, "pp": steps * act * crossings,
            # per layer: forward cp-1 K/V blocks (each forward); backward cp-1 K/V blocks and cp dK/dV blocks (the last home)
            "cp ring": steps * payload["layers_here"] * kv_block * (forwards * (config.cp - 1) + 2 * config.cp - 1)
            if config.cp > 1 else 0,
            "dp gradients": fsdp2_bytes(payload["param_shapes"], config.dp, steps) if config.dp_strategy == "fsdp2" else
            dp_bytes(config.dp_strategy, payload["param_numels"], config.dp, steps, config.bucket_kb * 1024,
                     config.precision, sum(payload.get("skipped", []))),
            "cp gradients": gradients(payload["flat_numel"], config.cp),
            "ep all-to-all": sum(all_to_all_bytes(config, call, payload["coords"]) for call in rows),
            "ep gradients": gradients(payload["replicated_over_ep"], config.ep)}


def _item(config: MeshConfig, which: str) -> int:
    """Bytes per element of the precision's compute, master or reduce dtype (workload.Precision.item)."""
    return PRECISIONS[config.precision].item(which)


def sequence_parallel_numels(config: MeshConfig, layers: int, last: bool) -> list[int]:
    """Under SP, the parameters a stage's tp ranks each train on their sequence shard alone, summed over tp once a step
    (one all-reduce each): two RMSNorm weights (h) per block and the final norm's on the last stage; an MoE block's
    router (E·h) and the gate, up and down (h·d_ff each) of this rank's E/ep routed experts and of the shared expert."""
    h, moe = config.d_model, []
    if config.experts:
        moe = [config.experts * h] + [h * config.d_ff] * 3 * (config.experts // config.ep + 1)
    return ([h, h] + moe) * layers + [h] * last


def kept_inputs(config: MeshConfig, payload: dict) -> dict[int, dict[int, int]]:
    """Full recompute keeps each (stage, micro-batch)'s input from F to B: b x s/cp token ids (int64) on stage 0, a
    b x s/cp x d_model activation in the compute dtype on the others (each rank holds its cp positions only; under SP
    its tp share)."""
    split, c = split_of(config, payload["coords"]), _item(config, "compute")
    return {st: {j: b * (8 * len(split.positions) if st == 0 else c * len(split.sp_positions) * config.d_model)
                 for j, b in enumerate(split.microbatch_sizes)}
            for st in payload["stages"]}


def dp_bytes(strategy: str, numels: list[int], k: int, steps: int, bucket_bytes: int, precision: str = "fp64",
             skipped: int = 0) -> int:
    """Bytes one rank sends over dp in a run of `steps`, for parameters of `numels` elements, each collective a ring
    over the vector zero-padded to a multiple of k (seed 000: 2ψ(k-1)/k per step for all-reduce, DDP and ZeRO-1/2
    alike). Gradients travel in the reduce dtype, ZeRO's weights in the compute dtype. DDP: one all-reduce per
    bucket, buckets filled in reverse parameter order and closed once their gradients reach bucket_bytes. ZeRO-3:
    the same reduce-scatter and all-gather per step, plus one all-gather of the master weights at the end to report
    the trained weights (so too ZeRO-1/2 in mixed precision, whose step-end gather was of the compute copy). A step
    the loss scale `skipped` (fp16 overflow) still reduces its gradients, but ZeRO-1/2 gather nothing after it."""
    if k == 1:
        return 0
    p = PRECISIONS[precision]
    grad, weight, master = p.item("reduce"), p.item("compute"), p.item("master")
    pad = lambda e: -(-e // k) * k  # noqa: E731

    def all_reduce(e: int) -> int:
        return ring_bytes("all_reduce", pad(e), k, grad)
    n = sum(numels)
    if strategy == "allreduce":
        return steps * all_reduce(n)
    if strategy == "ddp":
        buckets = [0]
        for e in reversed(numels):
            buckets[-1] += e
            if buckets[-1] * grad >= bucket_bytes:
                buckets.append(0)
        return steps * sum(all_reduce(b) for b in buckets if b)
    gather = ring_bytes("all_gather", pad(n) // k, k, weight)
    report = ring_bytes("all_gather", pad(n) // k, k, master)  # the trained master weights, gathered to report them
    reported = strategy == "zero3" or p.mixed  # otherwise the last step's all-gather left the master whole on every rank
    gathers = steps if strategy == "zero3" else steps - skipped  # ZeRO-3 gathers at each step's start regardless
    return steps * ring_bytes("reduce_scatter", pad(n), k, grad) + gathers * gather + (report if reported else 0)


def fsdp2_elements(shapes: dict, k: int, index: int) -> int:
    """Elements of every parameter (`shapes`: per stage chunk, its parameters' shapes) on dp rank `index` of k: each
    dim-0's rows as torch.chunk cuts them (FSDP2's Shard(0)), ⌈rows/k⌉ each, the last ones fewer or none. Rank 0's
    count is every rank's padded shard (FSDP2 pads the short ones)."""
    total = 0
    for shape in (s for chunk in shapes.values() for s in chunk):
        per = -(-shape[0] // k)
        total += max(0, min(per, shape[0] - index * per)) * math.prod(shape[1:])
    return total


def fsdp2_bytes(shapes: dict, k: int, steps: int) -> int:
    """Bytes one rank sends over dp under FSDP2 in a run of `steps`: per step one ring all-gather of the padded shard
    (fsdp2_elements of rank 0) and one ring reduce-scatter of k such shards (the unsharded gradients padded the same
    way): ZeRO-3's 2ψ(k-1)/k per step with ψ the padded size; plus one all-gather at the end to report the weights."""
    if k == 1:
        return 0
    shard = fsdp2_elements(shapes, k, 0)
    return (steps + 1) * ring_bytes("all_gather", shard, k, 8) + steps * ring_bytes("reduce_scatter", k * shard, k, 8)


def fsdp2_memory(shapes: dict, k: int, index: int) -> dict[str, int]:
    """FSDP2's bytes kept between steps on dp rank `index` (float64): the local rows of every parameter (torch.chunk's,
    unpadded), as many gradient elements, and Adam's m and v for them: ZeRO-3's split with FSDP2's per-parameter cut."""
    mine = fsdp2_elements(shapes, k, index)
    return {"parameters": 8 * mine, "gradients": 8 * mine, "optimizer states": 16 * mine}


def dp_memory(strategy: str, n: int, k: int, precision: str = "fp64") -> dict[str, int]:
    """Seed 000's table: bytes a rank keeps between steps for ψ = n parameters over k dp ranks. Every strategy holds
    Adam's m and v for what it updates (ZeRO: ⌈ψ/k⌉, the vector padded to a multiple of k); ZeRO-2 keeps only its
    gradient shard; ZeRO-3 its parameter shard too. Weights at the compute dtype's item size, gradients at the
    reduce dtype's, m and v at the master's (fp64: 8ψ + 8ψ + 16ψ). Mixed precision keeps the master copy apart,
    sharded as Adam's states are (ZeRO's K = 12: 4ψ master + 8ψ m, v), and ZeRO-3 then no compute copy between steps."""
    p, shard = PRECISIONS[precision], -(-n // k)
    c, g, m = p.item("compute"), p.item("reduce"), p.item("master")
    sharded = {"allreduce": 0, "ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3}[strategy]
    states = shard if sharded >= 1 else n
    out = {"parameters": c * (shard if sharded >= 3 else n), "gradients": g * (shard if sharded >= 2 else n),
           "optimizer states": 2 * m * states}
    if p.mixed:
        out.update({"parameters": 0 if sharded >= 3 else c * n, "master weights": m * states})
    return out


def offload_memory(strategy: str, n: int, k: int, precision: str = "fp64") -> tuple[dict[str, int], dict[str, int]]:
    """ZeRO-Offload (ZeRO-1/2): (device, host) bytes a rank keeps. The host holds the master shard, m and v (⌈ψ/k⌉ each,
    master dtype) and the gradient shard (reduce dtype); the device the compute copy of the weights and, under ZeRO-1,
    the full gradients (ZeRO-2 frees its shard once it is on the host), nothing of Adam."""
    p, shard, device = PRECISIONS[precision], -(-n // k), dp_memory(strategy, n, k, precision)
    device.update({"optimizer states": 0, "gradients": device["gradients"] if strategy == "zero1" else 0})
    if "master weights" in device:
        device["master weights"] = 0
    host = {"parameters (master shard)": p.item("master") * shard, "optimizer states": 2 * p.item("master") * shard,
            "gradients (shard)": p.item("reduce") * shard}
    return device, host


def offload_models(config: MeshConfig, p: dict) -> tuple[dict[str, int], dict[str, int]]:
    """One rank's host pool by category and bytes moved per step by direction, as modelled. ZeRO-Offload (Ren et al.
    2021): master shard, Adam's m and v (⌈ψ/dp⌉ each, master dtype) and the gradient shard (reduce dtype) on the host;
    the gradient shard down in the reduce dtype and the weight shard up in the compute dtype each step (2 + 2 bytes a
    parameter of ψ/dp in fp16). FSDP2's CPUOffloadPolicy (float64): every parameter's local rows (torch.chunk's), as many
    gradient elements and Adam's m, v on the host; each step the padded shards up once before the all-gather
    (reshard_after_forward=False: one unshard a step) and the local gradient rows down after the reduce-scatter."""
    if config.dp_strategy == "fsdp2":
        held = fsdp2_memory(p["param_shapes"], config.dp, p["coords"]["dp"])
        padded = fsdp2_elements(p["param_shapes"], config.dp, 0)
        return ({"parameters (shard)": held["parameters"], "gradients (shard)": held["gradients"],
                 "optimizer states": held["optimizer states"]},
                {"device_to_host": held["gradients"], "host_to_device": 8 * padded})
    p_, shard = PRECISIONS[config.precision], -(-p["flat_numel"] // config.dp)
    return (offload_memory(config.dp_strategy, p["flat_numel"], config.dp, config.precision)[1],
            {"device_to_host": shard * p_.item("reduce"), "host_to_device": shard * p_.item("compute")})


def offload_checks(config: MeshConfig, payloads) -> tuple[list[Check], list[dict], list[dict]]:
    """The host pool's bytes per category and the bytes moved between the pools per step against offload_models; with
    the host rows of the memory table and the moved rows."""
    rows, moved = [], []
    for p in payloads:
        host, want = offload_models(config, p)
        rows += [{"rank": p["rank"], "pool": "host", "category": c, "measured_bytes": got, "formula_bytes": host.get(c)}
                 for c, got in p["host_memory"].items()]
        moved += [{"rank": p["rank"], "direction": d.replace("_", " "), "measured_bytes_per_step": p["moved"][d] / config.steps,
                   "formula_bytes_per_step": want[d]} for d in want]
    fsdp2 = config.dp_strategy == "fsdp2"
    return [Check(f"the host pool holds the {'FSDP2 CPUOffloadPolicy' if fsdp2 else 'ZeRO-Offload'} memory model",
                  max(abs(r["measured_bytes"] - (r["formula_bytes"] or 0)) for r in rows), 0,
                  reference="FSDP2: each parameter's local rows as torch.chunk cuts them, their gradients and Adam's m, v, "
                            "float64" if fsdp2 else "Ren et al. 2021: master shard, Adam's m and v (⌈ψ/dp⌉ each, master "
                            "dtype) and the gradient shard (reduce dtype) on the host"),
            Check("bytes moved host <-> device per step equal the FSDP2 shards'" if fsdp2 else
                  "bytes moved host <-> device equal ψ/dp each way per step",
                  max(abs(r["measured_bytes_per_step"] - r["formula_bytes_per_step"]) for r in moved), 0,
                  reference="FSDP2: the padded parameter shards up before the step's all-gather, the local gradient rows "
                            "down after the reduce-scatter" if fsdp2 else "ZeRO-Offload: the gradient shard down in the "
                            "reduce dtype, the updated weight shard up in the compute dtype, per rank per step",
                  detail="counted on the copies between the pools (FSDP2's own Tensor.to calls, offload.FSDPTransfers; no "
                         "accelerator here: both pools are this CPU's memory)")], rows, moved


def expert_rows(config: MeshConfig, routing: list[torch.Tensor], payload: dict) -> list[torch.Tensor]:
    """From the reference's routing, for every MoE call on this rank (step, micro-batch, block on its stage) the
    assignments each ep peer routes to each expert: a tensor (ep, experts). A peer routes its own sequences at the
    positions its MoE layer holds (its cp shard; under SP its tp share of that). After a restart from a checkpoint, the
    steps its last attempt ran."""
    if not config.experts:
        return []
    peers = [split_of(config, {**payload["coords"], "ep": e}) for e in range(config.ep)]
    out = []
    for step in range(payload.get("checkpoint", {}).get("start", 0), config.steps):
        for mb in range(config.plan.microbatches(config.microbatches)):
            for layer in payload["layers"]:
                chosen = [routing[step][layer][peer.sequences[mb]][:, peer.sp_positions] for peer in peers]
                out.append(torch.stack([torch.bincount(c.flatten(), minlength=config.experts) for c in chosen]))
    return out


def all_to_all_bytes(config: MeshConfig, rows: torch.Tensor, coords: dict) -> int:
    """One MoE call's all-to-all bytes from ep rank coords["ep"]: the per-expert counts ((ep-1) messages of E/ep
    numbers), then forward dispatch (its rows for other ranks' experts), combine (other ranks' rows for its experts,
    returned), and their backwards again: 2 (out + in) rows of d_model in the compute dtype (counts: int64). Full recompute runs the forward's
    counts, dispatch and combine twice."""
    n, per, me = config.ep, config.experts // config.ep, coords["ep"]
    if n == 1:
        return 0
    forwards = 2 if config.recompute == "full" else 1
    mine = part(config.experts, me, n)
    out_rows = int(rows[me].sum() - rows[me, mine].sum())
    in_rows = int(rows[:, mine].sum() - rows[me, mine].sum())
    return forwards * (n - 1) * per * 8 + (forwards + 1) * (out_rows + in_rows) * config.d_model * _item(config, "compute")


def activation_formula(config: MeshConfig, payload: dict, rows: list[torch.Tensor]) -> dict[int, dict[int, float]]:
    """Bytes each (stage, micro-batch) forward saves on this rank, {stage: {mb: bytes}}: sp.activation_elements x the
    stage's blocks (+ RoPE's tables). An MoE block's feed-forward is ep.moe_activation_elements instead of the SwiGLU
    term, with the rows its experts computed in the first step (the one measured) taken from the reference's routing;
    under SP it routes only its sequence shard's tokens."""
    split = split_of(config, payload["coords"])
    s = len(split.positions)
    ring = config.n_kv_heads * config.d_head if config.cp > 1 else None
    order = payload["layers"]
    first_step = rows[:config.plan.microbatches(config.microbatches) * len(order)]
    mine = part(config.experts, payload["coords"]["ep"], config.ep)
    out = {}
    for j, b in enumerate(split.microbatch_sizes):
        block = activation_elements(b, s, config.d_model, config.n_heads, config.n_heads * config.d_head,
                                    config.d_ff, config.tp, config.sp, ring)
        if config.recompute == "selective":  # Korthikanti: the core's scores are recomputed, q, k, v kept
            block.pop("softmax output (a·s²·b)")
        for stage, layers in payload["stages"].items():
            elements = s * config.d_head
            for layer in layers:
                if config.experts:
                    block["SwiGLU gate, up, silu, product"] = sum(moe_activation_elements(
                        b * len(split.sp_positions), int(first_step[j * len(order) + order.index(layer)][:, mine].sum()), config.d_model,
                        config.d_ff, config.experts, config.top_k, 1).values())
                elements += sum(block.values())
            out.setdefault(stage, {})[j] = elements * _item(config, "compute")
    return out


def parameter_errors(payloads, ref: dict) -> tuple[float, float]:
    """Every rank's final (master) shards against the reference's, cut as they were: the largest absolute difference,
    and the L2 norm of the differences relative to the L2 norm of what training moved the reference's weights,
    ‖p − p_ref‖ ÷ ‖p_ref − p_ref(0)‖ over all shards (0: equal; 1: as far off as the whole update)."""
    worst, diff2, moved2 = 0.0, 0.0, 0.0
    for p in payloads:
        expected, start = cut(ref["state"], p["sources"]), cut(ref["initial"], p["sources"])
        for k, v in p["params"].items():
            d = torch.from_numpy(v) - expected[k]
            worst, diff2 = max(worst, d.abs().max().item()), diff2 + d.square().sum().item()
            moved2 += (expected[k] - start[k]).square().sum().item()
    if moved2 == 0:  # (every step skipped by the loss scale: nothing moved, nothing may differ)
        return worst, 0.0 if diff2 == 0 else float("inf")
    return worst, (diff2 / moved2) ** 0.5


def against_one_process(config: MeshConfig, payloads, last: dict, ref: dict) -> tuple[list[Check], list[float]]:
    """Final parameters and every step's loss against one process on the whole batch. fp64: within TOL. Otherwise
    against one process running the same precision recipe, within PRECISION_TOL's bound for it, and against the
    float64 one within FP64_BOUND's looser one. Returns the checks and the float64 run's losses (fp64: none apart)."""
    param_err, param_rel = parameter_errors(payloads, ref)
    loss_err = max(abs(a - b) for a, b in zip(last["losses"], ref["losses"]))
    if config.precision == "fp64":
        return [Check("final parameters: every rank's shard equals one process on the whole batch", param_err, TOL,
                      reference="TinyDecoder, float64, torch.optim.Adam, one process"),
                Check("every step's loss equals the reference", loss_err, TOL, reference="one process")], []
    ref64 = reference_training(config, skip=tuple(i for i, s in enumerate(ref["skipped"]) if s))  # (fp16: its skipped steps)
    err64, rel64 = parameter_errors(payloads, ref64)
    eps = torch.finfo(PRECISIONS[config.precision].compute).eps
    loss_rel = max(abs(a - b) / abs(b) for a, b in zip(last["losses"], ref["losses"])) / eps
    loss64 = max(abs(a - b) / abs(b) for a, b in zip(last["losses"], ref64["losses"])) / eps
    (p_tol, l_tol, why), (p_bound, l_bound, why64) = PRECISION_TOL[config.precision], FP64_BOUND[config.precision]
    same = f"TinyDecoder, one process, the same {config.precision} recipe, torch.optim.Adam on the master weights"
    f64 = "TinyDecoder, float64, torch.optim.Adam, one process"
    return [Check(f"final parameters equal one process in {config.precision} (error as a share of the update)", param_rel,
                  p_tol, reference=same, detail=f"{why}; largest element difference {param_err:.2e}"),
            Check(f"every step's loss equals one process in {config.precision} (relative, in eps of the compute dtype)",
                  loss_rel, l_tol, reference=same, detail=f"{why}; eps {eps:.3g}"),
            Check("final parameters near one process in float64 (error as a share of the update)", rel64, p_bound,
                  reference=f64, detail=f"{why64}; largest element difference {err64:.2e}"),
            Check("every step's loss near one process in float64 (relative, in eps of the compute dtype)", loss64, l_bound,
                  reference=f64, detail=f"{why64}; eps {eps:.3g}")], ref64["losses"]


def loss_scale_check(payloads, ref: dict) -> Check:
    """fp16: every rank's loss scale per step and the steps it skipped, against torch.amp.GradScaler's in one process. A
    step whose largest gradient comes within rounding of fp16's max (65504) may overflow on the ranks, whose sums are
    grouped otherwise, and not in one process (or the reverse): the detail gives one process's peak per step."""
    wrong = sum(p["loss_scales"] != ref["scales"] or p["skipped"] != ref["skipped"] for p in payloads)
    mine = payloads[0]
    return Check("every rank's loss scale and skipped steps equal torch.amp.GradScaler's", wrong, 0,
                 reference="torch.amp.GradScaler('cpu', init_scale as set, growth_interval 2000) on one process's fp16 gradients",
                 detail=f"scales {mine['loss_scales']}, skipped steps {[i for i, s in enumerate(mine['skipped']) if s]}; "
                        f"GradScaler: {ref['scales']}, skipped {[i for i, s in enumerate(ref['skipped']) if s]}; one process's "
                        f"largest fp16 gradient per step {[round(g) if g == g and g != float('inf') else 'overflow' for g in ref['peaks']]} "
                        f"(fp16 max 65504)")


def byte_checks(config: MeshConfig, payloads, rows: dict) -> list[Check]:
    """Each rank's bytes per dimension against the byte model, and (MoE) its routing against the reference's."""
    checks = []
    for p in payloads:  # (after a restart: the bytes of the steps its last attempt ran)
        start = p["checkpoint"]["start"] if "checkpoint" in p else 0
        ran = dataclasses.replace(config, steps=config.steps - start)  # (fp16: the skips of those steps; a resume restored the earlier)
        model = predicted_bytes(ran, {**p, "skipped": p.get("skipped", [])[start:]}, rows[p["rank"]])
        model["dp gradients"] += mesh_checks.resume_bytes(config, p) if start else 0
        checks.append(Check(f"rank {p['rank']}: tensor, pipeline, ring and gradient bytes equal the model",
                            sum(abs(p["bytes"][k] - v) for k, v in model.items()), 0,
                            reference="TP: tp_model.expected_collectives per micro-batch on this stage; PP: activations "
                                      "forward and gradients backward per micro-batch per stage boundary; CP: per layer 3cp-2 "
                                      "K/V-sized ring messages; 2(k-1)/k of the gradient vector over dp and cp; EP: the "
                                      "rows the reference routes to other ranks' experts, there and back, forward and backward"))
    if config.experts:
        checks.append(Check("every MoE call routed each expert the assignments the reference routed those tokens",
                            sum(routing_mismatches(p, rows[p["rank"]]) for p in payloads), 0,
                            reference="the one-process model's top-k choices for this rank's sequences and positions"))
    return checks


def memory_checks(config: MeshConfig, payloads, rows: dict) -> tuple[list[Check], list[dict]]:
    """Each rank's bytes held per category against the dp strategy's memory model, and its activations at the
    schedule's peak against the formula; with the rows of measured beside modelled bytes."""
    checks = []
    memory = []
    for p in payloads:
        formula = peak_in_flight(p["order_actions"], activation_formula(config, p, rows[p["rank"]]),
                                 kept_inputs(config, p) if config.recompute == "full" else None)
        for cat, got in p["memory"].items():
            memory.append({"rank": p["rank"], "category": cat, "measured_bytes": got,
                           "formula_bytes": formula if cat == "activations" else None})
    states = {p["rank"]: {k: v * (not config.offload) for k, v in fsdp2_memory(p["param_shapes"], config.dp, p["coords"]["dp"]).items()}
              if config.dp_strategy == "fsdp2"
              else offload_memory(config.dp_strategy, p["flat_numel"], config.dp, config.precision)[0] if config.offload
              else dp_memory(config.dp_strategy, p["flat_numel"], config.dp, config.precision) for p in payloads}
    checks.append(Check(f"parameters, gradients and optimizer states per rank equal the {config.dp_strategy} memory model",
                        sum(abs(p["memory"].get(c, 0) - v) for p in payloads for c, v in states[p["rank"]].items()) +
                        sum(v for p in payloads for c, v in p["memory"].items() if c not in states[p["rank"]] and c != "activations"),
                        0, reference="seed 000 at each dtype's item size (fp64: 8ψ weights, 8ψ gradients, 16ψ Adam m and v; "
                                     "bf16_mixed: 2ψ bf16 weights, 4ψ fp32 gradients, 4ψ fp32 master, 8ψ fp32 m and v; ψ "
                                     "the flat parameters on the rank); ZeRO-1 shards m, v (and the master), ZeRO-2 also the "
                                     "gradients, ZeRO-3 also the weights, each to ⌈ψ/dp⌉; FSDP2 each parameter's dim-0 rows "
                                     "as torch.chunk cuts them; kept between steps"))
    for r in memory:
        r["formula_bytes"] = states[r["rank"]].get(r["category"], r["formula_bytes"])
    acts = [r for r in memory if r["category"] == "activations"]
    checks.append(Check(f"activations held at {config.plan.title}'s peak within 10 % of the formula",
                        max(abs(r["measured_bytes"] / r["formula_bytes"] - 1) for r in acts), 0.10,
                        reference="sp.activation_elements x the stage's layers per (stage, micro-batch) (+ RoPE tables), "
                                  "summed over those alive at each point of the rank's order (F to B or W); MoE blocks: "
                                  "ep.moe_activation_elements with the reference's routing"))
    return checks, memory


def combine(config: MeshConfig, payloads) -> Result:
    # one thread: a tiny model's ops are far too small to split, and two threads spinning on two shared cores made
    # the reference 10x slower (0.6 s against 8 s measured at load 10)
    torch.set_num_threads(1)
    ref = reference_training(config, PRECISIONS[config.precision])  # one process, the same precision recipe
    last = next(p for p in payloads if p["last_stage"])
    covered = {ref_name for p in payloads for _, pieces in p["sources"].values() for ref_name, _ in pieces}
    checks, losses64 = against_one_process(config, payloads, last, ref)
    checks.append(Check("the shards cover every reference parameter", len(set(ref["state"]) - covered), 0, reference="state_dict names"))
    if ref["scales"]:
        checks.append(loss_scale_check(payloads, ref))
    rows = {p["rank"]: expert_rows(config, ref["routing"], p) for p in payloads}  # per MoE call, from the reference
    checks += byte_checks(config, payloads, rows)
    memory_check, memory = memory_checks(config, payloads, rows)
    checks += memory_check
    moved = []
    if config.offload:  # ZeRO-Offload: the host pool's rows beside the device's, and the bytes moved between them
        more, host, moved = offload_checks(config, payloads)
        checks += more
        memory = [{**r, "pool": "device"} for r in memory] + host
    timing, timing_metrics, pipeline_rows, replay_rows = pipeline_timing(config, payloads) if config.pp > 1 else ([], {}, [], [])
    checks += timing
    step_checks, step_metrics, step_tables = where_the_step_goes(config, payloads, pipeline_rows)
    checks += step_checks
    timing_metrics.update(step_metrics)
    price_checks, price_metrics, price_rows = recompute_price(config, payloads, rows) if config.recompute != "none" else ([], {}, [])
    checks += price_checks
    timing_metrics.update(price_metrics)
    schedule_rows = []
    if config.compare_schedules:
        schedule_check, schedule_rows = compare_schedules(config, payloads, timing_metrics, pipeline_rows,
                                                          all(c.passed for c in checks))
        checks.append(schedule_check)
    label = " ".join(f"{d}={getattr(config, d)}" for d in DIMS)
    loss = [{"step": i, "loss": v, "run": f"mesh {label}"} for i, v in enumerate(last["losses"])] + \
           [{"step": i, "loss": v, "run": "reference (1 process" + ("" if config.precision == "fp64" else f", {config.precision}") + ")"}
            for i, v in enumerate(ref["losses"])] + [{"step": i, "loss": v, "run": "float64 (1 process)"} for i, v in enumerate(losses64)]
    ranks = [{"rank": p["rank"], **p["coords"], "layers": p["layers_here"], **{f"{k} bytes sent": v for k, v in p["bytes"].items()}}
             for p in payloads]
    metrics = {**{d: getattr(config, d) for d in DIMS}, "schedule": config.schedule, "sp": config.sp, "experts": config.experts,
               "precision": config.precision, "steps": config.steps,
               "final_loss": last["losses"][-1], **timing_metrics}
    experts = [{"rank": p["rank"], "block": call["layer"], "expert": e, "rows computed": rows}
               for p in payloads for call in p["moe"] for e, rows in call["computed_here"].items()]
    tables_per_expert = {"experts": experts, "experts_per_rank": experts_per_rank(experts)}
    checkpoint_tables = {}
    if config.checkpoint_every:
        more_checks, more_metrics, checkpoint_tables = mesh_checks.checks_and_tables(config, payloads, ref, cut)
        checks += more_checks
        metrics.update(more_metrics)
    return Result(metrics=metrics, checks=checks, tables={**checkpoint_tables, "loss": loss, "ranks": ranks, "memory": memory,
                                                          "groups": _groups(config), **tables_per_expert,
                                                          "pipeline": pipeline_rows, "recompute": price_rows,
                                                          "step_replayed": replay_rows, **step_tables,
                                                          "schedules": schedule_rows, "schedule_means": schedule_means(schedule_rows),
                                                          **({"moved": moved} if moved else {}),
                                                          "graph_dot": [{"dot": mesh_graph(ranks, _groups(config))}]},
                  trace_events=[e for p in payloads for e in p["trace"]["events"]])


def compare_schedules(config: MeshConfig, payloads, timing, pipeline, passed) -> tuple[Check, list[dict]]:
    """This plan's run beside its runs under the other schedules (run_rank), each combined and checked as usual: per
    schedule and rank the replayed step time, the replayed and modelled bubble, the closed-form bubble and the peak of
    activations held. A schedule the plan does not fit is listed with the reason it is refused."""
    plans, rows, failed = schedule_plans(config), [], []

    def add(name, cfg, timing, pipeline, pls, passed):
        for r in pipeline:
            rows.append({"schedule": name, "rank": r["rank"], "step_replayed_ms": timing["step_replayed_ms"],
                         "bubble_replayed": r["bubble_replayed"], "bubble_makespan_model": r["bubble_makespan_model"],
                         "bubble_formula": cfg.plan.bubble(cfg.pp, cfg.microbatches, cfg.virtual_stages),
                         "activations_peak_bytes": next(p["memory"]["activations"] for p in pls if p["rank"] == r["rank"]),
                         "passed": passed, "refused": ""})
    add(config.schedule, config, timing, pipeline, payloads, passed)
    for name, cfg in plans.items():
        if name == config.schedule:
            continue
        if isinstance(cfg, str):
            rows.append({"schedule": name, "rank": None, "refused": cfg})
            continue
        result = combine(cfg, [p["schedules"][name] for p in payloads])
        if not result.passed:
            failed.append(name)
        add(name, cfg, result.metrics, result.tables["pipeline"], [p["schedules"][name] for p in payloads], result.passed)
    ran = sorted({r["schedule"] for r in rows if not r["refused"]})
    return Check("every schedule's run of this plan passes its own checks", len(failed), 0,
                 reference="each run against one process, the byte, memory and makespan models, as the plan's own run",
                 detail=f"{len(ran)} schedules ran ({', '.join(ran)}); failed: {', '.join(failed) or 'none'}"), rows


def schedule_means(rows: list[dict]) -> list[dict]:
    """Per schedule that ran (in the comparison's order), the pipeline's bubble as the mean over ranks of each rank's
    idle share, replayed and modelled (the mean, as the pipeline page reports a schedule's bubble), beside the
    closed form and the replayed step time, which are one number per schedule already."""
    ran: dict[str, list[dict]] = {}
    for r in rows:
        if not r["refused"]:
            ran.setdefault(r["schedule"], []).append(r)
    return [{"schedule": name, "ranks": len(rs), "step_replayed_ms": rs[0]["step_replayed_ms"],
             "bubble_replayed": fmean(r["bubble_replayed"] for r in rs),
             "bubble_makespan_model": fmean(r["bubble_makespan_model"] for r in rs),
             "bubble_formula": rs[0]["bubble_formula"]} for name, rs in ran.items()]


def step_split(payloads, steps, pipeline_rows) -> tuple[Check, list[dict], list[dict]]:
    """The last step's wall time on every rank (from the earliest rank's start to the latest rank's end) split into
    compute, exposed communication per dimension and idle (_step_split.py), beside the replayed bubble; and
    the step's items by lane for the timeline."""
    window = (min(p["step_us"][-1][0] for p in payloads), max(p["step_us"][-1][1] for p in payloads))
    replayed, step = {r["rank"]: r["bubble_replayed"] for r in pipeline_rows}, window[1] - window[0]
    rows, lanes, worst = [], [], 0.0
    for p in payloads:
        walls = [(it, it["wall"]) for it in steps[p["rank"]]]
        split = parts(walls, step)
        worst = max(worst, abs(sum(split.values()) - step) / step)
        rows.append({"rank": p["rank"], **{f"{c}_ms": split[c] / 1e3 for c in CATEGORIES}, "step_ms": step / 1e3,
                     "own_step_ms": (p["step_us"][-1][1] - p["step_us"][-1][0]) / 1e3, "bubble_replayed": replayed.get(p["rank"])})
        lanes += drawn(p["rank"], walls, window[0])
    check = Check("each rank's last step splits into compute, exposed communication per dimension and idle that sum to "
                  "its wall time", worst, 1e-9,
                  reference="the step's window (earliest start to latest end over the ranks, perf_counter); idle measured "
                            "as the window less the union of the rank's items, apart from the categories",
                  detail=f"step {step / 1e3:.2f} ms; largest relative gap {worst:.1e}")
    return check, rows, lanes


def where_the_step_goes(config: MeshConfig, payloads, pipeline_rows) -> tuple[list[Check], dict, dict[str, list[dict]]]:
    """Every rank's last step as items (_step_split.step_items), on the wall clock and replayed with communication."""
    steps = {p["rank"]: step_items(p["trace"]["events"], p["step_us"][-1]) for p in payloads}
    split_check, split_rows, lane_rows = step_split(payloads, steps, pipeline_rows)
    checks, metrics, tables = comm_replay(config, payloads, steps)
    return [split_check, *checks], metrics, {"step_split": split_rows, "step_lanes": lane_rows, **tables}


def comm_replay(config: MeshConfig, payloads, steps) -> tuple[list[Check], dict, dict[str, list[dict]]]:
    """The last step replayed with one core per rank from measured costs, a lane per dimension's communication
    (_step_split.py: a collective waits for its group's slowest member, a receive for its send), beside the
    wall clock: per rank compute, exposed communication by dimension and idle, checked to sum to the replayed step;
    and the same items with communication free and each action at its mean cost, checked against the makespan model."""
    partners = match_calls(steps, {p["rank"]: p["coords"] for p in payloads})
    measured_costs(steps, partners)
    replayed = replay_step(steps, partners)
    step, split = replay_split(replayed)
    worst = max(abs(sum(v.values()) - step) / step for v in split.values())
    checks = [Check("each rank's replayed step with communication lanes splits into compute, exposed communication per "
                    "dimension and idle that sum to it", worst, 1e-9,
                    reference="the replay's step (last item's end over the ranks); idle measured as the step less the union "
                              "of the rank's replayed items, apart from the parts",
                    detail=f"replayed step {step / 1e3:.2f} ms; largest relative gap {worst:.1e}")]
    rows = [{"rank": r, **{f"{c}_ms": v / 1e3 for c, v in split[r].items()}, "step_ms": step / 1e3} for r in sorted(split)]
    lanes = [row for r, items in replayed.items() for row in drawn(r, [(a, (a["ts"], a["ts"] + a["dur"])) for a in items], 0.0)]
    checks.append(free_communication_check(config, steps, partners, {p["rank"]: p["coords"]["pp"] for p in payloads}))
    wall = max(p["step_us"][-1][1] for p in payloads) - min(p["step_us"][-1][0] for p in payloads)
    return checks, {"step_replayed_with_comm_ms": round(step / 1e3, 3), "step_wall_ms": round(wall / 1e3, 3)}, \
        {"comm_replay": rows, "comm_lanes": lanes}


def free_communication_check(config: MeshConfig, steps, partners, pp_of: dict[int, int]) -> Check:
    """The replay with every communication call free and every action piece at its mean cost over ranks and
    micro-batches against the makespan model (pp/makespan.py, walked from the schedule's orders) at the same per-stage
    costs: every action's start equal, on every pipeline."""
    means = mean_action_costs(steps)
    free = replay_step(steps, partners, lambda it: means[(it["kind"], it["stage"], it["piece"])] if "kind" in it else 0.0)
    costs: dict[str, list[float]] = {}
    for (kind, stage, _), c in means.items():
        costs.setdefault(kind, [0.0] * config.num_stages)[stage] += c
    model = makespan(config.schedule, config.pp, config.plan.microbatches(config.microbatches), config.virtual_stages, costs)
    start = {(r, a["kind"], a["stage"], a["mb"]): a["ts"] for r, items in free.items() for a in items if a.get("piece") == 0}
    apart = max(abs(start[(r, a.kind, a.stage, a.mb)] - begin) for r in steps for q, a, begin, _ in model.timeline
                if q == pp_of[r])
    return Check("the replay with communication free equals the makespan model, action by action", apart / model.step, 1e-9,
                 reference="pp/makespan.py at each stage's mean action cost (the sum of its pieces' means), message latency 0",
                 detail=f"largest difference of an action's start {apart:.3g} µs over a modelled step of {model.step / 1e3:.3f} ms")


def recompute_price(config: MeshConfig, payloads, rows) -> tuple[list[Check], dict, list[dict]]:
    """What recompute cost and saved on each rank, from one step of the same plan with and one without it (run after
    training, mesh_train.recompute_price): FLOPs counted by torch's per-op formulas against the model (full: one more forward of
    each (stage, micro-batch), those forwards counted one by one; selective: QKᵀ and P·V again, 4·b·(a/tp)·s²·d per
    layer), CPU time of the compute, and the activations at the rank's peak without it against the formula."""
    plain = dataclasses.replace(config, recompute="none")
    full, heads = config.recompute == "full", config.n_heads // config.tp
    out, flops_err, peak_err, timed = [], 0, 0.0, []
    for p in payloads:
        pr = p["price"]
        forward = sum(f["flops"] for f in pr["without_forwards"])
        extra = pr["with_flops"] - pr["without_flops"]
        model = forward if full else sum(core_flops(b, heads, config.seq, config.d_head) * p["layers_here"]
                                         for b in split_of(config, p["coords"]).microbatch_sizes)
        flops_err = max(flops_err, abs(extra - model))
        formula = peak_in_flight(p["order_actions"], activation_formula(plain, p, rows[p["rank"]]))
        peak_err = max(peak_err, abs(pr["peak_without"] / formula - 1))
        cpu_with, cpu_without = sum(pr["with_cpu_us"].values()) / 1e3, sum(pr["without_cpu_us"].values()) / 1e3
        timed.append((cpu_with, cpu_without, pr["without_cpu_us"]["F"] / 1e3))
        out.append({"rank": p["rank"], "forward_flops": forward, "backward_flops": pr["without_flops"] - forward,
                    "extra_flops": extra, "extra_flops_model": model, "flops_overhead": extra / pr["without_flops"],
                    "compute_cpu_ms": cpu_with, "compute_cpu_without_ms": cpu_without,
                    "time_overhead": cpu_with / cpu_without - 1,
                    "activations_peak_bytes": p["memory"]["activations"], "activations_peak_without_bytes": pr["peak_without"],
                    "activations_saved_bytes": pr["peak_without"] - p["memory"]["activations"]})
    step_flops(out)
    extra, total = sum(r["extra_flops"] for r in out), sum(r["extra_flops"] / r["flops_overhead"] for r in out)
    forward, backward = sum(r["forward_flops"] for r in out), sum(r["backward_flops"] for r in out)
    cpu_with, cpu_without, cpu_forward = (sum(t[i] for t in timed) for i in range(3))
    what = ("one more forward of every (stage, micro-batch) on the rank, each FLOP-counted in the run "
            "without recompute" if full else "QKᵀ and P·V again: 4·b·(a/tp)·s²·d FLOPs per layer per micro-batch (closed form)")
    checks = [Check(f"{config.recompute} recompute's extra FLOPs per rank equal the model", flops_err, 0,
                    reference=f"torch.utils.flop_counter's formulas over one step with it minus one without it, against {what}",
                    detail=f"{extra:,} extra FLOPs over all ranks, +{100 * extra / total:.1f} %"),
              Check("activations at each rank's peak without recompute within 10 % of the formula", peak_err, 0.10,
                    reference="sp.activation_elements per (stage, micro-batch), alive F to B or W in the rank's order")]
    metrics = {"recompute": config.recompute, "recompute_flops_overhead": round(extra / total, 4), "recompute_time_overhead": round(cpu_with / cpu_without - 1, 4),
               "recompute_flops_model": round(forward / (forward + backward) if full else extra / total, 4),
               "activation_peak_saved_bytes": max(r["activations_saved_bytes"] for r in out)}
    if full:
        metrics["backward_to_forward_flops"] = round(backward / forward, 3)
        if cpu_without >= MIN_TIMED_CPU_MS:  # below it, CPU-time ratios are timer and scheduler noise
            overhead, predicted = cpu_with / cpu_without - 1, cpu_forward / cpu_without
            checks.append(time_check([p["price"] for p in payloads], overhead, predicted))
    return checks, metrics, out


def step_flops(rows: list[dict]) -> list[dict]:
    """Each rank's FLOPs in one step without recompute (its forwards and backwards) and with it (plus the recomputed
    forwards), added to its recompute row: the two bars the page draws per rank."""
    for r in rows:
        r["step_flops_without"] = r["forward_flops"] + r["backward_flops"]
        r["step_flops_with"] = r["step_flops_without"] + r["extra_flops"]
    return rows


BUBBLE_POINTS = 0.05  # issue #27's target: the replayed bubble within 5 points of the makespan model


def pipeline_timing(config: MeshConfig, payloads) -> tuple[list[Check], dict, list[dict], list[dict]]:
    """The last step's F/B/I/W actions of each pipeline (the ranks that share every mesh coordinate but pp), replayed
    with one core per rank, each at its least CPU time over the steps after the warm-up one (pipeline.mark_least_cpu,
    the pipeline page's rule; tp, cp and ep collectives run inside the actions), and the makespan model fed with
    their mean costs: checked equal to the replay at those same costs action by action. The replayed bubble's distance
    from the model's (mean over ranks) is reported, not checked: a timing on a shared CPU (bench/mesh_bubble.py).
    Returns the checks, the replayed step time and bubble gap, per rank its replayed and modelled idle, and the actions."""
    m = config.plan.microbatches(config.microbatches)
    lines: dict[tuple, list[dict]] = {}
    for p in payloads:
        last = mark_least_cpu([e for e in p["trace"]["events"] if is_action(e)], p["step_us"])
        key = tuple(v for d, v in p["coords"].items() if d != "pp")
        lines.setdefault(key, []).extend({**e, "rank": p["coords"]["pp"], "global_rank": p["rank"]} for e in last)
    exacts, nears, rows, step, actions = [], [], [], 0.0, []
    for key, drawn in lines.items():
        compute = least_costs(drawn)
        exact, model, _ = model_against_replay(config.schedule, config.pp, m, config.virtual_stages, compute)
        exacts.append(exact)
        replay = replayed(compute, config.num_stages)
        actions += [{"rank": e["global_rank"], "lane": "compute", "kind": e["args"]["kind"], "mb": e["args"]["mb"],
                     "stage": e["args"]["stage"], "start_ms": e["ts"] / 1e3, "end_ms": (e["ts"] + e["dur"]) / 1e3} for e in replay]
        span, idle = bubbles(replay, config.pp)
        step = max(step, span)
        nears.append((abs(sum(idle.values()) - sum(model.idle.values())) / config.pp, key, idle, model.idle))
        rank_of = {e["rank"]: e["global_rank"] for e in compute}
        rows += [{"rank": rank_of[r], "pp": r, "bubble_replayed": idle[r], "bubble_makespan_model": model.idle[r],
                  "busy_ms": model.busy[r] / 1e3} for r in range(config.pp)]
    worst = max(exacts, key=lambda c: c.error)
    check = Check(f"every pipeline's last step: {worst.name}", worst.error, worst.tolerance, reference=worst.reference,
                  detail=f"{len(exacts)} pipelines; worst: {worst.detail}")
    near = bubble_near_model(config, nears)
    return [check], {"step_replayed_ms": round(step / 1e3, 3), "bubble_model_gap": near.error,
                     "bubble_model_gap_detail": f"{near.name} ({'met' if near.passed else 'missed'}): {near.detail}"}, \
        sorted(rows, key=lambda r: r["rank"]), actions


def bubble_near_model(config: MeshConfig, nears: list[tuple]) -> Check:
    """The replayed bubble (mean over a pipeline's ranks) within 5 points of the makespan model at the same actions'
    mean stage costs, for the pipeline furthest apart: what the spread of equal actions' least costs (over micro-batches)
    leaves of the prediction. (gap, pipeline key, replayed idle per pp rank, modelled idle) per pipeline."""
    gap, key, idle, model = max(nears, key=lambda n: n[0])
    p = config.pp
    return Check("replayed bubble (mean over ranks) within 5 points of the makespan model", gap, BUBBLE_POINTS,
                 reference=f"pp/makespan.py: {config.plan.title} walked with its dependencies, each action at its stage's "
                           "mean CPU time; the replay takes each action's least CPU time over the steps trained",
                 detail=f"{len(nears)} pipelines; furthest apart (coordinates but pp {key}): replayed "
                        f"{100 * sum(idle.values()) / p:.1f} %, model {100 * sum(model.values()) / p:.1f} % "
                        f"(per pp rank replayed {', '.join(f'{100 * v:.1f}' for v in idle.values())} %, "
                        f"model {', '.join(f'{100 * v:.1f}' for v in model.values())} %)")


def routing_mismatches(payload: dict, expected: list[torch.Tensor]) -> int:
    """Assignments (per call, per expert) this rank routed differently from the reference (`expected`: expert_rows)."""
    order, calls = payload["layers"], payload["moe"]
    mine = {}  # call index in expert_rows' (step, micro-batch, block) order -> assignments kept per expert
    for j, c in enumerate(calls):
        nth = sum(1 for d in calls[:j] if d["layer"] == c["layer"])  # this block's nth call: step x micro-batches + mb
        mine[nth * len(order) + order.index(c["layer"])] = torch.tensor(c["kept"])
    return sum(int((mine[i] - rows[payload["coords"]["ep"]]).abs().sum()) for i, rows in enumerate(expected))


# The page's colour per process-group dimension (its caption names them), in the order a rank's coordinates are read.
DIM_COLORS = {"tp": "#1f6fd1", "dp": "#76b041", "pp": "#e4572e", "cp": "#9b59b6", "ep": "#d4a017"}


def mesh_graph(ranks: list[dict], groups: list[dict]) -> str:
    """The mesh as Graphviz DOT: a node per rank (its coordinates and blocks), and each process group drawn as a
    chain of edges through its ranks in the dimension's colour (a chain, not a clique: legible at 8 ranks)."""
    g = nx.DiGraph()
    for r in ranks:
        coords = " · ".join(f"{d} {r[d]}" for d in DIM_COLORS if d in r)
        g.add_node(r["rank"], label=f"rank {r['rank']}\n{coords}\n{r['layers']} blocks")
    for grp in groups:
        members = grp["ranks"]
        for a, b in zip(members, members[1:]):
            g.add_edge(a, b, label=grp["dimension"], color=DIM_COLORS[grp["dimension"]])
    return to_dot(g, rankdir="LR")


def _groups(config) -> list[dict]:
    shape = DeviceMesh.layout(config.world_size, **{d: getattr(config, d) for d in DIMS})
    return [{"dimension": d, "group": i, "ranks": ranks} for d in DIMS if shape[d] > 1
            for i, ranks in enumerate(DeviceMesh.lines(shape, d))]


def _v1_before_the_later_settings(result: dict) -> None:
    """Version 1 -> 2: a run stored before the schedule, SP, MoE and precision settings ran the only mesh there was then
    (GPipe, no SP, dense, fp64), and one stored before the graph, the step split or the schedule comparison lacks
    those tables: empty ones say the run did not draw them, and the page says so."""
    for key, then in (("schedule", "gpipe"), ("sp", False), ("ep", 1), ("experts", 0), ("precision", "fp64")):
        result["metrics"].setdefault(key, then)
    for name in ("graph_dot", "pipeline", "step_split", "step_lanes", "comm_replay", "comm_lanes", "schedules", "recompute",
                 "experts", "step_replayed"):
        result["tables"].setdefault(name, [])


def experts_per_rank(experts: list[dict]) -> list[dict]:
    """Token assignments each rank computed for each expert, over every block and step (the experts table summed)."""
    total = Counter()
    for r in experts:
        total[r["rank"], r["expert"]] += r["rows computed"]
    return [{"rank": rank, "expert": e, "rows computed": n} for (rank, e), n in sorted(total.items())]


def _v2_to_v3(result: dict) -> None:
    """Version 2 -> 3: the per-schedule means and the experts' totals per rank, from the stored rows by the
    experiment's own functions (the page computed them before)."""
    result["tables"]["schedule_means"] = schedule_means(result["tables"]["schedules"])
    result["tables"]["experts_per_rank"] = experts_per_rank(result["tables"]["experts"])


def _v3_to_v4(result: dict) -> None:
    """Version 3 -> 4: each rank's whole checkpoint file against its share, summed from the stored per-category rows by
    the experiment's own function (the page summed them before)."""
    if "checkpoint_bytes_per_rank" in result["tables"]:
        result["tables"]["checkpoint_share_per_rank"] = mesh_checks.share_per_rank(result["tables"]["checkpoint_bytes_per_rank"])


def _v4_to_v5(result: dict) -> None:
    """Version 4 -> 5: each rank's FLOPs per step with and without recompute, from the stored rows by the experiment's
    own function (the page summed them before)."""
    step_flops(result["tables"]["recompute"])


RECOMPUTE = ("recompute", "recompute_flops_model", "recompute_flops_overhead", "recompute_time_overhead",
             "activation_peak_saved_bytes", "backward_to_forward_flops")  # recompute != none (the last: full only)
CHECKPOINT = ("attempts", "checkpoint", "checkpoint_tensor_bytes", "checkpoint_file_bytes", "save_s_mean",
              "checkpoint_save", "step_s_with_save", "step_s_without_save")  # checkpoint_every > 0 (the last two: None unmeasured)
KILLED = ("killed_rank", "killed_in_step", "resumed_from_step", "steps_redone", "load_s")  # and kill_rank >= 0
RESHARD = ("reshard_plan", "reshard_from", "reshard_load_s")  # and reshard_tp, reshard_pp
SPLIT = ("compute_ms", "tp_ms", "pp_ms", "cp_ms", "ep_ms", "dp_ms", "idle_ms", "step_ms")
LANE = ("rank", "lane", "kind", "name", "start_ms", "end_ms")
RESULT = Schema(
    metrics=("dp", "tp", "pp", "cp", "ep", "schedule", "sp", "experts", "precision", "steps", "final_loss", "step_wall_ms",
             "step_replayed_ms", "bubble_model_gap", "bubble_model_gap_detail",  # pp > 1 (the pipeline's replay)
             "step_replayed_with_comm_ms", *RECOMPUTE, *CHECKPOINT, *KILLED, *RESHARD),
    tables={"loss": ("step", "loss", "run"),
            "ranks": ("rank", "dp", "tp", "pp", "cp", "ep", "layers", "tp bytes sent", "pp bytes sent", "cp ring bytes sent",
                      "cp gradients bytes sent", "ep all-to-all bytes sent", "ep gradients bytes sent", "dp gradients bytes sent"),
            "memory": ("rank", "category", "measured_bytes", "formula_bytes", "pool"),  # pool: with offload
            "groups": ("dimension", "group", "ranks"),
            "experts": ("rank", "block", "expert", "rows computed"),  # empty for a dense model
            "experts_per_rank": ("rank", "expert", "rows computed"),  # the experts table summed over blocks
            "pipeline": ("rank", "pp", "busy_ms", "bubble_replayed", "bubble_makespan_model"),  # empty when pp = 1
            "recompute": ("rank", "forward_flops", "backward_flops", "extra_flops", "extra_flops_model", "flops_overhead",
                          "compute_cpu_ms", "compute_cpu_without_ms", "time_overhead", "activations_saved_bytes",
                          "activations_peak_bytes", "activations_peak_without_bytes", "step_flops_without",
                          "step_flops_with"),  # empty when recompute = none
            "step_replayed": ("rank", "lane", "kind", "stage", "mb", "start_ms", "end_ms"),
            "step_split": ("rank", *SPLIT, "own_step_ms", "bubble_replayed"), "step_lanes": LANE,
            "comm_replay": ("rank", *SPLIT), "comm_lanes": LANE,
            "schedules": ("schedule", "rank", "step_replayed_ms", "bubble_replayed", "bubble_makespan_model", "bubble_formula",
                          "activations_peak_bytes", "passed", "refused"),  # empty unless compare_schedules
            "schedule_means": ("schedule", "ranks", "step_replayed_ms", "bubble_replayed", "bubble_makespan_model",
                               "bubble_formula"),  # one row per schedule of `schedules` that ran
            "graph_dot": ("dot",),
            "moved": ("rank", "direction", "measured_bytes_per_step", "formula_bytes_per_step"),  # offload only
            "checkpoint_timeline": ("t", "t_s", "event", "step", "attempt", "seconds", "blocking", "load_seconds", "rank", "pid"),
            "checkpoint_files": ("file", "rank", "bytes", "tensor bytes"),
            "checkpoint_bytes_per_rank": ("rank", "category", "written_bytes", "expected_bytes", "held_bytes"),
            "checkpoint_share_per_rank": ("rank", "written_bytes", "expected_bytes"),  # bytes_per_rank summed per rank
            "reshard_map": ("new rank", "saved rank", "key", "file", "from byte", "bytes"),
            "reshard_bytes": ("new rank", "saved rank", "bytes")},
    optional=("step_replayed_ms", "bubble_model_gap", "bubble_model_gap_detail", *RECOMPUTE, *CHECKPOINT, *KILLED, *RESHARD, "moved", "checkpoint_timeline", "checkpoint_files",
              "checkpoint_bytes_per_rank", "checkpoint_share_per_rank", "reshard_map", "reshard_bytes"),
    version=5, upgrades={1: _v1_before_the_later_settings, 2: _v2_to_v3, 3: _v3_to_v4, 4: _v4_to_v5},
)

EXPERIMENT = define(__name__, MeshConfig, "Compose parallelism: the tiny LLaMA trained on a pp x dp x cp x ep x tp mesh (any pipeline "
                    "schedule on the one executor, TP shards, ring attention over sequence shards, MoE experts over ep, DP by all-reduce, DDP, ZeRO-1/2/3 or FSDP2), equal to one "
                    "process on the whole batch",
                    rank_fn=run_rank, combine=combine, lanes=("compute", "collective", "comm", "recv"),
                    preload=("torch.distributed.pipelining",), schema=RESULT)  # the split-backward schedules use its I/W (2.6 s to import)
