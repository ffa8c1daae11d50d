"""Tensor parallel (Megatron-LM): the tiny LLaMA's weights split over the ranks of the mesh's tp dimension.

For Y = XA (seed 004): split A by columns and each rank computes its columns of Y from the whole X; split A by rows
and X by columns and each rank computes a partial sum of Y. Two operators glue them:
    f: identity in forward, all-reduce of the input gradient in backward   (before a column-parallel linear)
    g: all-reduce in forward, identity in backward                         (after a row-parallel linear)
A column split lets a rank apply an elementwise activation to its own columns first (seed 002), so the MLP is column
then row: one all-reduce of b·s·h forward (g), one backward (f). Attention splits by heads (GQA: each rank's query
heads with their groups' KV heads), embedding and head by vocabulary, and the cross entropy runs on vocabulary shards
with three all-reduces of b·s numbers (max, target logit, sum of exponentials), never gathering the logits.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.autograd import Function

from backend.models.layers import SwiGLU
from backend.models.llama import TinyDecoder
from backend.parallel.sp import GatherLinear, ReduceScatterToSP


class CopyToTP(Function):
    """f: every rank needs the whole input; in backward each holds a partial input gradient, so sum them."""

    @staticmethod
    def forward(ctx, x, wire, name):
        ctx.wire, ctx.name = wire, name
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return ctx.wire.all_reduce(grad, "backward", ctx.name), None, None


class ReduceFromTP(Function):
    """g: each rank holds a partial sum of the output; add them. The gradient of a sum reaches every term as is."""

    @staticmethod
    def forward(ctx, x, wire, name):
        return wire.all_reduce(x, "forward", name)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


def part(total: int, index: int, parts: int) -> slice:
    size = total // parts
    return slice(index * size, (index + 1) * size)


def shard(name: str, module: nn.Module, dim: int, pieces: list[tuple[nn.Parameter, slice]]) -> None:
    """Give `module` parameter `name`: pieces of whole source-tagged parameters cut along dim and concatenated, tagged
    with the reference tensors they came from."""
    new = nn.Parameter(torch.cat([p.detach()[(slice(None),) * dim + (s,)] for p, s in pieces], dim).clone())
    new.source = (dim, [(p.source[1][0][0], s) for p, s in pieces])
    module.register_parameter(name, new)


class ColumnParallelLinear(nn.Module):
    """Y_r = X·A_r: this rank's output features (of one or several linears reading the same X, side by side).
    Input replicated (f), or sequence shards gathered (SP)."""

    def __init__(self, pieces, wire, sp: bool, name: str):
        super().__init__()
        self.wire, self.sp, self.name = wire, sp, name
        shard("weight", self, 0, [(linear.weight, s) for linear, s in pieces])  # nn.Linear stores A transposed

    def forward(self, x):
        if self.sp:
            return GatherLinear.apply(x, self.weight, self.wire, self.name)
        return F.linear(CopyToTP.apply(x, self.wire, self.name), self.weight)


class RowParallelLinear(nn.Module):
    """Y = Σ_r X_r·A_r: this rank's input features in, a partial sum out, summed by g (or reduce-scattered, SP)."""

    def __init__(self, linear, cols: slice, wire, sp: bool, name: str):
        super().__init__()
        self.wire, self.sp, self.name = wire, sp, name
        shard("weight", self, 1, [(linear.weight, cols)])

    def forward(self, x):
        partial = F.linear(x, self.weight)
        return (ReduceScatterToSP if self.sp else ReduceFromTP).apply(partial, self.wire, self.name)


class VocabParallelEmbedding(nn.Module):
    """Rows v0..v1 of the table; tokens outside them look up zeros, and the ranks' lookups are summed (g)."""

    def __init__(self, embedding, wire, sp):
        super().__init__()
        self.rows, self.wire, self.sp = part(embedding.num_embeddings, wire.index, wire.n), wire, sp
        shard("weight", self, 0, [(embedding.weight, self.rows)])

    def forward(self, tokens):
        outside = (tokens < self.rows.start) | (tokens >= self.rows.stop)
        found = F.embedding((tokens - self.rows.start).masked_fill(outside, 0), self.weight).masked_fill(outside[..., None], 0.0)
        return (ReduceScatterToSP if self.sp else ReduceFromTP).apply(found, self.wire, "embedding")


class VocabParallelCrossEntropy(Function):
    """Mean cross entropy of logits split by vocabulary (N, V/n) without gathering them: a max all-reduce for
    stability, then sums of the target's logit and of exp over the ranks; the gradient softmax − onehot is local."""

    @staticmethod
    def forward(ctx, logits, target, first, wire):
        ours = (target >= first) & (target < first + logits.shape[1])
        local = (target - first).clamp(0, logits.shape[1] - 1)
        peak = wire.all_reduce(logits.max(-1).values, "forward", "cross entropy: max", op="max")
        shifted = logits - peak[:, None]
        target_logit = wire.all_reduce(shifted.gather(1, local[:, None])[:, 0] * ours, "forward", "cross entropy: target logit")
        exp = shifted.exp()
        total = wire.all_reduce(exp.sum(-1), "forward", "cross entropy: sum of exp")
        ctx.save_for_backward(exp / total[:, None], local, ours)
        return (total.log() - target_logit).mean()

    @staticmethod
    def backward(ctx, grad):
        softmax, local, ours = ctx.saved_tensors
        g = softmax.clone()
        g[torch.arange(len(local)), local] -= ours.to(g.dtype)
        return g * grad / len(local), None, None, None


class VocabParallelLoss(nn.Module):
    """The model's cross entropy, swapped for this rank's vocabulary rows first.. of the logits."""

    def __init__(self, first: int, wire):
        super().__init__()
        self.first, self.wire = first, wire

    def forward(self, logits, target):
        return VocabParallelCrossEntropy.apply(logits, target, self.first, self.wire)


def apply_tp(model: TinyDecoder, wire, sp: bool = False) -> TinyDecoder:
    """Rank wire.index of wire.n of the model, in place: q, k, v fused column-parallel, wo row-parallel (local heads
    with their GQA groups); gate and up fused column-parallel, down row-parallel; embedding, head and loss by
    vocabulary. Each new parameter's `source` says which reference pieces it was cut from. Costs per layer two
    all-reduces of b·s·h forward (g) and two backward (f); `sp`: sequence-parallel norms (sp.py), whose weights'
    gradients need summing (sum_norm_grads). MoE feed-forwards are left to apply_ep: without SP every tp rank runs them
    on the whole sequence; with SP each on its sequence shard (Megatron's SP + EP), gradients summed over tp."""
    s, r, n = model.shape, wire.index, wire.n
    if s.variant == "mla":
        raise ValueError("tensor parallel of multi-head latent attention is not built (variant: mha, mqa or gqa)")
    kv_heads = s.n_heads if s.variant == "mha" else 1 if s.variant == "mqa" else s.n_kv_heads
    for field, size in (("n_heads", s.n_heads), ("n_kv_heads", kv_heads), ("d_ff", s.d_ff), ("vocab", s.vocab)):
        if size % n:
            raise ValueError(f"{field}={size} does not divide by the tensor-parallel degree {n} (allowed: a multiple of {n})")
    if model.embed is not None:
        model.embed = VocabParallelEmbedding(model.embed, wire, sp)
    for block in model.blocks:
        a = block.attn
        q, kv = part(a.n_heads * a.d_head, r, n), part(a.n_kv_heads * a.d_head, r, n)
        wq, wk, wv, wo = a.wq, a.wk, a.wv, a.wo
        del a.wq, a.wk, a.wv, a.wo
        a.wqkv = ColumnParallelLinear([(wq, q), (wk, kv), (wv, kv)], wire, sp, "attention")
        a.wo = RowParallelLinear(wo, q, wire, sp, "attention")
        a.n_heads, a.n_kv_heads = a.n_heads // n, a.n_kv_heads // n
        f = block.ffn
        if isinstance(f, SwiGLU):
            cols = part(f.down.in_features, r, n)
            gate, up, down = f.gate, f.up, f.down
            del f.gate, f.up, f.down
            f.w13, f.down = ColumnParallelLinear([(gate, cols), (up, cols)], wire, sp, "mlp"), RowParallelLinear(down, cols, wire, sp, "mlp")
        else:  # MoE: replicated over tp; under SP it routes this rank's sequence shard only (apply_ep), so it is
            for p in f.parameters():  # trained by that shard alone, as the norms are
                p.sequence_parallel = sp
        for norm in (block.attn_norm, block.ffn_norm):
            norm.weight.sequence_parallel = sp
    if model.head is not None:
        rows = part(s.vocab, r, n)
        model.head = ColumnParallelLinear([(model.head, rows)], wire, sp, "head")
        model.cross_entropy = VocabParallelLoss(rows.start, wire)
        model.norm.weight.sequence_parallel = sp
    return model


def sum_norm_grads(module: nn.Module, wire) -> None:
    """Under SP each rank's norm weights (and MoE layers) saw only its sequence shard: sum their gradients (Megatron's
    all-reduce of layer-norm gradients; under plain TP f already made them whole)."""
    for p in module.parameters():
        if getattr(p, "sequence_parallel", False) and p.grad is not None:
            p.grad = wire.all_reduce(p.grad, "backward", "norm weight gradients")


def cut(reference_tensors: dict[str, torch.Tensor], sources: dict[str, tuple]) -> dict[str, torch.Tensor]:
    """Reference tensors cut as each parameter's `source` says: its (name, slice) pieces along its dim, concatenated."""
    return {name: torch.cat([reference_tensors[ref][(slice(None),) * (dim or 0) + (s,)] for ref, s in pieces], dim or 0)
            for name, (dim, pieces) in sources.items()}
