"""This machine's memory hierarchy, measured: load latency and copy bandwidth per working-set size,
and Little's law (bytes in flight = latency x bandwidth), seed 002's latency-hiding argument.

Latency: a pointer chase. The buffer holds one index per 64-byte cache line, linked in one random
cycle (Sattolo's algorithm), so every load's address depends on the one before and the prefetcher
cannot guess it: time per step = the latency of the level the working set fits in. A Python loop costs
tens of nanoseconds per step, more than an L1 or L2 hit, so the chase is eight lines of C compiled once
with the system's C compiler (the one Triton uses) and called through ctypes. Beyond a few MiB the
step also pays TLB misses with 4 KiB pages, as any program touching that much memory at random does.
Bandwidth: the same compiled code reads the working set over and over (independent loads, which the
core overlaps), best of a few runs; numpy's own per-call overhead would hide the small sizes.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np

LINE = 64  # bytes per cache line: one chase step per line

_CHASE_C = r"""
#include <stdint.h>
#include <time.h>
/* Follow next[] for `steps` dependent loads; return seconds, and where the chain ended in *end. */
double chase(const int64_t *next, int64_t start, int64_t steps, int64_t *end) {
    struct timespec t0, t1;
    int64_t i = start;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (int64_t s = 0; s < steps; s++) i = next[i];
    clock_gettime(CLOCK_MONOTONIC, &t1);
    *end = i;
    return (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
}
/* Read all n words `passes` times (independent loads the core can overlap); return seconds, the sum in *sum. */
double read_passes(const int64_t *buf, int64_t n, int64_t passes, int64_t *sum) {
    struct timespec t0, t1;
    int64_t s = 0;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (int64_t p = 0; p < passes; p++)
        for (int64_t j = 0; j < n; j++) s += buf[j];
    clock_gettime(CLOCK_MONOTONIC, &t1);
    *sum = s;
    return (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
}
"""


@functools.cache
def _probes() -> ctypes.CDLL:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not compiler:
        raise RuntimeError("the latency probe needs a C compiler (cc, gcc or clang) on PATH: a Python loop is slower than a cache hit")
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "llm-systems-explorer"
    cache.mkdir(parents=True, exist_ok=True)
    lib = cache / f"chase-{hashlib.sha256(_CHASE_C.encode()).hexdigest()[:12]}.so"
    if not lib.exists():
        with tempfile.TemporaryDirectory() as tmp:
            src, out = Path(tmp) / "chase.c", Path(tmp) / "chase.so"
            src.write_text(_CHASE_C)
            subprocess.run([compiler, "-O3", "-shared", "-fPIC", "-o", str(out), str(src)], check=True, capture_output=True)
            shutil.move(str(out), lib)
    probes = ctypes.CDLL(str(lib))
    for fn in (probes.chase, probes.read_passes):
        fn.restype = ctypes.c_double
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.POINTER(ctypes.c_int64)]
    return probes


def random_cycle(nbytes: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """A buffer of nbytes whose lines form one random cycle: next[line·8] = (following line)·8.
    Returns the buffer and the cycle's order of lines (to check where a chase must end)."""
    lines = max(2, nbytes // LINE)
    order = rng.permutation(lines)
    buf = np.zeros(lines * LINE // 8, dtype=np.int64)
    buf[order * 8] = np.roll(order, -1) * 8
    return buf, order


def chase_latency(nbytes: int, steps: int, rng: np.random.Generator, repeats: int = 5) -> dict:
    """Nanoseconds per dependent load in a working set of nbytes, and whether the chase ended on the line the
    cycle predicts (it did follow the chain). Every measurement walks the whole cycle at least once, so the
    working set really is nbytes. A set that fits in the caches is warmed first and timed `repeats` times (the
    best is the least disturbed by other work on the machine); a larger one is timed twice from cold."""
    buf, order = random_cycle(nbytes, rng)
    lines = len(order)
    fits = lines <= steps
    steps = max(steps, lines)
    fn, end, start = _probes().chase, ctypes.c_int64(), int(order[0]) * 8
    if fits:
        fn(buf.ctypes.data, start, lines, ctypes.byref(end))  # warm the caches: one lap
    best = min(fn(buf.ctypes.data, start, steps, ctypes.byref(end)) for _ in range(repeats if fits else 2))
    return {"bytes": nbytes, "ns_per_load": best / steps * 1e9, "steps": steps,
            "ended_where_predicted": end.value == int(order[steps % lines]) * 8}


def read_bandwidth(nbytes: int, min_bytes_read: int = 32 << 20, repeats: int = 5) -> dict:
    """Bytes/s reading a working set of nbytes over and over (best of `repeats`); the sum checks every word was read."""
    buf = np.arange(max(1, nbytes // 8), dtype=np.int64)
    passes = max(1, min_bytes_read // buf.nbytes)
    fn, total = _probes().read_passes, ctypes.c_int64()
    fn(buf.ctypes.data, len(buf), 1, ctypes.byref(total))  # warm the caches
    best = min(fn(buf.ctypes.data, len(buf), passes, ctypes.byref(total)) for _ in range(repeats))
    expected = (passes * (len(buf) * (len(buf) - 1) // 2) + 2 ** 63) % 2 ** 64 - 2 ** 63  # int64 wrap-around
    return {"bytes": nbytes, "bytes_per_s": buf.nbytes * passes / best, "sum_correct": total.value == expected}


def cache_levels() -> list[dict]:
    """This CPU's data caches as the kernel reports them (sysfs): level, size in bytes, CPUs sharing it."""
    levels = []
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            kind = (index / "type").read_text().strip()
            size = (index / "size").read_text().strip()
            level = int((index / "level").read_text())
        except OSError:
            continue
        if kind == "Instruction":
            continue
        scale = {"K": 1024, "M": 1024 ** 2, "G": 1024 ** 3}.get(size[-1], 1)
        levels.append({"level": f"L{level}", "bytes": int(size.rstrip("KMG")) * scale,
                       "shared_by": (index / "shared_cpu_list").read_text().strip()})
    return levels


def littles_law(latency_s: float, bandwidth_Bps: float, bytes_per_request: float) -> dict:
    """Bytes that must be in flight to keep a link busy, and what one request of bytes_per_request is of it."""
    in_flight = latency_s * bandwidth_Bps
    return {"bytes_in_flight": in_flight, "one_request_fraction": bytes_per_request / in_flight,
            "requests_in_flight_needed": in_flight / bytes_per_request}
