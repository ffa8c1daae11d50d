"""Attention over block tables for a mixed batch: prefill chunks and decode tokens in one call.

Query token j belongs to sequence seq[j] at position pos[j] and attends to that sequence's positions
0..pos[j], read from the paged pool through its block table. Two paths compute the same thing:
- `TorchPagedAttention`: batched PyTorch for the CPU;
- `TritonPagedAttention`: the Triton paged-decode kernel (kernels/paged_attention.py), one kernel row
  per query token with context length pos + 1 (a prefill token is a decode with a shorter context);
- `paged_attention_reference`: one query at a time, gather + SDPA (the independent check).
Each is built once per step from the batch's layout and called once per layer with that layer's pool.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


class TorchPagedAttention:
    """Batched PyTorch for the CPU, built once per step (the batch's layout is the same in every layer).
    Decodes (one query per sequence) read exactly their own blocks, no padding, with a softmax per
    sequence over the concatenated slots: their cost follows the KV blocks read, as a paged kernel's
    does. Prefill chunks (several queries per sequence, few sequences) pad the queries per sequence and
    make one SDPA call with a causal-by-position mask: it scores every chunk's queries (padded to the longest
    chunk) against the chunks' widest context (in whole blocks), masked or not, about twice a new prompt's
    causal pairs. A sequence's queries must be contiguous, in order."""

    def __init__(self, tables, seq, pos, block_size):
        """tables: (S, max_blocks) long; seq, pos: (N,) long: each query's sequence and position."""
        counts = torch.bincount(seq, minlength=len(tables))
        self.decode_rows, self.chunk_rows = counts[seq] == 1, counts[seq] > 1
        if self.decode_rows.any():  # decodes: every valid slot of every block, tagged with its query
            lens = pos[self.decode_rows] + 1
            n_blocks = -(-lens // block_size)
            owner = torch.repeat_interleave(torch.arange(len(lens)), n_blocks)
            nth = torch.arange(len(owner)) - (torch.cumsum(n_blocks, 0) - n_blocks)[owner]
            self.blocks = tables[seq[self.decode_rows]][owner, nth]
            slot_pos = (nth[:, None] * block_size + torch.arange(block_size)).flatten()
            self.slot_owner = owner.repeat_interleave(block_size)
            self.invalid = slot_pos >= lens[self.slot_owner]
        if self.chunk_rows.any():
            index = torch.unique(seq[self.chunk_rows])
            local = torch.full((len(tables),), -1, dtype=torch.long)
            local[index] = torch.arange(len(index))
            # Only the blocks the chunks reach: the batch's tables are as wide as its longest sequence, often a decode.
            reach = int(-(-(int(pos[self.chunk_rows].max()) + 1) // block_size))
            self.chunk_tables, self.chunk_seq = tables[index, :reach], local[seq[self.chunk_rows]]
            n = torch.bincount(self.chunk_seq, minlength=len(index))
            self.chunk_row = torch.arange(len(self.chunk_seq)) - (torch.cumsum(n, 0) - n)[self.chunk_seq]
            q_pos = torch.zeros(len(index), int(n.max()), dtype=torch.long)          # padding rows see position 0
            q_pos[self.chunk_seq, self.chunk_row] = pos[self.chunk_rows]
            width = self.chunk_tables.shape[1] * block_size
            self.mask = (torch.arange(width)[None, None, :] <= q_pos[:, :, None])[:, None]  # (S, 1, q_len, T)

    def __call__(self, q, pool):
        """q: (N, H, D); pool: (NB, 2, BS, HKV, D) -> (N, H, D)."""
        out = torch.empty_like(q)
        if self.decode_rows.any():
            out[self.decode_rows] = self._decodes(q[self.decode_rows], pool)
        if self.chunk_rows.any():
            out[self.chunk_rows] = self._chunks(q[self.chunk_rows], pool)
        return out

    def _decodes(self, q, pool):
        S, H, D = q.shape
        HKV = pool.shape[3]
        kv = pool[self.blocks]                                                    # (B, 2, BS, HKV, D)
        k, v = kv[:, 0].reshape(-1, HKV, D), kv[:, 1].reshape(-1, HKV, D)          # (slots, HKV, D)
        qg = q.view(S, HKV, H // HKV, D)[self.slot_owner]                           # each slot's query, GQA groups
        scores = torch.einsum("thd,thgd->thg", k, qg) / D ** 0.5
        scores[self.invalid] = float("-inf")
        owner = self.slot_owner[:, None, None].expand_as(scores)
        top = torch.full((S, HKV, H // HKV), float("-inf"), dtype=q.dtype).scatter_reduce(0, owner, scores, "amax")
        p = torch.exp(scores - top[self.slot_owner])
        total = torch.zeros_like(top).index_add_(0, self.slot_owner, p)
        acc = torch.zeros(S, HKV, H // HKV, D, dtype=q.dtype).index_add_(0, self.slot_owner, p[..., None] * v[:, :, None])
        return (acc / total[..., None]).reshape(S, H, D)

    def _chunks(self, q, pool):
        H, D = q.shape[1:]
        BS, HKV = pool.shape[2], pool.shape[3]
        S, width = self.chunk_tables.shape
        context = pool[self.chunk_tables].transpose(2, 3).reshape(S, width * BS, 2, HKV, D)     # (S, T, 2, HKV, D)
        keys = context[:, :, 0].transpose(1, 2).repeat_interleave(H // HKV, dim=1)             # (S, H, T, D)
        values = context[:, :, 1].transpose(1, 2).repeat_interleave(H // HKV, dim=1)
        queries = q.new_zeros(S, self.mask.shape[2], H, D)
        queries[self.chunk_seq, self.chunk_row] = q
        attended = F.scaled_dot_product_attention(queries.transpose(1, 2), keys, values, attn_mask=self.mask)
        return attended.transpose(1, 2)[self.chunk_seq, self.chunk_row]


class TritonPagedAttention:
    """The Triton paged-decode kernel, one kernel row per query token with context length pos + 1."""

    def __init__(self, tables, seq, pos, block_size):
        self.tables = tables[seq].to(torch.int32).contiguous()
        self.lens = (pos + 1).to(torch.int32)

    def __call__(self, q, pool):
        from kernels.paged_attention import paged_decode

        return paged_decode(q.contiguous(), pool, self.tables, self.lens)


def paged_attention_reference(q, pool, tables, seq, pos):
    """The one reference for attention over block tables (the CPU path, the Triton kernel): one query at a time,
    gather its sequence's first pos + 1 tokens through the table, then torch's SDPA, in at least float32.
    A decode batch (the kernel's) is seq = 0..S-1, pos = lengths - 1."""
    BS, HKV, H = pool.shape[2], pool.shape[3], q.shape[1]
    dtype = torch.promote_types(q.dtype, torch.float32)
    out = torch.empty_like(q)
    for j in range(len(q)):
        n = int(pos[j]) + 1
        kv = pool[tables[int(seq[j]), :-(-n // BS)].long()].transpose(1, 2).reshape(-1, 2, HKV, q.shape[2])[:n].to(dtype)
        k, v = (kv[:, i].transpose(0, 1).repeat_interleave(H // HKV, dim=0) for i in (0, 1))
        out[j] = F.scaled_dot_product_attention(q[j][:, None].to(dtype), k, v)[:, 0].to(q.dtype)
    return out


def mixed_batch(seed: int = 0, block_size: int = 4, heads: int = 4, kv_heads: int = 2, head_dim: int = 16,
                chunks=((0, 7), (5, 1), (9, 4), (12, 1), (2, 1))):
    """A small batch over a random pool: per sequence (tokens already cached, tokens this step), with
    block tables that interleave in the pool. Returns (q, pool, tables, seq, pos)."""
    g = torch.Generator().manual_seed(seed)
    lengths = [cached + new for cached, new in chunks]
    width = max(-(-n // block_size) for n in lengths)
    num_blocks = width * len(chunks) + 3
    pool = torch.randn(num_blocks, 2, block_size, kv_heads, head_dim, generator=g)
    tables = torch.randperm(num_blocks, generator=g)[:width * len(chunks)].view(len(chunks), width)
    seq = torch.cat([torch.full((new,), s) for s, (_, new) in enumerate(chunks)])
    pos = torch.cat([torch.arange(cached, cached + new) for cached, new in chunks])
    q = torch.randn(len(seq), heads, head_dim, generator=g)
    return q, pool, tables, seq, pos
