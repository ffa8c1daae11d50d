"""How a GPU executes a tiled GEMM: grid -> programs (thread blocks) -> warps -> threads, and tensor cores.

Seed 002: an SM runs warps of 32 threads in lockstep (SIMT); an A100 has 108 SMs with up to 64 warps
each; a tensor core does a 4x4x4 matrix multiply-add per cycle (64 FMAs) and CUDA exposes groups of
them to a warp as one 16x16x16 WMMA instruction. A GEMM is tiled at block, warp and thread level so
that a datum loaded once feeds many multiply-adds: the seed's example loads one row of A once and
five columns of B, giving 5 x 5 = 25 multiply-adds from 5 + 25 = 30 loads.

Everything here is arithmetic on the tiling and a device preset (a model of where the work goes);
the GEMM kernel's counters check its load counts (kernels/matmul.py).
"""
from __future__ import annotations

import math

from backend.hardware.devices import DEVICES

THREADS_PER_WARP = 32
TENSOR_CORE_SHAPE = (4, 4, 4)      # m, n, k of one tensor core's multiply-add per cycle (Volta)
WMMA_SHAPE = (16, 16, 16)          # the warp-level instruction CUDA exposes (wmma::mma_sync); tl.dot's granularity


def tile_reuse(tile_m: int, tile_n: int, k: int) -> dict:
    """Loads and multiply-adds of one tile_m x tile_n output tile over depth k: each A row and B column
    is loaded once for the tile, so loads = (tile_m + tile_n)·k while MACs = tile_m·tile_n·k."""
    loads, macs = (tile_m + tile_n) * k, tile_m * tile_n * k
    return {"tile": f"{tile_m}x{tile_n}", "k": k, "A_loads": tile_m * k, "B_loads": tile_n * k, "loads": loads,
            "macs": macs, "loads_per_mac": loads / macs, "macs_per_load": macs / loads}


def warp_grid(num_warps: int, block_m: int, block_n: int) -> tuple[int, int]:
    """How the program's warps split its output tile: the most square rows x cols with each warp's
    share at least one 16x16 WMMA tile (Triton picks a layout like this for tl.dot)."""
    best = None
    for wm in range(1, num_warps + 1):
        if num_warps % wm:
            continue
        wn = num_warps // wm
        fits = block_m // wm >= WMMA_SHAPE[0] and block_n // wn >= WMMA_SHAPE[1]
        score = (not fits, abs(math.log2((block_m / wm) / (block_n / wn))))
        if best is None or score < best[0]:
            best = (score, (wm, wn))
    return best[1]


def gemm_hierarchy(M: int, N: int, K: int, block_m: int, block_n: int, block_k: int, num_warps: int,
                   device: str, elem: int, stages: int = 2) -> dict:
    """The execution hierarchy of C = A @ B (M x K times K x N) under this tiling on `device`."""
    spec = DEVICES[device]
    tiles_m, tiles_n, k_steps = -(-M // block_m), -(-N // block_n), -(-K // block_k)
    programs = tiles_m * tiles_n
    threads = num_warps * THREADS_PER_WARP
    wm, wn = warp_grid(num_warps, block_m, block_n)
    wmma_per_step = (block_m // WMMA_SHAPE[0]) * (block_n // WMMA_SHAPE[1]) * (block_k // WMMA_SHAPE[2])
    shared = stages * (block_m * block_k + block_k * block_n) * elem  # A and B tiles staged per pipeline stage
    acc_regs = block_m * block_n // threads                             # fp32 accumulator registers per thread
    by_warps = spec["max_warps_per_sm"] // num_warps
    by_shared = spec["shared_per_sm"] // shared
    by_registers = spec["registers_per_sm"] // (4 * acc_regs * threads)  # a lower bound on registers used
    per_sm = max(0, min(by_warps, by_shared, by_registers))
    concurrent = per_sm * spec["sms"]
    return {
        "grid": (tiles_m, tiles_n), "programs": programs, "k_steps": k_steps,
        "warps_per_program": num_warps, "threads_per_warp": THREADS_PER_WARP, "threads_per_program": threads,
        "warp_grid": (wm, wn), "warp_tile": (block_m // wm, block_n // wn),
        "outputs_per_thread": block_m * block_n / threads,
        "macs_per_thread": block_m * block_n * k_steps * block_k / threads,
        "wmma_per_program": wmma_per_step * k_steps, "wmma_per_warp": wmma_per_step * k_steps / num_warps,
        "tensor_core_ops_per_wmma": math.prod(WMMA_SHAPE) // math.prod(TENSOR_CORE_SHAPE),
        "shared_bytes_per_program": shared, "accumulator_registers_per_thread": acc_regs,
        "programs_per_sm": per_sm, "limited_by": min(("warps", by_warps), ("shared memory", by_shared),
                                                    ("registers", by_registers), key=lambda t: t[1])[0],
        "concurrent_programs": concurrent, "waves": math.ceil(programs / concurrent) if concurrent else None,
        "sms": spec["sms"], "max_warps_per_sm": spec["max_warps_per_sm"],
        # masked tails: the tiles at the edges still run whole (a warp runs all 32 lanes, idle ones included)
        "useful_fraction": M * N * K / (tiles_m * block_m * tiles_n * block_n * k_steps * block_k),
    }


def wave_footprint(order: list[tuple[int, int]], wave: int, block_m: int, block_n: int, K: int, elem: int) -> list[dict]:
    """Bytes of A row bands and B column bands each wave of `wave` concurrent programs touches: what L2 must
    hold for the wave's loads to hit. Grouped program order (GROUP_M > 1) touches fewer bands per wave."""
    rows = []
    for start in range(0, len(order), wave):
        part = order[start:start + wave]
        a_bands, b_bands = {m for m, _ in part}, {n for _, n in part}
        rows.append({"wave": start // wave, "programs": len(part), "A_bands": len(a_bands), "B_bands": len(b_bands),
                     "bytes": (len(a_bands) * block_m + len(b_bands) * block_n) * K * elem})
    return rows
