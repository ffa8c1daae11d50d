"""Roofline: attainable FLOP/s = min(peak, bandwidth × arithmetic intensity); intensities of attention and
GEMMs; and two probes that measure this machine (a streaming copy and a matmul)."""
from __future__ import annotations

import time
from pathlib import Path

import torch


def attainable(peak_flops: float, bandwidth: float, intensity: float) -> float:
    return min(peak_flops, bandwidth * intensity)


def roof_lines(roofs: list[dict], intensities) -> list[dict]:
    """The roofline model's prediction drawn as lines: each roof (a row with peak_flops and bandwidth) at each
    intensity, its row's keys kept and attainable FLOP/s = min(peak, bandwidth × intensity) added."""
    return [{**r, "intensity": float(x), "attainable_flops_per_s": attainable(r["peak_flops"], r["bandwidth"], float(x))}
            for r in roofs for x in intensities]


def gemm_intensity(m: int, n: int, k: int, elem: int) -> float:
    return 2 * m * n * k / ((m * k + k * n + m * n) * elem)


def attention_intensity(n: int, d: int, elem: int, hbm_bytes: float, causal: bool = False) -> float:
    flops = 4 * n * n * d * (0.5 if causal else 1.0)
    return flops / hbm_bytes


def last_level_cache_bytes() -> int:
    """The largest CPU cache (Linux sysfs); 32 MiB where the machine does not say."""
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = f.read_text().strip().upper()
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        sizes.append(int(text.rstrip("KMG")) * scale)
    return max(sizes, default=32 << 20)


def probe_bandwidth(nbytes: int = 256 << 20, repeats: int = 5, clock=time.perf_counter) -> float:
    """Bytes/s of a large copy (read + write counted), best of `repeats`. `clock` = time.thread_time times a one-thread
    probe by its CPU time, leaving out the time other processes hold the core (as the timings it is compared with)."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        start = clock()
        dst.copy_(src)
        best = min(best, clock() - start)
    return 2 * nbytes / best


def probe_matmul(sizes=(256, 512, 1024), repeats=5, clock=time.perf_counter) -> float:
    """Peak FLOP/s of fp32 matmul on this machine: the best over a few sizes (the fastest may fit a cache), best of
    `repeats` each, so a busy moment does not set the roof below what the machine can do."""
    best = 0.0
    for n in sizes:
        a, b = torch.randn(n, n), torch.randn(n, n)
        for _ in range(repeats):
            start = clock()
            a @ b
            best = max(best, 2 * n ** 3 / (clock() - start))
    return best
