"""A tiled GEMM in Triton, C = A @ B, with its global-memory traffic counted as it runs.

One program computes one BLOCK_M x BLOCK_N tile of C. It walks K in BLOCK_K steps, loading a
BLOCK_M x BLOCK_K tile of A and a BLOCK_K x BLOCK_N tile of B each step and accumulating their
product in fp32 (`tl.dot`, which a GPU runs on its tensor cores). Tails are masked, so any M, N, K.

Program order: programs are numbered along groups of GROUP_M tile-rows, column by column inside a
group, so programs that run at the same time share A's row bands and B's column bands in L2 (the
Triton tutorial's "L2 cache optimisation"). It changes which loads hit L2, not how many are issued.

Traffic: with COUNT_TRAFFIC every load and store adds the bytes it moved (masked elements excluded)
to a counter per tensor. Each A row band is read by every tile column and each B column band by every
tile row, so the counts are exactly `closed_form_traffic`:
    A: M·K·cdiv(N, BLOCK_N)·elem   B: K·N·cdiv(M, BLOCK_M)·elem   C: M·N·elem_c
which is why a larger tile raises the arithmetic intensity 2·M·N·K / bytes.

Reference beside it: `reference_matmul` (torch.matmul in fp32). Plain pointer arithmetic (no block
pointers), so Triton's interpreter runs it on a CPU. The interpreter proves no GPU compile:
tests/test_gpu_compile.py compiles it to an sm_90 cubin without a GPU; running it on a GPU is tested
only where one is present.
"""
from __future__ import annotations

import kernels  # noqa: F401  (chooses the interpreter on a CPU before triton is used)

import torch
import triton
import triton.language as tl

TENSORS = ("A", "B", "C")
A_, B_, C_ = (tl.constexpr(i) for i in range(len(TENSORS)))  # counter slots


@triton.jit
def _count(counters, slot: tl.constexpr, mask, elem: tl.constexpr, ON: tl.constexpr):
    """Add the bytes a masked load or store moved: one element per true mask entry."""
    if ON:
        tl.atomic_add(counters + slot, tl.sum(tl.sum(mask.to(tl.int64), 1), 0) * elem)


@triton.jit
def _tile_coords(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Program id -> (tile row, tile column), grouped GROUP_M tile-rows at a time (see `program_order`)."""
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)  # the last group may be short
    return first_m + (pid % per_group) % group_rows, (pid % per_group) // group_rows


@triton.jit
def _matmul_kernel(A, B, C, counters, Order, M, N, K,
                   stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                   ELEM: tl.constexpr, ELEM_C: tl.constexpr, PRECISION: tl.constexpr, COUNT_TRAFFIC: tl.constexpr,
                   RECORD_ORDER: tl.constexpr):
    pid = tl.program_id(0)
    tile_m, tile_n = _tile_coords(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    if RECORD_ORDER:  # which program computed which tile, for the picture and to check `program_order`
        tl.store(Order + tile_m * tl.cdiv(N, BLOCK_N) + tile_n, pid)
    rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        a_ok = (rows[:, None] < M) & (ks[None, :] < K)
        b_ok = (ks[:, None] < K) & (cols[None, :] < N)
        a = tl.load(A + rows[:, None] * stride_am + ks[None, :] * stride_ak, mask=a_ok, other=0.0)
        b = tl.load(B + ks[:, None] * stride_bk + cols[None, :] * stride_bn, mask=b_ok, other=0.0)
        _count(counters, A_, a_ok, ELEM, COUNT_TRAFFIC)
        _count(counters, B_, b_ok, ELEM, COUNT_TRAFFIC)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    c_ok = (rows[:, None] < M) & (cols[None, :] < N)
    tl.store(C + rows[:, None] * stride_cm + cols[None, :] * stride_cn, acc.to(C.dtype.element_ty), mask=c_ok)
    _count(counters, C_, c_ok, ELEM_C, COUNT_TRAFFIC)


# --- host side ------------------------------------------------------------------------------------------
def check_tiles(block_m: int, block_n: int, block_k: int, group_m: int) -> None:
    """tl.dot needs power-of-two tiles of at least 16 on each side (the tensor-core granularity)."""
    for name, b in (("block_m", block_m), ("block_n", block_n), ("block_k", block_k)):
        if b < 16 or b & (b - 1):
            raise ValueError(f"{name} {b} is not a power of two >= 16")
    if group_m < 1:
        raise ValueError(f"group_m {group_m} must be >= 1")


def matmul(a, b, block_m=32, block_n=32, block_k=32, group_m=4, counters=None, num_warps=4, num_stages=3, order=None):
    """C = a @ b for 2-D a (M, K) and b (K, N), any strides; C in a's dtype. counters: int64[3] or None.
    order: int32[tiles_m · tiles_n] or None, filled with the program id that computed each tile (row-major).
    num_warps, num_stages: launch settings on a GPU (warps per program, K steps in flight)."""
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"a (M, K) and b (K, N) must share K; got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.dtype != b.dtype:
        raise ValueError(f"a and b must share a dtype; got {a.dtype} and {b.dtype}")
    if not a.is_cuda and a.dtype not in (torch.float16, torch.float32):
        raise ValueError(f"{a.dtype} in Triton's interpreter gives wrong numbers (allowed there: float16, float32)")
    check_tiles(block_m, block_n, block_k, group_m)
    (M, K), N = a.shape, b.shape[1]
    c = torch.empty(M, N, device=a.device, dtype=a.dtype)
    cnt = counters if counters is not None else torch.zeros(len(TENSORS), dtype=torch.int64, device=a.device)
    grid = (triton.cdiv(M, block_m) * triton.cdiv(N, block_n),)
    _matmul_kernel[grid](a, b, c, cnt, order if order is not None else cnt, M, N, K, a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1),
                         BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m,
                         ELEM=a.element_size(), ELEM_C=c.element_size(),
                         PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
                         COUNT_TRAFFIC=counters is not None, RECORD_ORDER=order is not None,
                         num_warps=num_warps, num_stages=num_stages)
    return c


def closed_form_traffic(M, N, K, elem, block_m, block_n, elem_c=None) -> dict[str, int]:
    """Bytes each tensor moves under this tiling, from the tile geometry alone (masked tails excluded)."""
    tiles_m, tiles_n = -(-M // block_m), -(-N // block_n)
    return {"A": M * K * tiles_n * elem, "B": K * N * tiles_m * elem, "C": M * N * (elem_c or elem)}


def program_order(M, N, block_m, block_n, group_m) -> list[tuple[int, int]]:
    """The (tile row, tile column) each program id computes, as `_tile_coords` numbers them (checked against the
    order the kernel records), for grids too large to run here."""
    tiles_m, tiles_n = -(-M // block_m), -(-N // block_n)
    per_group = group_m * tiles_n
    order = []
    for pid in range(tiles_m * tiles_n):
        first_m = (pid // per_group) * group_m
        group_rows = min(tiles_m - first_m, group_m)
        order.append((first_m + (pid % per_group) % group_rows, (pid % per_group) // group_rows))
    return order


# --- reference -------------------------------------------------------------------------------------------
def reference_matmul(a, b):
    """torch.matmul in fp32: the answer the kernel's fp32 accumulation should reach."""
    return torch.matmul(a.float(), b.float())
