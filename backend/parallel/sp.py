"""Sequence parallel (Megatron-SP, Korthikanti et al. 2022) on top of tensor parallel.

TP leaves the norms replicated: every rank holds the whole (b, s, h) activation there. SP splits those regions along
the sequence and swaps each all-reduce for its two halves (same volume: an all-reduce is reduce-scatter + all-gather):
    g  (before a column-parallel linear): all-gather along s in forward, reduce-scatter in backward
    g' (after a row-parallel linear):     reduce-scatter along s in forward, all-gather in backward
The linear after g saves only this rank's shard for its weight gradient and re-gathers it in backward (as Megatron
does), so no rank holds the whole norm output: that is SP's memory saving, for one extra all-gather per such linear.
"""
from __future__ import annotations

import torch.nn.functional as F
from torch.autograd import Function

SEQ = 1  # activations are (batch, sequence, hidden)


class GatherLinear(Function):
    """Y = all_gather_s(X_local) · W_rᵀ; saves X_local only and re-gathers it for the weight gradient."""

    @staticmethod
    def forward(ctx, x_local, weight, wire, name):
        ctx.wire, ctx.name = wire, name
        ctx.save_for_backward(x_local, weight)
        return F.linear(wire.all_gather(x_local, SEQ, "forward", name), weight)

    @staticmethod
    def backward(ctx, grad):
        x_local, weight = ctx.saved_tensors
        full = ctx.wire.all_gather(x_local, SEQ, "backward", f"{ctx.name} (re-gather)")
        grad_weight = grad.reshape(-1, grad.shape[-1]).T @ full.reshape(-1, full.shape[-1])
        grad_x = ctx.wire.reduce_scatter(grad @ weight, SEQ, "backward", ctx.name)
        return grad_x, grad_weight, None, None


class ReduceScatterToSP(Function):
    """g': partial sums of a row-parallel output become this rank's sequence shard of the total."""

    @staticmethod
    def forward(ctx, x, wire, name):
        ctx.wire, ctx.name = wire, name
        return wire.reduce_scatter(x, SEQ, "forward", name)

    @staticmethod
    def backward(ctx, grad):
        return ctx.wire.all_gather(grad, SEQ, "backward", ctx.name), None, None


def activation_elements(b: int, s: int, h: int, heads: int, q_dim: int, d_ff: int, t: int, sp: bool,
                        ring_kv_dim: int | None = None) -> dict[str, float]:
    """Elements one block of our decoder saves for backward on one rank (tensor-parallel degree t), term by term in
    Korthikanti's manner (korthikanti_bytes: the paper's own formula for a GPT block).
    RMSNorm (composed of elementwise ops): its input x, x·rsqrt and its output (read by the next linear): 3sbh,
      plus rsqrt itself, sb; two norms per block. Replicated under TP; split by t under SP.
    Attention (heads split): q and k after RoPE for QKᵀ, v for PV (k and v repeated over their GQA group), the
      softmax output a·s²·b, and the output projection's input: 4·sb·q_dim + a·s²·b, all split by t.
    With ring attention (context parallel; s is then this rank's positions, `ring_kv_dim` the K/V width) the
      scores are never kept: q, the stacked K and V (not repeated), the output and its log-sum-exp, and the output
      projection's input: 3·sb·q_dim + 2·sb·kv_dim + a·s·b, split by t.
    SwiGLU: gate and up outputs, silu(gate), silu(gate)·up: 4·sb·d_ff, split by t.
    """
    norm_split = t if sp else 1
    norms = {"norms (x, x·rsqrt, output)": 2 * 3 * s * b * h / norm_split, "norm rsqrt": 2 * s * b / norm_split}
    if ring_kv_dim is None:
        attention = {"attention q, k, v, output-projection input": 4 * s * b * q_dim / t,
                     "softmax output (a·s²·b)": heads * s * s * b / t}
    else:
        attention = {"ring attention q, stacked K/V, output, output-projection input": (3 * q_dim + 2 * ring_kv_dim) * s * b / t,
                     "log-sum-exp (a·s·b)": heads * s * b / t}
    return {**norms, **attention, "SwiGLU gate, up, silu, product": 4 * s * b * d_ff / t}


def korthikanti_bytes(b: int, s: int, h: int, heads: int, t: int, sp: bool) -> float:
    """The paper's activation bytes per layer for a GPT block (fp16, dropout, GELU 4h): Table 2's rows."""
    if sp:
        return s * b * h / t * (34 + 5 * heads * s / h)
    return s * b * h * (10 + 24 / t + 5 * heads * s / (h * t))

