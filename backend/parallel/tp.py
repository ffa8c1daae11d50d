"""Tensor parallel (Megatron-LM): the tiny LLaMA's weights split over the ranks of the mesh's tp dimension.

For Y = XA (seed 004), split A by columns and each rank computes its own columns of Y from the whole X; split
A by rows and X by columns and each rank computes a partial sum of the whole Y. Two operators glue them:
    f: identity in forward, all-reduce of the input gradient in backward   (before a column-parallel linear)
    g: all-reduce in forward, identity in backward                         (after a row-parallel linear)
A column split lets a rank apply an elementwise activation to its own columns before any communication
(seed 002), so Megatron's MLP is column then row: one all-reduce of b·s·h in forward (g), one in backward (f).
Attention splits by heads (GQA: each rank takes its query heads with the KV heads of their groups), the
embedding and the output head by vocabulary, and the cross entropy runs on vocabulary shards with three
all-reduces of b·s numbers (max, target logit, sum of exponentials), never gathering the logits.

`TPDecoder` builds rank r's shards from the single-process TinyDecoder's weights; `sources` says where every
local parameter came from, so the reference's gradients can be cut the same way for the check.
With `sp` the norm regions are sequence shards (backend/parallel/sp.py); MoE feed-forwards (n_experts > 0) are
split by expert over an ep wire (backend/parallel/ep.py) and run alike on every tp rank.
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.autograd import Function

from backend.attention.rope import apply_rope, rope_angles
from backend.models.layers import RMSNorm
from backend.models.llama import TinyDecoder
from backend.parallel.ep import ExpertParallelMoE
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


class Sharded(nn.Module):
    """A module whose parameters are cut from reference tensors: shard_sources[name] = (dim, [(reference name, slice)]),
    the pieces concatenated along dim."""

    def take(self, name: str, state: dict, dim: int, pieces: list[tuple[str, slice]]) -> None:
        self.register_parameter(name, nn.Parameter(cut(state, {name: (dim, pieces)})[name].clone()))
        self.shard_sources = {**getattr(self, "shard_sources", {}), name: (dim, pieces)}


class ColumnParallelLinear(Sharded):
    """Y_r = X·A_r: this rank's output features. Input replicated (f), or sequence shards gathered (SP)."""

    def __init__(self, state, pieces, wire, sp: bool, name: str):
        super().__init__()
        self.wire, self.sp, self.name = wire, sp, name
        self.take("weight", state, 0, pieces)  # nn.Linear stores A transposed: output features are rows

    def forward(self, x):
        if self.sp:
            return GatherLinear.apply(x, self.weight, self.wire, self.name)
        return F.linear(CopyToTP.apply(x, self.wire, self.name), self.weight)


class RowParallelLinear(Sharded):
    """Y = Σ_r X_r·A_r: this rank's input features in, a partial sum out, summed by g (or reduce-scattered, SP)."""

    def __init__(self, state, pieces, wire, sp: bool, name: str):
        super().__init__()
        self.wire, self.sp, self.name = wire, sp, name
        self.take("weight", state, 1, pieces)

    def forward(self, x):
        partial = F.linear(x, self.weight)
        return (ReduceScatterToSP if self.sp else ReduceFromTP).apply(partial, self.wire, self.name)


class TPAttention(nn.Module):
    """Causal GQA with RoPE; this rank's query heads and the KV heads of their groups, written out (not SDPA)
    so what backward saves is the textbook list that sp.activation_elements counts."""

    def __init__(self, state, prefix, shape, wire, sp, r, n):
        super().__init__()
        self.heads, self.kv_heads, self.d_head = shape.n_heads // n, shape.n_kv_heads // n, shape.d_head
        q, kv = part(shape.n_heads * shape.d_head, r, n), part(shape.n_kv_heads * shape.d_head, r, n)
        self.wqkv = ColumnParallelLinear(state, [(prefix + "wq.weight", q), (prefix + "wk.weight", kv), (prefix + "wv.weight", kv)],
                                         wire, sp, "attention")
        self.wo = RowParallelLinear(state, [(prefix + "wo.weight", q)], wire, sp, "attention")

    def forward(self, x, cos, sin, shard=None):
        """x: (b, s, h). With `shard` (context parallel, backend/parallel/cp.py) x holds this rank's positions of
        each sequence and the other positions' keys and values come round the cp ring."""
        qkv = self.wqkv(x)
        b, s = qkv.shape[:2]
        q, k, v = qkv.split([self.heads * self.d_head, self.kv_heads * self.d_head, self.kv_heads * self.d_head], -1)
        q, k, v = (t.view(b, s, -1, self.d_head).transpose(1, 2) for t in (q, k, v))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if shard is not None:
            return self.wo(shard.attend(q, k, v).transpose(1, 2).reshape(b, s, -1))
        group = self.heads // self.kv_heads
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        return self.wo(self.core(q, k, v).transpose(1, 2).reshape(b, s, -1))

    @staticmethod
    def core(q, k, v):
        """The attention core softmax(QKᵀ/√d + causal)·V, heads already repeated over their groups (what selective
        recompute, backend/parallel/recompute.py, swaps per instance for a recomputed one)."""
        return attention_core(q, k, v)


def attention_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal softmax(QKᵀ/√d)·V over (b, heads, s, d): the a·s²·b scores Korthikanti's selective recompute drops."""
    s = q.shape[-2]
    causal = torch.full((s, s), float("-inf"), dtype=q.dtype).triu(1)
    return torch.softmax(q @ k.transpose(-1, -2) * (1 / math.sqrt(q.shape[-1])) + causal, dim=-1) @ v


class TPSwiGLU(nn.Module):
    """Megatron's MLP: gate and up column-parallel (fused), silu·up on this rank's columns, down row-parallel."""

    def __init__(self, state, prefix, shape, wire, sp, r, n):
        super().__init__()
        cols = part(shape.d_ff, r, n)
        self.w13 = ColumnParallelLinear(state, [(prefix + "gate.weight", cols), (prefix + "up.weight", cols)], wire, sp, "mlp")
        self.down = RowParallelLinear(state, [(prefix + "down.weight", cols)], wire, sp, "mlp")

    def forward(self, x):
        gate, up = self.w13(x).chunk(2, -1)
        return self.down(F.silu(gate) * up)


class ReplicatedNorm(Sharded):
    """RMSNorm, whole on every rank (TP) or applied to this rank's sequence shard (SP)."""

    def __init__(self, state, name):
        super().__init__()
        self.take("weight", state, None, [(name, None)])
        self.eps = RMSNorm(1).eps

    forward = RMSNorm.forward


class VocabParallelEmbedding(Sharded):
    """Rows v0..v1 of the table; tokens outside them look up zeros, and the ranks' lookups are summed (g)."""

    def __init__(self, state, vocab, wire, sp, r, n):
        super().__init__()
        self.rows, self.wire, self.sp = part(vocab, r, n), wire, sp
        self.take("weight", state, 0, [("embed.weight", self.rows)])

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


class TPBlock(nn.Module):
    def __init__(self, state, i, shape, wire, sp, r, n, moe=None, ep_wire=None):
        super().__init__()
        p = f"blocks.{i}."
        self.attn_norm, self.ffn_norm = ReplicatedNorm(state, p + "attn_norm.weight"), ReplicatedNorm(state, p + "ffn_norm.weight")
        self.attn = TPAttention(state, p + "attn.", shape, wire, sp, r, n)
        if moe is None:
            self.ffn = TPSwiGLU(state, p + "ffn.", shape, wire, sp, r, n)
        else:
            # An MoE feed-forward is split by expert over ep ranks, not by columns over tp: its input (after the
            # attention's all-reduce) is whole on every tp rank, so each computes it alike and no tp collective runs.
            if sp:
                raise ValueError("sequence parallel with MoE blocks is not built")
            self.ffn = ExpertParallelMoE(moe, ep_wire)
            self.ffn.shard_sources = self.ffn.sources(p + "ffn.")

    def forward(self, x, cos, sin, shard=None):
        x = x + self.attn(self.attn_norm(x), cos, sin, shard)
        return x + self.ffn(self.ffn_norm(x))


class TPDecoder(nn.Module):
    """Rank r of n of the TinyDecoder `reference`: same arithmetic, weights split, activations communicated.
    With stages > 1 it is pipeline stage `stage`: its share of the blocks, the embedding on the first stage,
    the final norm, head and loss on the last."""

    def __init__(self, reference: TinyDecoder, wire, sp: bool = False, stage: int = 0, stages: int = 1, ep_wire=None):
        super().__init__()
        s, r, n = reference.shape, wire.index, wire.n
        state = {k: v.detach() for k, v in reference.state_dict().items()}
        self.shape, self.wire, self.sp = s, wire, sp
        self.first, self.last, self.vocab_rows = stage == 0, stage == stages - 1, part(s.vocab, r, n)
        if self.first:
            self.embed = VocabParallelEmbedding(state, s.vocab, wire, sp, r, n)
        layers = part(s.n_layers, stage, stages)
        moe = [b.ffn if s.n_experts else None for b in reference.blocks]
        self.blocks = nn.ModuleList(TPBlock(state, i, s, wire, sp, r, n, moe[i], ep_wire) for i in range(layers.start, layers.stop))
        if self.last:
            self.norm = ReplicatedNorm(state, "norm.weight")
            self.head = ColumnParallelLinear(state, [("head.weight", self.vocab_rows)], wire, sp, "head")

    def forward(self, tokens: torch.Tensor, memory=None):
        """tokens (b, t + 1) -> (mean next-token loss, this rank's logits (b, t, vocab / n)). `memory`, a
        context manager, is entered around the blocks only (the layers the activation formula counts)."""
        x = self.embed(tokens[:, :-1])
        with memory or contextlib.nullcontext():
            x = self.run_blocks(x)
        return self.head_loss(x, tokens[:, 1:])

    def run_blocks(self, x: torch.Tensor, shard=None) -> torch.Tensor:
        """The blocks on x; with a context-parallel `shard` x holds the positions shard.mine of each sequence."""
        if shard is not None and self.sp:
            raise ValueError("sequence parallel and context parallel together are not built")
        positions = shard.mine if shard is not None else torch.arange(x.shape[1] * (self.wire.n if self.sp else 1))
        cos, sin = rope_angles(positions, self.shape.d_head, dtype=x.dtype)
        for block in self.blocks:
            x = block(x, cos, sin, shard)
        return x

    def head_loss(self, x: torch.Tensor, targets: torch.Tensor):
        logits = self.head(self.norm(x))
        loss = VocabParallelCrossEntropy.apply(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                               self.vocab_rows.start, self.wire)
        return loss, logits

    def sync_replicated_grads(self) -> None:
        if self.sp:
            sum_norm_grads(self, self.wire)

    def sources(self) -> dict[str, tuple]:
        return {f"{prefix}.{name}".lstrip("."): src for prefix, m in self.named_modules()
                for name, src in getattr(m, "shard_sources", {}).items()}

    def expected(self, reference_tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Reference tensors (weights or gradients, by reference name) cut as this rank's parameters were."""
        return cut(reference_tensors, self.sources())


def sum_norm_grads(module: nn.Module, wire) -> None:
    """Under SP each rank's norm weights saw only its sequence shard: sum their gradients (Megatron's all-reduce
    of layer-norm gradients). Under plain TP f already made them whole, so only SP calls this."""
    for m in module.modules():
        if isinstance(m, ReplicatedNorm) and m.weight.grad is not None:
            m.weight.grad = wire.all_reduce(m.weight.grad, "backward", "norm weight gradients")


def cut(reference_tensors: dict[str, torch.Tensor], sources: dict[str, tuple]) -> dict[str, torch.Tensor]:
    out = {}
    for name, (dim, pieces) in sources.items():
        parts = [reference_tensors[ref] if dim is None else reference_tensors[ref].narrow(dim, s.start, s.stop - s.start)
                 for ref, s in pieces]
        out[name] = torch.cat(parts, dim if dim is not None else 0)
    return out
