"""One training plan at real scale: memory per GPU by category, the step's time split into compute, exposed
communication per dimension and pipeline bubble, throughput, MFU and days to train.

The model (every byte figure from backend/plan/costs.py and the functions it calls; time from FLOPs and bytes):
  compute   each layer's GEMMs from their shapes (backend/plan/compute.py: 128×256 tiles in waves on the GPU's SMs,
            the roofline for small ones) at a fitted share of peak per GPU family (Ampere; Hopper at 700 W; the 500 W
            H100 96GB); attention's FLOPs (models.training_flops_per_token, FlopCounterMode's formula, causal pairs
            only) on Ampere at a fitted ratio of the GEMMs' share (FlashAttention-2 on the A100 calibration row), on
            Hopper at the published speed of the plan's attention kernel (FA2, cuDNN, FA3: FlashAttention-3 paper),
            the 500 W card's slowed by its fitted clock ratio; the elementwise ops' HBM bytes, eager or fused (the
            constants fitted in published.py on the calibration rows only)
  links     ranks numbered in the plan's order (ORDERS: Megatron's dp inside pp, or Llama 3's pp inside dp; tp and cp
            innermost), each group's ranks a stride apart (costs.rank_strides); a group inside a node uses NVLink,
            one that spans nodes the network; a ring collective costs
            α per step + bytes/β, β the datasheet bandwidth × BUS_EFFICIENCY
  overlap   TP and EP collectives are exposed (not overlapped); ring attention's K/V passes hide behind the layer's
            attention, Llama 3's all-gathered K/V does not; DDP/ZeRO-1/2 gradient reduce-scatter hides behind the backward of the last micro-batch, the
            parameter all-gather after the optimizer is exposed; FSDP/ZeRO-3 prefetch hides every gather and
            reduce-scatter behind the compute except the first layer's gather
  pipeline  the schedule's makespan function (1F1B, GPipe) or busy ÷ (1 − its bubble formula) at these costs;
            the Gantt replays the Schedule's own per-rank orders (backend/trace.replay)
"""
from __future__ import annotations

import dataclasses
import functools
import math

from backend.config import ConfigError
from backend.plan import costs
from backend.parallel.pp import schedules
from backend.plan import compute as C
from backend.plan import models as M
from backend.plan import transients as T
from backend.plan.clusters import Cluster

BUS_EFFICIENCY = 0.8            # nccl-tests busbw ÷ link bandwidth at large messages (assumed, not fitted)
LATENCY = {"nvlink": 5e-6, "network": 15e-6}   # α per ring step (assumed)
OPTIMIZER_BYTES_PER_PARAM = 40  # Adam step: read and write fp32 master, m, v, read the gradient and write bf16 weights
DP_STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "fsdp", "hsdp")
RECOMPUTE = ("none", "selective", "full")
CP_COMMS = ("ring", "allgather")
ATTENTION_KERNELS = tuple(C.ATTENTION_KERNELS)
PLAN_SCHEDULES = ("1f1b", "interleaved_1f1b", "zb_h1", "gpipe")
# Rank orders, outermost dimension first (backend/parallel/mesh.DIMS's convention; ep splits dp at its inner end)
ORDERS = {"pp-dp-cp-tp": "Megatron-LM, torchtitan and the live mesh (mesh.DIMS less ep): dp inside pp",
          "dp-pp-cp-tp": "Llama 3 (its paper's [TP, CP, PP, DP], innermost first): pp inside dp"}
OUTSIDE = "CUDA context and NCCL (outside the allocator)"


@dataclasses.dataclass(frozen=True)
class Efficiency:
    """The fitted constants: the share of peak a full wave of GEMM tiles sustains on each GPU family (what the tiles,
    waves and L2 feed of backend/plan/compute.py do not explain), attention's efficiency as a fixed ratio of it, and
    the caching allocator's fragmentation as a fraction of the allocated peak."""
    ampere: float = 0.6
    hopper: float = 0.6
    attention_ratio: float = 0.5
    fragmentation: float = 0.0
    hopper_500w: float = 0.0     # 0: as hopper

    def linear(self, gpu) -> float:
        fam = family(gpu)
        if fam == "ampere":
            return self.ampere
        return self.hopper_500w if fam == "hopper 500 W" and self.hopper_500w else self.hopper

    def attention(self, gpu) -> float:
        return self.attention_ratio * self.linear(gpu)

    def clock(self, gpu) -> float:
        """A Hopper card's tensor-core speed relative to the 700 W H100: the 500 W card's fitted GEMM share over the
        700 W one (its power cap slows attention's tensor cores as it slows the GEMMs'), else 1."""
        return self.linear(gpu) / self.hopper if family(gpu) == "hopper 500 W" else 1.0


def family(gpu) -> str:
    """A100s are Ampere; H100, H800 and H200 Hopper; the H100 96GB preset is torchtitan's 500 W card (its clocks
    capped by power), fitted apart; B200 (no published row to fit yet) takes Hopper's constants."""
    if gpu.name.startswith("A100"):
        return "ampere"
    return "hopper 500 W" if gpu.name == "H100 SXM 96GB" else "hopper"


@dataclasses.dataclass(frozen=True)
class Plan:
    tp: int = 1
    sp: bool = True
    cp: int = 1
    cp_comm: str = "ring"             # ring (overlapped ring attention) | allgather (Llama 3's, exposed)
    order: str = "pp-dp-cp-tp"        # rank order, outermost first (ORDERS): which groups share a node
    attention_kernel: str = "fa2"     # Hopper: fa2 (PyTorch SDPA's flash backend) | cudnn | fa3; Ampere: fa2 (fitted)
    ep: int = 1
    pp: int = 1
    vp: int = 1                       # virtual stages (model chunks) per pipeline rank
    schedule: str = "1f1b"
    dp_strategy: str = "fsdp"
    hsdp_shard: int = 8               # HSDP: ranks one copy is sharded over (the rest replicate)
    micro_batch: int = 1              # sequences per micro-batch
    global_batch: int = 16            # sequences per step
    seq_len: int = 8192
    recompute: str = "selective"
    precision: str = "bf16"           # bf16 | fp8 (matmuls in FP8 where the GPU has it)
    fused: bool = True                # elementwise ops fused (torch.compile, Megatron's kernels); False: eager PyTorch
    grad_bytes: int = 4               # 4: fp32 main gradients (Megatron); 2: bf16


def dp_size(plan: Plan, gpus: int) -> int:
    return gpus // (plan.tp * plan.cp * plan.pp)


def validate(model: M.ModelSpec, cluster: Cluster, plan: Plan) -> int:
    """The data-parallel size, or ConfigError naming the first dimension that does not fit and what it allows."""
    g = cluster.gpus
    for name in ("tp", "cp", "pp"):
        if g % getattr(plan, name):
            raise ConfigError(name, f"{getattr(plan, name)} does not divide the {g} GPUs (allowed: a divisor of {g})")
    if g % (plan.tp * plan.cp * plan.pp):
        raise ConfigError("pp", f"tp × cp × pp = {plan.tp * plan.cp * plan.pp} does not divide the {g} GPUs (allowed: a product dividing {g})")
    dp = dp_size(plan, g)
    if model.heads % plan.tp:
        raise ConfigError("tp", f"{plan.tp} does not divide the {model.heads} attention heads (allowed: a divisor of {model.heads})")
    kv = model.heads if model.mla else model.kv_heads
    if kv % plan.tp and plan.tp % kv:
        raise ConfigError("tp", f"{plan.tp} neither divides nor is a multiple of the {kv} KV heads (allowed: a divisor or multiple of {kv})")
    if plan.seq_len % (2 * plan.cp):
        raise ConfigError("cp", f"seq_len {plan.seq_len} does not split into 2·cp = {2 * plan.cp} zigzag chunks (allowed: 2·cp dividing seq_len)")
    if plan.cp_comm not in CP_COMMS:
        raise ConfigError("cp_comm", f"{plan.cp_comm!r} (allowed: {', '.join(CP_COMMS)})")
    check_kernel(cluster.gpu, plan.attention_kernel)
    if plan.order not in ORDERS:
        raise ConfigError("order", f"{plan.order!r} (allowed: {', '.join(ORDERS)})")
    if plan.pp * plan.vp > model.layers + 2:
        raise ConfigError("pp", f"pp × virtual stages = {plan.pp * plan.vp} exceeds the {model.layers} layers and the two chunks the "
                                f"embedding and the head may take alone (allowed: at most {model.layers + 2})")
    sched = schedules.SCHEDULES.get(plan.schedule)
    if plan.schedule not in PLAN_SCHEDULES:
        raise ConfigError("schedule", f"{plan.schedule!r} (allowed: {', '.join(PLAN_SCHEDULES)})")
    if sched.interleaved != (plan.vp > 1):
        raise ConfigError("vp", f"{plan.vp} virtual stages with {plan.schedule} (allowed: vp > 1 exactly with interleaved_1f1b)")
    if plan.ep > 1 and not model.experts:
        raise ConfigError("ep", f"{plan.ep} with a dense model (allowed: 1)")
    if model.experts and (model.experts % plan.ep or dp % plan.ep):
        raise ConfigError("ep", f"{plan.ep} does not divide the {model.experts} experts and the data-parallel size {dp} (allowed: a common divisor)")
    if plan.dp_strategy not in DP_STRATEGIES:
        raise ConfigError("dp_strategy", f"{plan.dp_strategy!r} (allowed: {', '.join(DP_STRATEGIES)})")
    if plan.dp_strategy == "hsdp" and (dp % plan.hsdp_shard or plan.hsdp_shard >= dp):
        raise ConfigError("hsdp_shard", f"{plan.hsdp_shard} (allowed: a proper divisor of the data-parallel size {dp})")
    if plan.global_batch % (dp * plan.micro_batch):
        raise ConfigError("global_batch", f"{plan.global_batch} sequences do not split into dp {dp} × micro-batch {plan.micro_batch} "
                                          f"(allowed: a multiple of {dp * plan.micro_batch})")
    if plan.recompute not in RECOMPUTE:
        raise ConfigError("recompute", f"{plan.recompute!r} (allowed: {', '.join(RECOMPUTE)})")
    if plan.precision == "fp8" and not cluster.gpu.fp8_flops:
        raise ConfigError("precision", f"fp8 on {cluster.gpu.name}, which has no FP8 tensor cores (allowed: bf16)")
    return dp


def check_kernel(gpu, kernel: str) -> None:
    """ConfigError naming attention_kernel when the GPU lacks the kernel: the cuDNN and FA3 speeds are Hopper's."""
    if kernel not in ATTENTION_KERNELS or (family(gpu) == "ampere" and kernel != "fa2"):
        allowed = "fa2" if family(gpu) == "ampere" else ", ".join(ATTENTION_KERNELS)
        raise ConfigError("attention_kernel", f"{kernel!r} on {gpu.name} (allowed: {allowed}; the cuDNN and FA3 speeds are Hopper's)")


def strides(plan: Plan, gpus: int) -> dict[str, int]:
    """How far apart one group's ranks are on each of tp, cp, dp, pp, numbered in the plan's order (costs.rank_strides)."""
    return _strides(plan.order, plan.tp, plan.cp, dp_size(plan, gpus), plan.pp)


@functools.lru_cache(maxsize=4096)
def _strides(order: str, tp: int, cp: int, dp: int, pp: int) -> dict[str, int]:
    dims = tuple(order.split("-"))
    size = {"tp": tp, "cp": cp, "dp": dp, "pp": pp}
    return costs.rank_strides(dims, tuple(size[d] for d in dims))


def microbatches(plan: Plan, dp: int) -> int:
    return plan.global_batch // (dp * plan.micro_batch)


def _link(cluster: Cluster, stride: int, size: int) -> tuple[str, float, float]:
    if costs.crosses_nodes(stride, size, cluster.gpus_per_node):
        return "network", cluster.net * BUS_EFFICIENCY, LATENCY["network"]
    return "nvlink", cluster.gpu.nvlink_bw * BUS_EFFICIENCY, LATENCY["nvlink"]


def stage_layers(model: M.ModelSpec, plan: Plan) -> int:
    """Layers on the fullest pipeline rank (uneven splits round up; Llama 3's 126 layers in 128 one-layer chunks over 16
    ranks: the embedding and the head take the first and the last chunk alone, the fullest rank holds 8 layers)."""
    return math.ceil(model.layers / (plan.pp * plan.vp)) * plan.vp


def _moe_fraction(model: M.ModelSpec) -> float:
    return model.moe_layers / model.layers


def memory(model: M.ModelSpec, cluster: Cluster, plan: Plan, dp: int, eff: Efficiency = Efficiency()) -> dict:
    """Bytes per GPU by category on the first and the last pipeline rank at the peak moment of each (the loss or a
    layer's backward: backend/plan/transients.py); the larger rank is the plan's."""
    t, L = plan.tp, stage_layers(model, plan)
    c = M.counts(model)
    moe_frac = _moe_fraction(model)
    dense_layer = c["dense_layer"] / t
    if model.experts:
        shared = (c["moe_layer"] - model.experts * c["expert"]) / t
        routed = model.experts * c["expert"] / (plan.ep * t)
        layer_dense_part = (1 - moe_frac) * dense_layer + moe_frac * shared
        layer_expert_part = moe_frac * routed
    else:
        layer_dense_part, layer_expert_part = dense_layer, 0.0
    n_shard = plan.hsdp_shard if plan.dp_strategy == "hsdp" else dp
    b, s = plan.micro_batch, plan.seq_len
    per_layer = costs.activation_bytes_per_layer(model, b, s, t, plan.sp and t > 1, plan.recompute, plan.cp)
    per_layer["gathered K, V (all-gather CP)"] = costs.cp_gathered_bytes(plan.cp_comm, kv_numel(model, plan), plan.cp, plan.recompute)
    layer_act = sum(per_layer.values())
    rebuilt = sum(costs.activation_bytes_per_layer(model, b, s, t, plan.sp and t > 1, "none", plan.cp).values()) \
        if plan.recompute != "none" else 0.0
    m = microbatches(plan, dp)
    chunk_layers = L / plan.vp
    split = t if plan.sp and t > 1 else 1
    out = {}
    for rank, label in ((0, "first"), (plan.pp - 1, "last")):
        extra = (c["embedding"] if rank == 0 else 0) + ((c["head"] or (c["embedding"] if plan.pp > 1 else 0)) if rank == plan.pp - 1 else 0)
        dense_psi = L * layer_dense_part + extra / t
        expert_psi = L * layer_expert_part
        held = costs.state_bytes(dense_psi, n_shard, plan.dp_strategy, plan.grad_bytes)
        if expert_psi:
            ex = costs.state_bytes(expert_psi, max(1, n_shard // plan.ep), plan.dp_strategy, plan.grad_bytes)
            held = {k: held[k] + ex[k] for k in held}
        live = costs.live_microbatches(plan.schedule, plan.pp, m, plan.vp, rank)
        acts = layer_act * chunk_layers * live
        buffers = 2 * 2 * b * (s // plan.cp) * model.hidden / split if plan.pp > 1 else 0.0   # p2p send/recv
        if t > 1 and plan.sp:
            buffers += 2 * b * (s // plan.cp) * model.hidden   # the gathered sequence
        last = rank == plan.pp - 1
        moments = {"loss": {}, "backward": {"recompute (one layer rebuilt)": rebuilt}}
        if last:
            moments["loss"]["loss: fp32 logits, softmax, gradient"] = T.loss_bytes(b * s / plan.cp, model.vocab / t, model.gpt)
        if plan.dp_strategy in ("zero3", "fsdp", "hsdp"):
            head = (c["head"] or c["embedding"]) / t if last else 0.0
            for moment in moments:
                moments[moment]["FSDP unsharded weights and gradients"] = T.fsdp_unsharded_bytes(
                    layer_dense_part + layer_expert_part, extra / t, head, moment)
        peak = max(moments, key=lambda k: sum(moments[k].values())) if last else "backward"
        cats = {"weights": held["weights"], "gradients": held["gradients"], "optimizer states": held["optimizer states"],
                "activations (layers)": acts, "loss: fp32 logits, softmax, gradient": 0.0, "recompute (one layer rebuilt)": 0.0,
                "FSDP unsharded weights and gradients": 0.0, "communication buffers": buffers, **moments[peak]}
        allocated = sum(cats.values())
        cats["allocator fragmentation (fitted fraction)"] = T.fragmentation_bytes(allocated, eff.fragmentation)
        cats[OUTSIDE] = T.outside_allocator_bytes(communicators(plan, dp))
        out[label] = {**cats, "_moment": peak, "_live": live, "_per_layer": layer_act, "_layers": L}
    worst = max(out, key=lambda k: sum(v for kk, v in out[k].items() if not kk.startswith("_")))
    return {"stage": worst, **out[worst], "_stages": out}


def total_bytes(mem: dict) -> float:
    return sum(v for k, v in mem.items() if not k.startswith("_") and k != "stage")


def reserved_bytes(mem: dict) -> float:
    """What torch.cuda.max_memory_reserved reports (torchtitan's memory figure): the total less what lives outside
    PyTorch's caching allocator."""
    return total_bytes(mem) - mem[OUTSIDE]


def communicators(plan: Plan, dp: int) -> int:
    """NCCL communicators a rank opens: one per parallel dimension larger than one (HSDP: two)."""
    dims = [plan.tp, plan.cp, plan.ep, plan.pp, dp]
    return sum(1 for d in dims if d > 1) + (1 if plan.dp_strategy == "hsdp" else 0)


def selective_recompute(model: M.ModelSpec, f_lin: float, f_att: float) -> float:
    """Forward seconds selective recompute repeats: Megatron's (GPT) the core attention; torchtitan's op-level policy
    (the others) the matmuls it does not save (k, the output projection, the up projection w3), not attention."""
    if model.gpt:
        return f_att
    h, kv = model.hidden, (model.heads if model.mla else model.kv_heads)
    ffn = (model.top_k + model.shared_experts) * model.moe_ffn if model.experts else model.ffn
    q, k, v, o = h * model.heads * model.qk_dim, h * kv * model.qk_dim, h * kv * model.v_dim, model.heads * model.v_dim * h
    return f_lin * (k + o + h * ffn) / (q + k + v + o + 3 * h * ffn)


@dataclasses.dataclass(frozen=True)
class ChunkCompute:
    """Seconds of one pipeline chunk on one micro-batch: the GEMMs' forward and backward (backend/plan/compute.py),
    attention's forward and backward, the elementwise ops' forward (backward twice), Megatron's unfused
    softmax traffic (forward, backward); what recompute repeats (its matmul and attention part apart); the head's
    forward."""
    layers: float
    tokens: float
    f_lin: float
    b_lin: float
    f_att: float
    b_att: float
    f_ew: float
    f_sm: float
    b_sm: float
    recompute_flops: float
    recompute_f: float
    head_f: float

    @property
    def forward(self) -> float:
        return self.f_lin + self.f_att + self.f_ew + self.f_sm

    @property
    def backward(self) -> float:
        return self.b_lin + self.b_att + C.BACKWARD_FACTOR * self.f_ew + self.b_sm


def attention_seconds(forward_flops: float, gpu, kernel: str, eff: Efficiency) -> tuple[float, float]:
    """(forward, backward) seconds of attention doing `forward_flops` in its forward. Ampere: the fitted ratio of the
    GEMMs' share (FlashAttention-2 on the A100 calibration row), the backward twice the forward's model FLOPs. Hopper
    (and B200, which has no kernel table of its own): the kernel's published H100 speeds (compute.ATTENTION_KERNELS),
    times the card's clock ratio: FlashAttention-2 reaches 35% of an H100's peak against 50-73% of an A100's, so the
    Ampere ratio does not transfer."""
    if family(gpu) == "ampere":
        f = forward_flops / (gpu.bf16_flops * eff.attention(gpu))
        return f, 2 * f
    return C.attention_kernel_seconds(forward_flops, kernel, gpu.bf16_flops * eff.clock(gpu))


def attention_share(gpu, kernel: str, eff: Efficiency) -> float:
    """Attention's model FLOPs (forward and backward, 3× the forward) per second over the bf16 peak."""
    f, b = attention_seconds(1.0, gpu, kernel, eff)
    return 3.0 / (f + b) / gpu.bf16_flops


def chunk_compute(model: M.ModelSpec, cluster: Cluster, plan: Plan, eff: Efficiency) -> ChunkCompute:
    """Each layer's GEMMs from their shapes on the GPU's SMs (compute.linear_seconds: wave quantization and the
    roofline, at the fitted efficiency), attention (attention_seconds), the elementwise ops' bytes
    (eager or fused) over HBM; GPT rows (Megatron's unfused attention) add the s×s scores' HBM traffic; selective or
    full recompute repeats part of the forward."""
    t, cp, b, s = plan.tp, plan.cp, plan.micro_batch, plan.seq_len
    gpu = cluster.gpu
    peak = gpu.fp8_flops if plan.precision == "fp8" else gpu.bf16_flops
    tokens_local = b * s // cp
    per_tok = M.training_flops_per_token(model, s, M.causal(model))
    layer_att = per_tok["attention"] / model.layers
    chunk_layers = stage_layers(model, plan) / plan.vp
    lin = eff.linear(gpu)
    f_lin, b_lin = (x * chunk_layers for x in C.linear_seconds(model, tokens_local, t, plan.ep, gpu, peak, lin))
    f_att, b_att = attention_seconds(tokens_local * layer_att * chunk_layers / 3 / t, gpu, plan.attention_kernel, eff)
    f_ew = tokens_local * C.elementwise_bytes(model, t, plan.sp, plan.fused) * chunk_layers / gpu.hbm_bw
    f_sm, b_sm = ((x * chunk_layers / gpu.hbm_bw for x in costs.unfused_attention_bytes(b, s // cp, s, model.heads / t))
                  if not M.causal(model) else (0.0, 0.0))
    recompute_flops = {"none": 0.0, "selective": selective_recompute(model, f_lin, f_att), "full": f_lin + f_att}[plan.recompute]
    softmax_again = plan.recompute == "full" or (plan.recompute == "selective" and model.gpt)
    elementwise_again = plan.recompute == "full" or (plan.recompute == "selective" and not model.gpt)
    recompute_f = recompute_flops + (f_sm if softmax_again else 0.0) + (f_ew if elementwise_again else 0.0)
    head_f = C.head_seconds(model, tokens_local, t, gpu, peak, lin)
    return ChunkCompute(chunk_layers, tokens_local, f_lin, b_lin, f_att, b_att, f_ew, f_sm, b_sm, recompute_flops, recompute_f, head_f)


def tp_seconds(model: M.ModelSpec, cluster: Cluster, plan: Plan, chunk: ChunkCompute) -> tuple[str, float]:
    """Tensor parallel, exposed: the chunk's f/g collectives (dense and MoE layers' bytes) plus α per ring step."""
    t, cp = plan.tp, plan.cp
    tp_kind, tp_bw, tp_lat = _link(cluster, strides(plan, cluster.gpus)["tp"], t)
    moe_frac = _moe_fraction(model)
    tp_bytes = ((1 - moe_frac) * costs.tp_bytes_per_layer(plan.micro_batch, plan.seq_len // cp, model.hidden, t, plan.sp)
                + moe_frac * costs.tp_bytes_per_layer(plan.micro_batch, plan.seq_len // cp, model.hidden, t, plan.sp,
                                                      dense_ffn=False)) * chunk.layers
    n_coll = 4 * chunk.layers * (2 if plan.sp else 1)
    return tp_kind, (tp_bytes / tp_bw + n_coll * (t - 1) * tp_lat if t > 1 else 0.0)


def kv_numel(model: M.ModelSpec, plan: Plan) -> int:
    """Elements of one micro-batch's local K and V on one rank: b · s/cp tokens × the K and V heads the rank holds
    (GQA's few; whole heads, replicated when t exceeds them); MLA: its latent, which TP does not split."""
    width = model.kv_width if model.mla else 2 * math.ceil(model.kv_heads / plan.tp) * model.head_dim
    return plan.micro_batch * (plan.seq_len // plan.cp) * width


def cp_seconds(model: M.ModelSpec, cluster: Cluster, plan: Plan, chunk: ChunkCompute) -> tuple[str, float]:
    """Context parallel: ring attention's K/V passes hide behind the layer's attention; Llama 3's all-gather of K/V
    (and reduce-scatter of their gradients) sits exposed on the critical path (its paper, Sec. 3.3.2)."""
    cp = plan.cp
    cp_kind, cp_bw, cp_lat = _link(cluster, strides(plan, cluster.gpus)["cp"], cp)
    regather = plan.recompute == "full"
    steps = 3 * (cp - 1) if plan.cp_comm == "ring" else (3 if regather else 2) * (cp - 1)
    cp_comm = (costs.cp_sent_bytes(plan.cp_comm, kv_numel(model, plan), cp, regather=regather) / cp_bw + steps * cp_lat) \
        * chunk.layers if cp > 1 else 0.0
    return cp_kind, cp_exposed(plan.cp_comm, cp_comm, chunk.f_att + chunk.b_att)


def cp_exposed(comm: str, comm_s: float, attention_s: float) -> float:
    """Seconds of context parallel's traffic left on the critical path: ring attention sends the next K/V block while
    attending to this one, so only what exceeds the attention shows; the all-gather completes before attention starts
    (and the reduce-scatter after its backward), so all of it shows."""
    return max(0.0, comm_s - attention_s) if comm == "ring" else comm_s


def ep_seconds(model: M.ModelSpec, cluster: Cluster, plan: Plan, chunk: ChunkCompute) -> tuple[str, float]:
    """Expert parallel: dispatch and combine all-to-all in the MoE layers, forward and backward, exposed."""
    t = plan.tp
    ep_kind, ep_bw, ep_lat = _link(cluster, strides(plan, cluster.gpus)["dp"], plan.ep)   # ep: dp's innermost ranks
    a2a = 2 * chunk.tokens * model.top_k * model.hidden * costs.ACT_BYTES / t * (plan.ep - 1) / plan.ep if plan.ep > 1 else 0.0
    return ep_kind, (2 * _moe_fraction(model) * chunk.layers * (a2a / ep_bw + 2 * ep_lat) if plan.ep > 1 else 0.0)


def pp_seconds(model: M.ModelSpec, cluster: Cluster, plan: Plan, dp: int) -> tuple[str, float]:
    """Pipeline: one activation (or its gradient) per action over the stage boundary (sequence-sharded under SP)."""
    t = plan.tp
    pp_kind, pp_bw, pp_lat = _link(cluster, strides(plan, cluster.gpus)["pp"], plan.pp)
    act = plan.micro_batch * (plan.seq_len // plan.cp) * model.hidden * costs.ACT_BYTES / (t if plan.sp and t > 1 else 1)
    return pp_kind, ((act / pp_bw + pp_lat) if plan.pp > 1 else 0.0)


def pipeline_seconds(plan: Plan, m: int, F: float, B: float, head_f: float) -> tuple[float, float]:
    """(makespan, the busiest rank's busy time) of m micro-batches: the schedule's makespan function (1F1B, GPipe) with
    the head on the last rank, else busy ÷ (1 − its bubble formula)."""
    sched = schedules.SCHEDULES[plan.schedule]
    v, p = plan.vp, plan.pp
    if p == 1:
        pipe = m * (F + B + 3 * head_f)
        return pipe, pipe
    if sched.makespan_fn:
        f = [v * F] * p
        bw = [v * B] * p
        f[-1] += head_f
        bw[-1] += 2 * head_f
        return sched.makespan_fn(f, bw, m), m * (f[-1] + bw[-1])
    busy = m * (v * (F + B) + 3 * head_f)
    return busy / (1 - sched.bubble(p, m, v)), busy


def rank_parameters(model: M.ModelSpec, plan: Plan) -> tuple[float, float, float]:
    """(all, dense, expert) parameters on one rank, roughly: the model over t·p, the embedding and head on the ends,
    experts further split over ep."""
    t, p = plan.tp, plan.pp
    c = M.counts(model)
    psi = (c["total"] - (c["embedding"] + c["head"]) * (1 - 1 / p)) / (t * p)  # this rank's parameters, roughly
    if model.experts:
        expert_total = model.moe_layers * model.experts * c["expert"]
        return psi, psi - expert_total / (t * p), expert_total / (t * p * plan.ep)
    return psi, psi, 0.0


def dp_comm_seconds(model: M.ModelSpec, cluster: Cluster, plan: Plan, dp: int) -> tuple[str, float]:
    """Data parallel's ring time per step: gradient reduce-scatter/all-reduce and parameter gathers of the strategy
    (HSDP: FSDP inside the shard group plus DDP across replicas), experts' gradients over their own DP group."""
    psi, psi_dense, psi_expert = rank_parameters(model, plan)
    ds = strides(plan, cluster.gpus)["dp"]
    dp_kind, dp_bw, dp_lat = _link(cluster, ds, dp)
    strategy = plan.dp_strategy
    if strategy == "hsdp":
        shard = plan.hsdp_shard
        sh_kind, sh_bw, sh_lat = _link(cluster, ds, shard)
        rep_kind, rep_bw, rep_lat = _link(cluster, ds * shard, dp // shard)
        dp_comm = (costs.dp_sent_bytes("fsdp", psi_dense, shard, 4) / sh_bw + 3 * (shard - 1) * sh_lat
                   + costs.dp_sent_bytes("ddp", psi_dense / shard, dp // shard, 4) / rep_bw + 2 * (dp // shard - 1) * rep_lat)
        dp_kind = rep_kind
    else:
        dp_comm = costs.dp_sent_bytes(strategy, psi_dense, dp, plan.grad_bytes) / dp_bw + (3 if strategy in ("zero3", "fsdp") else 2) * (dp - 1) * dp_lat
    if psi_expert:
        edp = max(1, dp // plan.ep)
        e_kind, e_bw, e_lat = _link(cluster, ds * plan.ep, edp)
        dp_comm += costs.dp_sent_bytes(strategy if strategy != "hsdp" else "fsdp", psi_expert, edp, plan.grad_bytes) / e_bw if edp > 1 else 0.0
    return dp_kind, dp_comm


def dp_exposed_seconds(model: M.ModelSpec, plan: Plan, dp_comm: float, m: int, busy: float, B: float) -> float:
    """What data parallel leaves exposed: FSDP/ZeRO-3 prefetch hides every gather and reduce-scatter behind the
    compute except the first layer's gather; DDP/ZeRO-1/2 hide the gradient reduce-scatter behind the last
    micro-batch's backward, the parameter all-gather after the optimizer is exposed."""
    if plan.dp_strategy in ("zero3", "fsdp", "hsdp"):
        per_mb = dp_comm * (m if m > 1 else 1)
        first_gather = dp_comm / max(1, stage_layers(model, plan)) / 3
        return max(0.0, per_mb - busy) + first_gather
    grad_part = dp_comm * (2 / 3 if plan.dp_strategy != "ddp" else 1.0)
    return max(0.0, grad_part - plan.vp * B) + (dp_comm - grad_part)


def step(model: M.ModelSpec, cluster: Cluster, plan: Plan, dp: int, eff: Efficiency) -> dict:
    """Seconds of one step: per-action costs of a pipeline chunk (compute plus a share of each dimension's exposed
    communication), the pipeline makespan, exposed DP and the optimizer."""
    m, v, p = microbatches(plan, dp), plan.vp, plan.pp
    c = chunk_compute(model, cluster, plan, eff)
    (tp_kind, tp_s), (cp_kind, cp_s) = tp_seconds(model, cluster, plan, c), cp_seconds(model, cluster, plan, c)
    (ep_kind, ep_s), (pp_kind, p2p) = ep_seconds(model, cluster, plan, c), pp_seconds(model, cluster, plan, dp)
    F = c.forward + (tp_s + cp_s + ep_s) / 3 + p2p
    B = c.backward + c.recompute_f + 2 * (tp_s + cp_s + ep_s) / 3 + p2p
    pipe, busy = pipeline_seconds(plan, m, F, B, c.head_f)
    dp_kind, dp_comm = dp_comm_seconds(model, cluster, plan, dp)
    dp_exposed = dp_exposed_seconds(model, plan, dp_comm, m, busy, B)
    optimizer = OPTIMIZER_BYTES_PER_PARAM * rank_parameters(model, plan)[0] / (dp if plan.dp_strategy != "ddp" else 1) / cluster.gpu.hbm_bw
    exposed = {"tp": m * v * (tp_s), "cp": m * v * cp_s, "ep": m * v * ep_s, "pp": m * v * 2 * p2p if p > 1 else 0.0, "dp": dp_exposed}
    return {"step_s": pipe + dp_exposed + optimizer,
            "compute_s": m * (v * (c.forward + c.backward) + 3 * c.head_f),
            "recompute_s": m * v * c.recompute_f, "bubble_s": max(0.0, pipe - busy),
            "exposed_s": exposed, "optimizer_s": optimizer, "pipeline_s": pipe, "m": m,
            "F": F, "B": B, "head_f": c.head_f, "links": {"tp": tp_kind, "cp": cp_kind, "ep": ep_kind, "pp": pp_kind, "dp": dp_kind},
            "recompute_flops_fraction": c.recompute_flops / (3 * (c.f_lin + c.f_att)) if c.f_lin + c.f_att else 0.0}


def evaluate(model: M.ModelSpec, cluster: Cluster, plan: Plan, eff: Efficiency, tokens_to_train: float = 0.0,
             mem: dict | None = None) -> dict:
    """Every figure of one plan (raises ConfigError for a plan that does not divide)."""
    dp = validate(model, cluster, plan)
    mem = mem or memory(model, cluster, plan, dp, eff)
    st = step(model, cluster, plan, dp, eff)
    tokens = plan.global_batch * plan.seq_len
    flops_model = M.training_flops_per_token(model, plan.seq_len, M.causal(model))["total"] * tokens
    hw = flops_model * (1 + st["recompute_flops_fraction"])
    g = cluster.gpus
    peak = cluster.gpu.bf16_flops
    tflops = flops_model / st["step_s"] / g
    seconds = tokens_to_train / tokens * st["step_s"] if tokens_to_train else 0.0
    return {"dp": dp, "memory": mem, "memory_bytes": total_bytes(mem), "hbm_bytes": cluster.gpu.hbm_bytes,
            "fits": total_bytes(mem) <= cluster.gpu.hbm_bytes, "time": st, "tokens_per_step": tokens,
            "tokens_per_s_per_gpu": tokens / st["step_s"] / g, "model_tflops_per_gpu": tflops / 1e12,
            "hardware_tflops_per_gpu": hw / st["step_s"] / g / 1e12, "mfu": tflops / peak,
            "train_days": seconds / 86400, "gpu_hours": seconds * g / 3600}
