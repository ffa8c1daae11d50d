"""FlashAttention-2 in Triton: forward and backward, causal or not, any sequence length (masked tails).

Forward: one program per (BLOCK_M query rows, batch·head). It streams BLOCK_N-row tiles of K and V,
keeps the running row max m and row sum l (the online softmax), rescales its accumulator, and writes
O and the log-sum-exp L = m + log l for the backward. S and P never leave the chip.
Backward: delta = rowsum(dO ∘ O) first; then one kernel per K/V tile accumulates dK and dV over the
query tiles, and one per Q tile accumulates dQ over the K/V tiles, both recomputing P = exp(S - L).

The tile steps both directions share (loading a row tile and counting its bytes, which scores are
visible, recomputing P and dS) are small @triton.jit helpers, so each kernel reads as its algorithm.

With COUNT_TRAFFIC the kernels add the bytes every load and store moves (masked elements excluded)
to a counter per tensor, with atomics, so the global-memory traffic is measured from the run itself,
in the interpreter and on a GPU alike. The counts equal `closed_form_traffic` for the same tiling.

References beside the kernels: `naive_attention` (the seed's three passes, S and P in memory) and
`sdpa_reference` (torch's scaled_dot_product_attention, with autograd for the backward).
Plain pointer arithmetic (no block pointers), so Triton's interpreter runs them on a CPU. The interpreter
proves no GPU compile: tests/test_gpu_compile.py compiles them to sm_90 cubins without a GPU; running
them on a GPU is tested only where one is present.
"""
from __future__ import annotations

import kernels  # noqa: F401  (chooses the interpreter on a CPU before triton is used)

import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

TENSORS = ("Q", "K", "V", "O", "L", "dO", "delta", "dQ", "dK", "dV")
# The counter slot of each tensor, constexpr so the kernels can name it.
Q_, K_, V_, O_, L_, DO_, DELTA_, DQ_, DK_, DV_ = (tl.constexpr(i) for i in range(len(TENSORS)))


@triton.jit
def _count(counters, slot: tl.constexpr, mask, width: tl.constexpr, elem: tl.constexpr, ON: tl.constexpr):
    """Add the bytes a masked load or store of `width` elements per true mask entry moved."""
    if ON:
        tl.atomic_add(counters + slot, tl.sum(mask.to(tl.int64)) * width * elem)


# --- tile steps shared by the forward and backward kernels -------------------------------------------------
@triton.jit
def _load_rows(ptr, base, rows, stride_n, N, counters, slot: tl.constexpr,
               HEAD_DIM: tl.constexpr, ELEM: tl.constexpr, COUNT: tl.constexpr):
    """Rows `rows` of one (batch, head)'s (N, HEAD_DIM) matrix; rows past N read as zeros and move no bytes."""
    ok = rows < N
    tile = tl.load(ptr + base + rows[:, None] * stride_n + tl.arange(0, HEAD_DIM)[None, :], mask=ok[:, None], other=0.0)
    _count(counters, slot, ok, HEAD_DIM, ELEM, COUNT)
    return tile


@triton.jit
def _store_rows(ptr, base, rows, stride_n, N, tile, counters, slot: tl.constexpr,
                HEAD_DIM: tl.constexpr, ELEM: tl.constexpr, COUNT: tl.constexpr):
    ok = rows < N
    tl.store(ptr + base + rows[:, None] * stride_n + tl.arange(0, HEAD_DIM)[None, :], tile.to(ptr.dtype.element_ty), mask=ok[:, None])
    _count(counters, slot, ok, HEAD_DIM, ELEM, COUNT)


@triton.jit
def _load_row_stats(ptr, bh, rows, N, counters, slot: tl.constexpr, COUNT: tl.constexpr):
    """One fp32 per row (L or delta), stored (B·H, N)."""
    ok = rows < N
    stats = tl.load(ptr + bh * N + rows, mask=ok, other=0.0)
    _count(counters, slot, ok, 1, 4, COUNT)
    return stats


@triton.jit
def _store_row_stats(ptr, bh, rows, N, stats, counters, slot: tl.constexpr, COUNT: tl.constexpr):
    ok = rows < N
    tl.store(ptr + bh * N + rows, stats, mask=ok)
    _count(counters, slot, ok, 1, 4, COUNT)


@triton.jit
def _visible(rows, cols, N, CAUSAL: tl.constexpr):
    """Which scores of a tile exist: the key inside the sequence and, if causal, not after the query."""
    keep = cols[None, :] < N
    if CAUSAL:
        keep = keep & (rows[:, None] >= cols[None, :])
    return keep


@triton.jit
def _load_query_side(Q, dO, L, Delta, base, bh, rows, stride_n, N, counters,
                     HEAD_DIM: tl.constexpr, ELEM: tl.constexpr, COUNT: tl.constexpr):
    """What the backward needs of a Q tile: Q, dO, the log-sum-exp L and delta = rowsum(dO ∘ O)."""
    q = _load_rows(Q, base, rows, stride_n, N, counters, Q_, HEAD_DIM, ELEM, COUNT)
    do = _load_rows(dO, base, rows, stride_n, N, counters, DO_, HEAD_DIM, ELEM, COUNT)
    lse = _load_row_stats(L, bh, rows, N, counters, L_, COUNT)
    delta = _load_row_stats(Delta, bh, rows, N, counters, DELTA_, COUNT)
    return q, do, lse, delta


@triton.jit
def _load_kv(K, V, base, cols, stride_n, N, counters, HEAD_DIM: tl.constexpr, ELEM: tl.constexpr, COUNT: tl.constexpr):
    k = _load_rows(K, base, cols, stride_n, N, counters, K_, HEAD_DIM, ELEM, COUNT)
    v = _load_rows(V, base, cols, stride_n, N, counters, V_, HEAD_DIM, ELEM, COUNT)
    return k, v


@triton.jit
def _recompute_p_ds(q, k, v, do, lse, delta, rows, cols, N, scale, CAUSAL: tl.constexpr, PRECISION: tl.constexpr):
    """The backward's recomputation of one tile: P = exp(S - L) from the saved L (S is never stored),
    and dS = P ∘ (dP - delta) with dP = dO Vᵀ."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
    p = tl.where(_visible(rows, cols, N, CAUSAL) & (rows[:, None] < N), tl.exp(s - lse[:, None]), 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
    return p, p * (dp - delta[:, None])


# --- kernels -----------------------------------------------------------------------------------------------
@triton.jit
def _fwd_kernel(Q, K, V, O, L, counters, scale, N,
                stride_b, stride_h, stride_n, H,
                CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                ELEM: tl.constexpr, PRECISION: tl.constexpr, COUNT_TRAFFIC: tl.constexpr):
    start_m = tl.program_id(0)
    bh = tl.program_id(1)
    base = (bh // H) * stride_b + (bh % H) * stride_h
    rows = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    q = _load_rows(Q, base, rows, stride_n, N, counters, Q_, HEAD_DIM, ELEM, COUNT_TRAFFIC)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    hi = tl.minimum(N, (start_m + 1) * BLOCK_M) if CAUSAL else N
    for start_n in range(0, hi, BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N)
        k, v = _load_kv(K, V, base, cols, stride_n, N, counters, HEAD_DIM, ELEM, COUNT_TRAFFIC)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        s = tl.where(_visible(rows, cols, N, CAUSAL), s, float("-inf"))  # rows past N are never stored
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    _store_rows(O, base, rows, stride_n, N, acc / l_i[:, None], counters, O_, HEAD_DIM, ELEM, COUNT_TRAFFIC)
    _store_row_stats(L, bh, rows, N, m_i + tl.log(l_i), counters, L_, COUNT_TRAFFIC)


@triton.jit
def _bwd_delta_kernel(O, dO, Delta, counters, N, stride_b, stride_h, stride_n, H,
                      BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, ELEM: tl.constexpr, COUNT_TRAFFIC: tl.constexpr):
    start_m = tl.program_id(0)
    bh = tl.program_id(1)
    base = (bh // H) * stride_b + (bh % H) * stride_h
    rows = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o = _load_rows(O, base, rows, stride_n, N, counters, O_, HEAD_DIM, ELEM, COUNT_TRAFFIC).to(tl.float32)
    do = _load_rows(dO, base, rows, stride_n, N, counters, DO_, HEAD_DIM, ELEM, COUNT_TRAFFIC).to(tl.float32)
    _store_row_stats(Delta, bh, rows, N, tl.sum(o * do, 1), counters, DELTA_, COUNT_TRAFFIC)


@triton.jit
def _bwd_dkdv_kernel(Q, K, V, dO, L, Delta, dK, dV, counters, scale, N, stride_b, stride_h, stride_n, H,
                     CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                     ELEM: tl.constexpr, PRECISION: tl.constexpr, COUNT_TRAFFIC: tl.constexpr):
    start_n = tl.program_id(0)
    bh = tl.program_id(1)
    base = (bh // H) * stride_b + (bh % H) * stride_h
    cols = start_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k, v = _load_kv(K, V, base, cols, stride_n, N, counters, HEAD_DIM, ELEM, COUNT_TRAFFIC)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    lo = (start_n * BLOCK_N // BLOCK_M) * BLOCK_M if CAUSAL else 0
    for start_m in range(lo, N, BLOCK_M):
        rows = start_m + tl.arange(0, BLOCK_M)
        q, do, lse, delta = _load_query_side(Q, dO, L, Delta, base, bh, rows, stride_n, N, counters,
                                             HEAD_DIM, ELEM, COUNT_TRAFFIC)
        p, ds = _recompute_p_ds(q, k, v, do, lse, delta, rows, cols, N, scale, CAUSAL, PRECISION)
        dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=PRECISION)
        dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PRECISION)
    _store_rows(dK, base, cols, stride_n, N, dk * scale, counters, DK_, HEAD_DIM, ELEM, COUNT_TRAFFIC)
    _store_rows(dV, base, cols, stride_n, N, dv, counters, DV_, HEAD_DIM, ELEM, COUNT_TRAFFIC)


@triton.jit
def _bwd_dq_kernel(Q, K, V, dO, L, Delta, dQ, counters, scale, N, stride_b, stride_h, stride_n, H,
                   CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                   ELEM: tl.constexpr, PRECISION: tl.constexpr, COUNT_TRAFFIC: tl.constexpr):
    start_m = tl.program_id(0)
    bh = tl.program_id(1)
    base = (bh // H) * stride_b + (bh % H) * stride_h
    rows = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    q, do, lse, delta = _load_query_side(Q, dO, L, Delta, base, bh, rows, stride_n, N, counters,
                                         HEAD_DIM, ELEM, COUNT_TRAFFIC)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    hi = tl.minimum(N, (start_m + 1) * BLOCK_M) if CAUSAL else N
    for start_n in range(0, hi, BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N)
        k, v = _load_kv(K, V, base, cols, stride_n, N, counters, HEAD_DIM, ELEM, COUNT_TRAFFIC)
        _, ds = _recompute_p_ds(q, k, v, do, lse, delta, rows, cols, N, scale, CAUSAL, PRECISION)
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
    _store_rows(dQ, base, rows, stride_n, N, dq * scale, counters, DQ_, HEAD_DIM, ELEM, COUNT_TRAFFIC)


# --- host side ------------------------------------------------------------------------------------------
def _check(q, k, v, block_m, block_n):
    if q.shape != k.shape or q.shape != v.shape or q.dim() != 4:
        raise ValueError(f"q, k, v must share one (batch, heads, seq, head_dim) shape; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    d = q.shape[-1]
    if d not in (16, 32, 64, 128):
        raise ValueError(f"head_dim {d} is not supported (allowed: 16, 32, 64, 128)")
    for name, b in (("block_m", block_m), ("block_n", block_n)):
        if b < 16 or b & (b - 1):
            raise ValueError(f"{name} {b} is not a power of two >= 16")
    interpreted = not q.is_cuda
    if interpreted and q.dtype not in (torch.float16, torch.float32):
        raise ValueError(f"{q.dtype} in Triton's interpreter gives wrong numbers (allowed there: float16, float32)")


def _launch_args(q, block_m, block_n, causal):
    B, H, N, D = q.shape
    return dict(CAUSAL=causal, BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=D, ELEM=q.element_size(),
                PRECISION="ieee" if q.dtype == torch.float32 else "tf32"), (B, H, N)


def flash_forward(q, k, v, causal=False, block_m=16, block_n=16, counters=None):
    """q, k, v: (B, H, N, D), contiguous. Returns O and L (B·H, N) fp32. counters: int64[10] or None."""
    _check(q, k, v, block_m, block_n)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    meta, (B, H, N) = _launch_args(q, block_m, block_n, causal)
    o = torch.empty_like(q)
    lse = torch.empty(B * H, N, device=q.device, dtype=torch.float32)
    cnt = counters if counters is not None else torch.zeros(len(TENSORS), dtype=torch.int64, device=q.device)
    _fwd_kernel[(triton.cdiv(N, block_m), B * H)](q, k, v, o, lse, cnt, q.shape[-1] ** -0.5, N,
                                                   q.stride(0), q.stride(1), q.stride(2), H,
                                                   COUNT_TRAFFIC=counters is not None, **meta)
    return o, lse


def flash_backward(q, k, v, o, lse, do, causal=False, block_m=16, block_n=16, counters=None):
    _check(q, k, v, block_m, block_n)
    q, k, v, o, do = (t.contiguous() for t in (q, k, v, o, do))
    meta, (B, H, N) = _launch_args(q, block_m, block_n, causal)
    cnt = counters if counters is not None else torch.zeros(len(TENSORS), dtype=torch.int64, device=q.device)
    on = counters is not None
    delta = torch.empty_like(lse)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    strides = (q.stride(0), q.stride(1), q.stride(2), H)
    _bwd_delta_kernel[(triton.cdiv(N, block_m), B * H)](o, do, delta, cnt, N, *strides, BLOCK_M=block_m,
                                                         HEAD_DIM=meta["HEAD_DIM"], ELEM=meta["ELEM"], COUNT_TRAFFIC=on)
    scale = q.shape[-1] ** -0.5
    _bwd_dkdv_kernel[(triton.cdiv(N, block_n), B * H)](q, k, v, do, lse, delta, dk, dv, cnt, scale, N, *strides,
                                                        COUNT_TRAFFIC=on, **meta)
    _bwd_dq_kernel[(triton.cdiv(N, block_m), B * H)](q, k, v, do, lse, delta, dq, cnt, scale, N, *strides,
                                                      COUNT_TRAFFIC=on, **meta)
    return dq, dk, dv


class FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal=False, block_m=16, block_n=16):
        o, lse = flash_forward(q, k, v, causal, block_m, block_n)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.meta = (causal, block_m, block_n)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = flash_backward(q, k, v, o, lse, do, *ctx.meta)
        return dq, dk, dv, None, None, None


def flash_attention(q, k, v, causal=False, block_m=16, block_n=16):
    return FlashAttention.apply(q, k, v, causal, block_m, block_n)


def closed_form_traffic(B, H, N, D, elem, causal, block_m, block_n, backward=False) -> dict[str, int]:
    """Bytes each tensor moves under this tiling, from tile geometry alone (masked tails excluded)."""
    def rows_in(start, size):
        return max(0, min(N, start + size) - start)

    def k_tiles_for_q(start_m):  # K/V tiles a Q tile visits
        hi = min(N, start_m + block_m) if causal else N
        return list(range(0, hi, block_n))

    def q_tiles_for_k(start_n):
        lo = (start_n // block_m) * block_m if causal else 0
        return list(range(lo, N, block_m))

    q_starts, k_starts = range(0, N, block_m), range(0, N, block_n)
    row_bytes, bh = D * elem, B * H
    kv_reads = sum(rows_in(s, block_n) for m in q_starts for s in k_tiles_for_q(m)) * row_bytes * bh
    t = dict.fromkeys(TENSORS, 0)
    t.update(Q=N * row_bytes * bh, K=kv_reads, V=kv_reads, O=N * row_bytes * bh, L=N * 4 * bh)
    if backward:
        q_reads = sum(rows_in(m, block_m) for s in k_starts for m in q_tiles_for_k(s)) * bh
        t["Q"] += q_reads * row_bytes + N * row_bytes * bh            # dK/dV loop, then the dQ kernel
        t["K"] += N * row_bytes * bh + kv_reads                         # dK/dV kernel, then the dQ loop
        t["V"] += N * row_bytes * bh + kv_reads
        t["O"] += N * row_bytes * bh                                    # delta = rowsum(dO * O)
        t["dO"] = N * row_bytes * bh + q_reads * row_bytes + N * row_bytes * bh
        t["L"] += q_reads * 4 + N * 4 * bh
        t["delta"] = N * 4 * bh + q_reads * 4 + N * 4 * bh
        t["dQ"], t["dK"], t["dV"] = (N * row_bytes * bh,) * 3
    return t


# --- references --------------------------------------------------------------------------------------------
def naive_attention(q, k, v, causal=False):
    """The seed's steps, each a separate pass over memory: S = QKᵀ/√d, P = softmax(S), O = PV.
    Returns O and the bytes each step read and wrote (measured from the tensors it touched)."""
    d = q.shape[-1]
    s = q @ k.transpose(-1, -2) / math.sqrt(d)
    if causal:
        n = q.shape[-2]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    p = torch.softmax(s, dim=-1)
    o = p @ v
    nb = lambda t: t.numel() * t.element_size()  # noqa: E731
    traffic = {"Q": nb(q), "K": nb(k), "V": nb(v), "S": 2 * nb(s), "P": 2 * nb(p), "O": nb(o)}  # S, P: written then read
    return o, traffic


def sdpa_reference(q, k, v, causal=False, do=None):
    """torch's scaled_dot_product_attention: O, and with dO given, (dQ, dK, dV) by autograd (else None)."""
    q, k, v = (t.detach().clone().requires_grad_(do is not None) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    if do is None:
        return out.detach(), None
    out.backward(do)
    return out.detach(), (q.grad, k.grad, v.grad)
