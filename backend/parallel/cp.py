"""Context parallel: ring attention (Liu et al. 2023; seed 003) on the mesh's cp ranks.

Each rank holds a chunk of the sequence: its queries, keys and values. K/V blocks go round the ring on the cp Wire (so
their bytes count there): at step i rank r attends to the block of rank r - i while the next is already in flight
(posted before the compute, waited after it). Partials merge as FlashAttention's online softmax merges tiles:
L = log(e^L + e^L_i), O = e^(L_old - L) O + e^(L_i - L) O_i. Causal masking uses global positions; the zigzag split
(rank r holds chunks r and 2n-1-r of 2n) gives every rank the same unmasked scores, where a contiguous one idles rank 0
after step 0. Backward is the same ring, each block's dK/dV accumulator travelling one step behind it, finally home.
With GQA the ring carries the K/V heads only, repeated over their query group inside the block, gradients summed back.
"""
from __future__ import annotations

import math

import torch
from torch.autograd import Function

from backend.attention.rope import rope_angles


def positions(seq: int, index: int, n: int, split: str) -> torch.Tensor:
    """Global token positions rank `index` holds."""
    if split == "zigzag":
        c = seq // (2 * n)
        return torch.cat([torch.arange(index * c, (index + 1) * c), torch.arange((2 * n - 1 - index) * c, (2 * n - index) * c)])
    c = seq // n
    return torch.arange(index * c, (index + 1) * c)


def scores(q, k, pos_q, pos_k, causal: bool, scale: float) -> torch.Tensor:
    """QKᵀ·scale of q against one K/V block, -inf where a key's global position is after the query's (causal)."""
    s = q @ k.transpose(-1, -2) * scale
    return s.masked_fill(pos_k[None, :] > pos_q[:, None], float("-inf")) if causal else s


def block_attention(q, k, v, pos_q, pos_k, causal: bool, scale: float):
    """Attention of q to one K/V block: the output normalised in the block, each row's log-sum-exp (-inf: none seen)."""
    s = scores(q, k, pos_q, pos_k, causal, scale)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    return p @ v, lse, p


def merge(out, lse, out_i, lse_i):
    """Combine two partial softmax results by their log-sum-exps (rows that saw nothing yet stay 0, -inf)."""
    new = torch.logaddexp(lse, lse_i)
    keep, add = (torch.exp(lse - new).nan_to_num(0.0), torch.exp(lse_i - new).nan_to_num(0.0))
    return out * keep[..., None] + out_i * add[..., None], new


def _visible(pos_q, pos_k, causal) -> bool:
    return not causal or bool(pos_k.min() <= pos_q.max())


def _repeat(kv: torch.Tensor, group: int) -> torch.Tensor:
    """(2, b, kv_heads, s, d) -> (2, b, kv_heads * group, s, d): each K/V head serves `group` query heads."""
    return kv.repeat_interleave(group, 2) if group > 1 else kv


def _fold(dkv: torch.Tensor, group: int) -> torch.Tensor:
    """The gradient of _repeat: sum over each K/V head's group."""
    return dkv.unflatten(2, (-1, group)).sum(3) if group > 1 else dkv


class RingAttention(Function):
    @staticmethod
    def forward(ctx, q, k, v, pos, ring, causal, steps_log):
        n, r = ring.n, ring.index
        scale = 1 / math.sqrt(q.shape[-1])
        out = torch.zeros_like(q)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype)
        own = kv = torch.stack([k, v])
        group = q.shape[1] // k.shape[1]
        for i in range(n):
            handle = ring.start(kv, i, f"K/V block of rank {(r - i - 1) % n} in") if i < n - 1 else None
            src = (r - i) % n
            visible = _visible(pos[r], pos[src], causal)
            with ring.tracer.span("compute", f"attend to block of rank {src}", step=i):
                if visible:
                    k_i, v_i = _repeat(kv, group)
                    o_i, lse_i, _ = block_attention(q, k_i, v_i, pos[r], pos[src], causal, scale)
                    out, lse = merge(out, lse, o_i, lse_i)
            last = lse[0, 0, -1].item()  # the running log-sum-exp of this rank's last query (batch 0, head 0)
            steps_log.append({"step": i, "block_of_rank": src, "computed": visible,
                              "running_lse_last_query": last if math.isfinite(last) else None})
            if handle:
                kv = ring.finish(handle)
        ctx.save_for_backward(q, own, out, lse)  # K and V as one stacked tensor: the block this rank sends first
        ctx.args = (pos, ring, causal, scale)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, kv, out, lse = ctx.saved_tensors
        pos, ring, causal, scale = ctx.args
        n, r = ring.n, ring.index
        delta = (grad_out * out).sum(-1)
        dq = torch.zeros_like(q)
        acc, acc_handle, group = None, None, q.shape[1] // kv.shape[2]
        for i in range(n):
            src = (r - i) % n
            handle = ring.start(kv, n + i, f"K/V block of rank {(r - i - 1) % n} in (backward)") if i < n - 1 else None
            contrib = torch.zeros_like(kv)
            with ring.tracer.span("compute", f"backward on block of rank {src}", step=i):
                if _visible(pos[r], pos[src], causal):
                    k_i, v_i = _repeat(kv, group)
                    s = scores(q, k_i, pos[r], pos[src], causal, scale)
                    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)       # the final softmax, recomputed per block
                    ds = p * (grad_out @ v_i.transpose(-1, -2) - delta[..., None])
                    dq += ds @ k_i * scale
                    contrib = _fold(torch.stack([ds.transpose(-1, -2) @ q * scale, p.transpose(-1, -2) @ grad_out]), group)
            acc = contrib if acc_handle is None else ring.finish(acc_handle) + contrib
            # this block's dK/dV goes on to the next rank (after the last step: home to its owner)
            acc_handle = ring.start(acc, 2 * n + i, f"dK/dV of rank {src}'s block out")
            if handle:
                kv = ring.finish(handle)
        home = ring.finish(acc_handle)
        return dq, home[0], home[1], None, None, None, None


class SequenceShard:
    """This rank's zigzag positions and ring attention over the cp group, for a model's attention (via `apply_cp`)."""

    def __init__(self, seq: int, ring):
        self.all = [positions(seq, j, ring.n, "zigzag") for j in range(ring.n)]
        self.mine = self.all[ring.index]
        self.ring = ring  # the cp dimension's Wire
        self.steps: list[dict] = []
        self._rope: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def rope(self, s: int, d_head: int, dtype: torch.dtype):
        """RoPE's cos and sin at this rank's global positions (one table for every layer)."""
        if (d_head, dtype) not in self._rope:
            self._rope[d_head, dtype] = rope_angles(self.mine, d_head, dtype=dtype)
        return self._rope[d_head, dtype]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of this rank's queries (b, heads, s/n, d) to every rank's keys and values."""
        return RingAttention.apply(q, k, v, self.all, self.ring, True, self.steps)


def apply_cp(model, shard: SequenceShard):
    """The model's attention, in place, over `shard.mine` (RoPE at those global positions, ring attention). Costs
    n-1 K/V blocks sent per layer forward, n-1 K/V and n dK/dV blocks backward, and no s x s scores kept."""
    for block in model.blocks:
        block.attn.core = shard
    return model
