"""Attention over block tables for a mixed batch: prefill chunks and decode tokens in one call.

Query token j belongs to sequence seq[j] at position pos[j] and attends to that sequence's positions
0..pos[j], read from the paged pool through its block table. Two paths compute the same thing:
- `paged_attention_torch`: batched PyTorch for the CPU: gather each sequence's blocks once, pad the
  queries per sequence, one SDPA call with a causal-by-position mask;
- `paged_attention_triton`: the Triton paged-decode kernel (kernels/paged_attention.py), one kernel
  row per query token with context length pos + 1 (a prefill token is a decode with a shorter context).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def paged_attention_torch(q, pool, tables, seq, pos):
    """q: (N, H, D); pool: (NB, 2, BS, HKV, D); tables: (S, max_blocks) long; seq, pos: (N,) long.
    Queries of one sequence must be contiguous in q and in increasing position. Returns (N, H, D).
    Sequences with one query (decodes) and with several (prefill chunks) go in two calls, so a long
    chunk does not pad every decode to its length."""
    counts = torch.bincount(seq, minlength=len(tables))
    out = torch.empty_like(q)
    for group in (counts == 1, counts > 1):
        if group.any():
            rows = group[seq]
            members = torch.nonzero(group).flatten()
            local = torch.full((len(tables),), -1, dtype=torch.long)
            local[members] = torch.arange(len(members))
            out[rows] = _padded_attention(q[rows], pool, tables[members], local[seq[rows]], pos[rows])
    return out


def _padded_attention(q, pool, tables, seq, pos):
    N, H, D = q.shape
    S, width = tables.shape
    BS, HKV = pool.shape[2], pool.shape[3]
    context = pool[tables].transpose(2, 3).reshape(S, width * BS, 2, HKV, D)       # (S, T, 2, HKV, D)
    keys = context[:, :, 0].transpose(1, 2).repeat_interleave(H // HKV, dim=1)       # (S, H, T, D)
    values = context[:, :, 1].transpose(1, 2).repeat_interleave(H // HKV, dim=1)
    counts = torch.bincount(seq, minlength=S)
    first = torch.cumsum(counts, 0) - counts
    row = torch.arange(N) - first[seq]                                                 # index within its sequence
    q_len = int(counts.max())
    queries = q.new_zeros(S, q_len, H, D)
    queries[seq, row] = q
    q_pos = torch.zeros(S, q_len, dtype=torch.long)                                    # padding rows see position 0
    q_pos[seq, row] = pos
    mask = torch.arange(width * BS)[None, None, :] <= q_pos[:, :, None]                # (S, q_len, T)
    out = F.scaled_dot_product_attention(queries.transpose(1, 2), keys, values, attn_mask=mask[:, None])
    return out.transpose(1, 2)[seq, row]


def paged_attention_triton(q, pool, tables, seq, pos):
    from kernels.paged_attention import paged_decode

    return paged_decode(q.contiguous(), pool, tables[seq].to(torch.int32).contiguous(), (pos + 1).to(torch.int32))
