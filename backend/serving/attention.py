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
    """Batched PyTorch for the CPU. Built once per step (the batch's layout is the same in every layer):
    sequences with one query (decodes) and with several (prefill chunks) form two groups, so a long
    chunk does not pad every decode to its length. Each group gathers its sequences' blocks once per
    layer, pads the queries per sequence, and makes one SDPA call with a causal-by-position mask.
    Queries of one sequence must be contiguous and in increasing position."""

    def __init__(self, tables, seq, pos, block_size):
        """tables: (S, max_blocks) long; seq, pos: (N,) long: each query's sequence and position."""
        counts = torch.bincount(seq, minlength=len(tables))
        self.groups = []
        for members in (counts == 1, counts > 1):
            if not members.any():
                continue
            rows = members[seq]
            index = torch.nonzero(members).flatten()
            local = torch.full((len(tables),), -1, dtype=torch.long)
            local[index] = torch.arange(len(index))
            g_seq, g_tables = local[seq[rows]], tables[index]
            n = torch.bincount(g_seq, minlength=len(index))
            row = torch.arange(len(g_seq)) - (torch.cumsum(n, 0) - n)[g_seq]      # index within its sequence
            q_pos = torch.zeros(len(index), int(n.max()), dtype=torch.long)          # padding rows see position 0
            q_pos[g_seq, row] = pos[rows]
            mask = torch.arange(g_tables.shape[1] * block_size)[None, None, :] <= q_pos[:, :, None]  # (S, q_len, T)
            self.groups.append((rows, g_tables, g_seq, row, mask[:, None]))

    def __call__(self, q, pool):
        """q: (N, H, D); pool: (NB, 2, BS, HKV, D) -> (N, H, D)."""
        out = torch.empty_like(q)
        H, D = q.shape[1:]
        BS, HKV = pool.shape[2], pool.shape[3]
        for rows, tables, seq, row, mask in self.groups:
            S, width = tables.shape
            context = pool[tables].transpose(2, 3).reshape(S, width * BS, 2, HKV, D)        # (S, T, 2, HKV, D)
            keys = context[:, :, 0].transpose(1, 2).repeat_interleave(H // HKV, dim=1)      # (S, H, T, D)
            values = context[:, :, 1].transpose(1, 2).repeat_interleave(H // HKV, dim=1)
            queries = q.new_zeros(S, mask.shape[2], H, D)
            queries[seq, row] = q[rows]
            attended = F.scaled_dot_product_attention(queries.transpose(1, 2), keys, values, attn_mask=mask)
            out[rows] = attended.transpose(1, 2)[seq, row]
        return out


class TritonPagedAttention:
    """The Triton paged-decode kernel, one kernel row per query token with context length pos + 1."""

    def __init__(self, tables, seq, pos, block_size):
        self.tables = tables[seq].to(torch.int32).contiguous()
        self.lens = (pos + 1).to(torch.int32)

    def __call__(self, q, pool):
        from kernels.paged_attention import paged_decode

        return paged_decode(q.contiguous(), pool, self.tables, self.lens)


def paged_attention_reference(q, pool, tables, seq, pos):
    """One query at a time: gather its sequence's first pos + 1 tokens through the table, then SDPA."""
    BS, HKV, H = pool.shape[2], pool.shape[3], q.shape[1]
    out = torch.empty_like(q)
    for j in range(len(q)):
        n = int(pos[j]) + 1
        kv = pool[tables[seq[j], :-(-n // BS)]].transpose(1, 2).reshape(-1, 2, HKV, q.shape[2])[:n]
        k, v = (kv[:, i].transpose(0, 1).repeat_interleave(H // HKV, dim=0) for i in (0, 1))
        out[j] = F.scaled_dot_product_attention(q[j][:, None], k, v)[:, 0]
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
