"""Paged-attention decode in Triton: one query token per sequence reads K and V through its block table.

Pool layout: kv[num_blocks, 2, block_size, n_kv_heads, head_dim] (any strides, so a layer's slice of a
larger pool works). One program per (sequence, query head); query head h reads KV head h // group
(GQA). It walks the sequence's blocks, keeping the running max m, the running sum l and the
unnormalised output (the online softmax), so no score vector of the whole context is ever stored.
Its reference (gather through the table, torch's SDPA) is backend/serving/attention.py's
`paged_attention_reference`, the one for every path over block tables.
"""
from __future__ import annotations

import kernels  # noqa: F401  (chooses the interpreter on a CPU before triton is used)

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_decode_kernel(q_ptr, kv_ptr, tables_ptr, lens_ptr, out_ptr, scale,
                         stride_qs, stride_qh, stride_kb, stride_kkv, stride_kslot, stride_kh,
                         stride_ts, stride_os, stride_oh,
                         GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    dims = tl.arange(0, HEAD_DIM)
    slots = tl.arange(0, BLOCK_SIZE)
    q = tl.load(q_ptr + seq * stride_qs + head * stride_qh + dims).to(tl.float32)
    seq_len = tl.load(lens_ptr + seq)
    m_i = tl.max(tl.full([BLOCK_SIZE], float("-inf"), tl.float32), 0)
    l_i = tl.sum(tl.zeros([BLOCK_SIZE], tl.float32), 0)
    acc = tl.zeros([HEAD_DIM], tl.float32)
    for i in range(0, tl.cdiv(seq_len, BLOCK_SIZE)):
        block = tl.load(tables_ptr + seq * stride_ts + i)
        valid = i * BLOCK_SIZE + slots < seq_len
        base = kv_ptr + block.to(tl.int64) * stride_kb + kv_head * stride_kh
        offs = slots[:, None] * stride_kslot + dims[None, :]
        k = tl.load(base + offs, mask=valid[:, None], other=0.0).to(tl.float32)
        v = tl.load(base + stride_kkv + offs, mask=valid[:, None], other=0.0).to(tl.float32)
        scores = tl.where(valid, tl.sum(k * q[None, :], axis=1) * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 0))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new)
        l_i = l_i * alpha + tl.sum(p, 0)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        m_i = m_new
    tl.store(out_ptr + seq * stride_os + head * stride_oh + dims, (acc / l_i).to(out_ptr.dtype.element_ty))


def paged_decode(q: torch.Tensor, kv_pool: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
    """q: (S, H, D); kv_pool: (NB, 2, BS, HKV, D); block_tables: (S, max_blocks) int32; seq_lens: (S,) int32."""
    S, H, D = q.shape
    _, two, BS, HKV, D2 = kv_pool.shape
    if two != 2 or D2 != D or H % HKV:
        raise ValueError(f"shapes do not match: q {tuple(q.shape)}, pool {tuple(kv_pool.shape)}")
    if D & (D - 1) or BS & (BS - 1):
        raise ValueError(f"head_dim ({D}) and block_size ({BS}) must be powers of two for this kernel")
    if q.stride(-1) != 1 or kv_pool.stride(-1) != 1:
        raise ValueError("the head dimension must be contiguous")
    out = torch.empty_like(q)
    _paged_decode_kernel[(S, H)](
        q, kv_pool, block_tables, seq_lens, out, 1.0 / D ** 0.5,
        q.stride(0), q.stride(1), kv_pool.stride(0), kv_pool.stride(1), kv_pool.stride(2), kv_pool.stride(3),
        block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=H // HKV, BLOCK_SIZE=BS, HEAD_DIM=D)
    return out
