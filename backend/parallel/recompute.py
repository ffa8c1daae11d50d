"""Activation recompute per pipeline stage, as a transform of the stage's chunk (Korthikanti et al. 2022).

  none       autograd keeps everything the backward reads
  full       the stage keeps only its input from F to B and reruns its forward inside B (or I, the executor's
             `recompute`): one more forward per micro-batch, about a third more compute at F:B = 1:2
  selective  only the attention core softmax(QKᵀ/√d)·V is recomputed in the backward: q, k, v are kept, its a·s²·b
             scores and probabilities (the term that grows with s²) are not, for 4·b·a·s²·d more FLOPs per layer
Selective's forward runs without a graph and saves q, k, v (through autograd's saved-tensor hooks, so the activation
meters see them); no collective sits inside the core, so nothing is re-sent.
"""
from __future__ import annotations

import torch
from torch.autograd import Function
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from backend.attention.variants import CausalCore, causal_attention as attention_core

MODES = ("none", "full", "selective")


class RecomputedCore(Function):
    """softmax(QKᵀ/√d + causal)·V keeping only q, k, v; the backward recomputes the scores, then differentiates."""

    @staticmethod
    def forward(ctx, q, k, v):
        ctx.save_for_backward(q, k, v)
        with torch.no_grad():
            return attention_core(q, k, v)

    @staticmethod
    def backward(ctx, grad):
        q, k, v = (t.detach().requires_grad_(True) for t in ctx.saved_tensors)
        with torch.enable_grad():
            out = attention_core(q, k, v)
        return torch.autograd.grad(out, (q, k, v), grad)


class SelectiveCore(CausalCore):
    """The one model's attention core over whole sequences, recomputed in the backward."""

    core = staticmethod(RecomputedCore.apply)


def apply_selective_recompute(chunk, on: bool = True) -> int:
    """Swap every block's attention core for the recomputed one (on) or back; returns how many were swapped."""
    for block in chunk.blocks:
        if on:
            block.attn.core = SelectiveCore()
        elif isinstance(block.attn.core, SelectiveCore):  # (a context-parallel ring in its place stays)
            block.attn.core = CausalCore()
    return len(chunk.blocks)


def core_flops(b: int, heads: int, s: int, d_head: int) -> int:
    """Forward FLOPs of one attention core on b sequences: QKᵀ and P·V, each 2·b·heads·s²·d (a GEMM of m×k by
    k×n is 2·m·n·k, as torch's FlopCounterMode counts it; the softmax is not a FLOP there)."""
    return 2 * 2 * b * heads * s * s * d_head


class FlopCount(TorchDispatchMode):
    """FLOPs of every op run inside it, by torch's own per-op formulas (flop_registry). FlopCounterMode also tracks
    modules with multi-grad hooks, which pipelining's split backward (autograd.grad on leaf inputs) does not allow."""

    def __init__(self):
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = flop_registry.get(func._overloadpacket)
        if formula is not None:
            self.total += formula(*args, **kwargs, out_val=out)
        return out
