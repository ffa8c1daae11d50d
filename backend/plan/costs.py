"""Bytes, memory and time of a parallel plan at real scale, as plain functions of (plan, model shape): the planner's
layer over the models the live parallel runs verify (backend/parallel/). Where a live run already checks a function it is called, not copied:
  tensor/sequence parallel bytes   backend/parallel/tp_model.expected_collectives (checked against gloo's sockets)
  ring collective bytes            backend/comm/collectives.ring_bytes (checked against every logged transfer)
  Korthikanti's activation bytes   backend/parallel/sp.korthikanti_bytes
  weights, gradients, Adam states  backend/estimate/training.memory_per_rank ((2 + 2 + 12)ψ and the ZeRO stages)
  schedule live micro-batches      backend/parallel/pp/schedules.Schedule.live_bound
New here: activations of a general (SwiGLU, GQA, MLA, MoE) layer by recompute, the data-parallel volume per
strategy (from ring_bytes), and which link a group of ranks crosses.
"""
from __future__ import annotations

import functools
from types import SimpleNamespace

import torch

from backend.estimate import training as estimate
from backend.parallel import sp as sp_model
from backend.comm import collectives
from backend.parallel import tp_model
from backend.parallel.pp import schedules

ACT_BYTES = 2  # bf16 activations


@functools.lru_cache(maxsize=4096)
def tp_bytes_per_layer(b: int, s: int, h: int, t: int, sp: bool, dense_ffn: bool = True, item: int = 2) -> float:
    """Bytes one tensor-parallel rank sends for one layer's forward and backward on a micro-batch of b×s tokens:
    the live TP runs' own list of collectives (expected_collectives prices them in float64; scaled to `item`)."""
    if t == 1:
        return 0.0
    config = SimpleNamespace(batch=b, seq=s, d_model=h, layers=1)
    rows = tp_model.expected_collectives(config, t, sp, first=False, last=False, dense_ffn=dense_ffn)
    return sum(r["sent_bytes"] for r in rows if r["name"] != "norm weight gradients") * item / 8


def cp_sent_bytes(comm: str, kv_numel: int, cp: int, item: int = ACT_BYTES, regather: bool = False) -> float:
    """Bytes one context-parallel rank sends for one layer's forward and backward, its local K/V block of `kv_numel`
    elements (b · s/cp tokens × the K and V heads it holds under TP, GQA's few). ring (ring attention): the block
    passes the ring cp − 1 times forward, the K/V and their gradients backward, 3(cp − 1) blocks. allgather (Llama 3,
    Sec. 3.3.2): K and V all-gathered forward (kept for the backward), their gradients reduce-scattered backward,
    (collectives.ring_bytes, the live collectives' byte model); regather: full recompute gathers them again.
    The live mesh (backend/parallel/cp.py) runs ring attention only, so the allgather bytes are checked against a
    count from the tensor shapes (tests/test_plan.py), not against a live run."""
    if cp <= 1:
        return 0.0
    if comm == "ring":
        return 3 * (cp - 1) * kv_numel * item
    gathers = 2 if regather else 1
    return gathers * collectives.ring_bytes("all_gather", kv_numel, cp, item) + collectives.ring_bytes("reduce_scatter", kv_numel * cp, cp, item)


def cp_gathered_bytes(comm: str, kv_numel: int, cp: int, recompute: str, item: int = ACT_BYTES) -> float:
    """Bytes one layer keeps for the backward beyond its activations: the all-gathered K and V of every position
    (cp · kv_numel elements) under Llama 3's all-gather CP, which attention's backward reads; none for ring attention
    (its blocks travel again) or full recompute (the forward, gather included, runs again)."""
    return float(cp * kv_numel * item) if comm == "allgather" and cp > 1 and recompute != "full" else 0.0


def unfused_attention_bytes(b: int, queries: int, keys: int, heads: float, item: int = ACT_BYTES) -> tuple[float, float]:
    """HBM bytes (forward, backward) of one layer's attention scores when they are materialised (Megatron's fused
    scale-mask-softmax and dropout, no FlashAttention), per score element of b·heads·queries·keys:
      forward   QKᵀ writes the scores (2), softmax reads and writes (4), dropout reads, writes and stores its mask (5),
                the product with V reads the probabilities (2): 13 bytes
      backward  the gradient of the probabilities written (2), dropout's backward reads it and the mask and writes (5),
                softmax's backward reads the probabilities and the gradient and writes (6), dQ and dK read dS (4): 17
    Korthikanti's 5as²b activation bytes are the kept part of these."""
    n = b * heads * queries * keys
    return 13 * n * item / 2, 17 * n * item / 2


@functools.lru_cache(maxsize=4096)
def rank_strides(order: tuple[str, ...], sizes: tuple[int, ...]) -> dict[str, int]:
    """How far apart the ranks of one group of each dimension are, for ranks numbered in `order` (outermost first, as
    backend/parallel/mesh.DIMS documents the live mesh's: a rank's coordinate on each dimension is its mixed-radix
    digit, the last dimension the fastest-varying): a dimension's stride is the product of the sizes inside it, a
    contiguous tensor's stride."""
    return dict(zip(order, torch.empty(sizes, device="meta").stride()))


def crosses_nodes(stride: int, size: int, gpus_per_node: int) -> bool:
    """A group of `size` ranks `stride` apart (rank_strides) stays in one node when it spans no more than the node's
    GPUs (nodes hold consecutive ranks)."""
    return size > 1 and stride * size > gpus_per_node


def dp_sent_bytes(strategy: str, psi: float, n: int, grad_item: int, param_item: int = 2) -> float:
    """Per-rank ring volume of one step's data-parallel traffic on ψ parameters (seed 000's 2ψ / 2ψ / 3ψ):
    DDP all-reduces the gradients; ZeRO-1/2 reduce-scatter them and all-gather the updated parameters; ZeRO-3/FSDP
    all-gather the parameters for forward and again for backward and reduce-scatter the gradients."""
    psi = int(psi) - int(psi) % n
    if n <= 1:
        return 0.0
    if strategy == "ddp":
        return collectives.ring_bytes("all_reduce", psi, n, grad_item)
    gathers = 2 if strategy in ("zero3", "fsdp", "hsdp") else 1
    return collectives.ring_bytes("reduce_scatter", psi, n, grad_item) + gathers * collectives.ring_bytes("all_gather", psi // n, n, param_item)


def state_bytes(psi: float, n: int, strategy: str, grad_item: int) -> dict[str, float]:
    """Weights, gradients and optimizer states one rank holds for ψ parameters over n data-parallel ranks:
    estimate.training.memory_per_rank's (2 + 2 + 12)ψ and its ZeRO stages, gradients kept in `grad_item` bytes
    (4: Megatron's fp32 main gradients, 18 bytes a parameter in all)."""
    stage = {"ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3, "fsdp": 3, "hsdp": 3}[strategy]
    held = estimate.memory_per_rank(psi, n, stage)
    held["gradients"] *= grad_item / estimate.BYTES["gradients"]
    return held


@functools.lru_cache(maxsize=16384)
def live_microbatches(schedule: str, p: int, m: int, v: int, rank: int = 0) -> int:
    """Chunk-micro-batches whose activations pipeline rank `rank` holds at its peak: the schedule's own bound
    (1F1B min(m, p − r); interleaved the peak of its order, v·p + p − 1 on rank 0 for m ≥ p; GPipe m)."""
    return schedules.SCHEDULES[schedule].live_bound(p, m, rank, v) if p > 1 else 1


def activation_bytes_per_layer(m, b: int, s: int, t: int, sp: bool, recompute: str, cp: int = 1) -> dict[str, float]:
    """Bytes one layer keeps for backward on one rank for a micro-batch of b sequences of s tokens (s/cp here).

    GPT models (Korthikanti et al. 2022, Table 2; LayerNorm, GELU 4h, dropout, attention scores kept):
      none 34sbh + 5as²b split by t (SP) or sbh(10 + 24/t + 5as/(ht)); selective drops the 5as²b/t core
      attention; full keeps the layer input 2sbh (/t with SP).
    Other models (bf16, no dropout, FlashAttention: no s² term; its output and fp32 log-sum-exp kept):
      none: norms' inputs 2·2sbh; attention input 2sbh, q, k, v, output 2sb(a·d_qk + kv·d_qk + kv·d_v + a·d_v),
      lse 4sba; MLP: input 2sbh, SwiGLU gate, up, silu and product 4·2sbf (MoE: top_k + shared experts' f_e per
      token, router logits 4sbE). selective: torchtitan's op-level policy (below). full: the layer input.
      Replicated parts split by t only with SP; the rest by t.
    """
    s_local = s // cp
    h = m.hidden
    split = t if sp else 1
    if m.gpt:
        if recompute == "full":
            return {"layer input": ACT_BYTES * s_local * b * h / split}
        total = sp_model.korthikanti_bytes(b, s_local, h, m.heads, t, sp)
        core = 5 * m.heads * s_local * s_local * b / t
        return {"layer": total - core} if recompute == "selective" else {"layer": total - core, "core attention": core}
    sb = s_local * b
    if recompute == "full":
        return {"layer input": ACT_BYTES * sb * h / split}
    kvh = m.heads if m.mla else m.kv_heads
    q, k, v = m.heads * m.qk_dim, kvh * m.qk_dim, kvh * m.v_dim
    o = m.heads * m.v_dim
    ffn = (m.top_k + m.shared_experts) * m.moe_ffn if m.experts else m.ffn
    router = 4 * sb * m.experts if m.experts else 0.0
    lse = 4 * sb * m.heads / t
    if recompute == "selective":
        # torchtitan's op-level selective checkpointing: the block input, attention's output and log-sum-exp, and the
        # output of every other matmul (q, v, the gate w1 and the down projection w2); the rest is recomputed
        return {"layer input": ACT_BYTES * sb * h / split, "attention output, lse": ACT_BYTES * sb * o / t + lse,
                "q, v (every other matmul)": ACT_BYTES * sb * (q + v) / t,
                "w1, w2 outputs (every other matmul)": ACT_BYTES * sb * (ffn / t + h / split) + router}
    return {"norm inputs": 2 * ACT_BYTES * sb * h / split,
            "attention input, q, k, v, output, lse, output-projection input": ACT_BYTES * sb * (h / split + (q + k + v + o) / t) + lse,
            "MLP input, SwiGLU gate, up, silu, product": ACT_BYTES * sb * (h / split + 4 * ffn / t) + router}
