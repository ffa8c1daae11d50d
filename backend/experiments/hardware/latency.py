"""hardware.latency: this machine's memory hierarchy measured, and seed 002's latency-hiding arithmetic.

Measured: load latency per working-set size by a pointer chase (L1, L2, L3 and DRAM show as steps at
the cache sizes the kernel reports), read bandwidth per size, and from the two, by Little's law, the
bytes that must be in flight at each level to use its bandwidth (a dependent chase has one line in flight).
Model (labelled): the same law for the GPU presets at an assumed device-memory latency, and the threads
that covers, beside the threads the chip can hold. Checks: seed 002's 89 ns x 131 GB/s = 11,659 bytes,
16 bytes = 0.14% of it, 729 threads (the Xeon 8280), and 80 operations per datum; every chase ended
on the line its cycle predicts and every read pass summed right (the probes did the work they time).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from backend.config import Config, setting
from backend.limits import cost
from backend.experiments import define
from backend.hardware.latency import LINE, cache_levels, chase_latency, littles_law, read_bandwidth
from backend.hardware.devices import DEVICES, dram
from backend.result import Check, Result, Schema

# seed 002: a CPU at 89 ns and 131 GB/s; ax + b moves 16 bytes (x and y in fp64); 2,000 GFLOP/s FP64 at 200 GB/s
SEED_LATENCY_S, SEED_BANDWIDTH, SEED_REQUEST = 89e-9, 131e9, 16
SEED_FLOPS, SEED_CPU_BANDWIDTH = 2000e9, 200e9


@dataclasses.dataclass
class LatencyConfig(Config):
    max_mib: int = setting(256, choices=(16, 64, 256), help="largest working set probed (MiB); DRAM shows past the last cache")
    spacing: int = setting(4, choices=(2, 4), help="factor between probed working-set sizes (from 4 KiB)")
    steps: int = setting(50_000, min=10_000, max=5_000_000, help="dependent loads per latency measurement (at least one lap of the working set)")
    gpu_latency_ns: float = setting(500.0, min=50.0, max=5_000.0,
                                    help="assumed device-memory load latency for the GPU presets (a model input)")
    request_bytes: int = setting(16, min=1, max=256, help="bytes one thread's request moves (seed: x and y of ax+b, fp64)")
    seed: int = setting(0, min=0, max=2**31 - 1, help="the random chase order")

    cost_drivers = ("steps", "max_mib", "spacing")

    def estimate(self):
        """Per working-set size: a chase buffer of that size with its random order, chased for max(steps, lines) loads
        (five times after a warming lap if the cycle is no longer than steps, else twice), each load a cache miss at
        worst (150 ns on the loaded box, DRAM ~100 ns); then read over and over, at least 32 MiB six times."""
        largest, sizes, size = self.max_mib << 20, [], 4096
        while size <= largest:
            sizes.append(size)
            size *= self.spacing
        loads = 0
        for nbytes in sizes:
            lines, steps = max(2, nbytes // 64), max(self.steps, nbytes // 64)
            loads += lines + 5 * steps if lines <= self.steps else 2 * steps
        reads = sum(6 * max(32 << 20, nbytes) for nbytes in sizes)
        # plain streaming reads at BYTES_PER_S; a chased load ~120 ns of CPU (both measured)
        return cost(data_bytes=3 * largest, moved_bytes=reads + 3 * sum(sizes), ops=len(sizes) * 50 + 2000, seconds=loads * 120e-9)


def run(config: LatencyConfig, ctx) -> Result:
    rng = np.random.default_rng(config.seed)
    sizes, size = [], 4096
    while size <= config.max_mib << 20:
        sizes.append(size)
        size *= config.spacing
    probes = []
    for i, nbytes in enumerate(sizes):
        ctx.progress(0.05 + 0.85 * i / len(sizes), f"probing {nbytes / 1024:,.0f} KiB")
        lat, bw = chase_latency(nbytes, config.steps, rng), read_bandwidth(nbytes)
        probes.append({"bytes": nbytes, "ns_per_load": lat["ns_per_load"], "read_GBps": bw["bytes_per_s"] / 1e9,
                       "chase_ok": lat["ended_where_predicted"], "sum_ok": bw["sum_correct"]})
    caches = cache_levels()
    for p in probes:  # the smallest level the working set fits in
        p["fits_in"] = next((c["level"] for c in caches if p["bytes"] <= c["bytes"]), "DRAM")

    # per level: the largest probe that fits in half of it (and not in the level below), Little's law on it
    levels, below = [], 0
    for c in caches + [{"level": "DRAM", "bytes": float("inf")}]:
        inside = [p for p in probes if below < p["bytes"] <= c["bytes"] / 2 or (c["level"] == "DRAM" and p["bytes"] > below)]
        below = c["bytes"]
        if not inside:
            continue
        p = inside[-1]
        law = littles_law(p["ns_per_load"] * 1e-9, p["read_GBps"] * 1e9, LINE)
        levels.append({"level": c["level"], "capacity_bytes": None if c["level"] == "DRAM" else c["bytes"],
                       "probe_bytes": p["bytes"], "latency_ns": p["ns_per_load"], "read_GBps": p["read_GBps"],
                       "bytes_in_flight": law["bytes_in_flight"], "lines_in_flight_needed": law["requests_in_flight_needed"],
                       "one_chase_uses": law["one_request_fraction"]})

    seed = littles_law(SEED_LATENCY_S, SEED_BANDWIDTH, SEED_REQUEST)
    seed_ops = SEED_FLOPS / (SEED_CPU_BANDWIDTH / 8)
    gpus = []
    for name, spec in DEVICES.items():
        mem, _, bw = dram(name)
        law = littles_law(config.gpu_latency_ns * 1e-9, bw, config.request_bytes)
        resident = spec["sms"] * spec["max_warps_per_sm"] * 32
        gpus.append({"device": name, "memory": mem, "bandwidth_GBps": bw / 1e9, "assumed_latency_ns": config.gpu_latency_ns,
                     "bytes_in_flight": law["bytes_in_flight"], "threads_needed": law["requests_in_flight_needed"],
                     "threads_resident_max": resident, "needed_over_resident": law["requests_in_flight_needed"] / resident})

    l1 = probes[0]["ns_per_load"]
    checks = [
        Check("seed 002: 89 ns x 131 GB/s = 11,659 bytes in flight", abs(round(seed["bytes_in_flight"]) - 11_659), 0,
              reference="seed 002", detail=f"{seed['bytes_in_flight']:.1f} bytes"),
        Check("seed 002: one 16-byte request is 0.14% of them", abs(round(100 * seed["one_request_fraction"], 2) - 0.14), 0,
              reference="seed 002", detail=f"{100 * seed['one_request_fraction']:.4f}%"),
        Check("seed 002: 729 requests in flight cover the latency (the Xeon 8280's threads)",
              abs(round(seed["requests_in_flight_needed"]) - 729), 0, reference="seed 002",
              detail=f"{seed['requests_in_flight_needed']:.1f}"),
        Check("seed 002: 2,000 GFLOP/s FP64 at 200 GB/s needs 80 operations per datum", abs(seed_ops - 80), 1e-9, reference="seed 002"),
        Check("every chase ended on the line its cycle predicts (the loads were done, in order)",
              sum(not p["chase_ok"] for p in probes), 0, reference="the cycle's order, in numpy"),
        Check("every read pass summed to n(n-1)/2 per pass (every word was read)", sum(not p["sum_ok"] for p in probes), 0,
              reference="closed form"),
        Check("the hierarchy is visible: the largest working set's load is at least 3x slower than L1's",
              max(0.0, 3 - probes[-1]["ns_per_load"] / l1), 0.0, reference="the L1-sized probe",
              detail=f"{l1:.2f} ns -> {probes[-1]['ns_per_load']:.1f} ns"),
    ]
    return Result(
        metrics={"l1_latency_ns": l1, "largest_latency_ns": probes[-1]["ns_per_load"],
                 "peak_read_GBps": max(p["read_GBps"] for p in probes), "largest_read_GBps": probes[-1]["read_GBps"],
                 "seed_bytes_in_flight": seed["bytes_in_flight"], "seed_one_request_percent": 100 * seed["one_request_fraction"],
                 "seed_requests_needed": seed["requests_in_flight_needed"], "seed_ops_per_datum": seed_ops},
        tables={"probes": probes, "levels": levels, "caches": caches, "gpu_littles_law": gpus},
        checks=checks,
        notes=["Latency and bandwidth are measured on this machine while it runs whatever else it runs: on a shared "
               "machine the larger sizes read slower than on an idle one. The GPU rows are a model at the assumed latency."])


RESULT = Schema(
    metrics=(
        "l1_latency_ns", "largest_latency_ns", "peak_read_GBps", "largest_read_GBps", "seed_bytes_in_flight",
        "seed_one_request_percent", "seed_requests_needed", "seed_ops_per_datum",
    ),
    tables={
        "probes": ("bytes", "chase_ok", "fits_in", "ns_per_load", "read_GBps", "sum_ok"),
        "levels": ("bytes_in_flight", "capacity_bytes", "latency_ns", "level", "lines_in_flight_needed",
                   "one_chase_uses", "probe_bytes", "read_GBps"),
        "caches": ("bytes", "level", "shared_by"),
        "gpu_littles_law": ("assumed_latency_ns", "bandwidth_GBps", "bytes_in_flight", "device", "memory",
                            "needed_over_resident", "threads_needed", "threads_resident_max"),
    },
)

EXPERIMENT = define(__name__, LatencyConfig,
                    "this CPU's load latency and read bandwidth per working-set size; Little's law here, in seed 002, and on GPU presets",
                    run_fn=run, schema=RESULT)
