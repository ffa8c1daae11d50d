"""hardware.roofline: presets' rooflines beside this machine's, measured, with attention and GEMM points.

Measured here: this CPU's copy bandwidth and matmul FLOP/s (the CPU's roofline), and the achieved
FLOP/s of attention forward (naive and tiled) and GEMMs at their arithmetic intensities. Model: every
preset's roofline and where naive and flash attention of the chosen shape sit on it (intensity from
the IO model's bytes). Check: the seed's A100 ops-per-datum figures (L1 ≈ 8, PCIe ≈ 6,240) follow
from the preset by the seed's formula.
"""
from __future__ import annotations

import dataclasses
import time

import torch

from backend.attention.flash import io_model, tiled_attention
from backend.config import Config, setting
from backend.limits import cost
from backend.experiments import define
from backend.hardware.devices import APPROXIMATE, DEVICES, SOURCES, dram, hierarchy_traffic, ops_per_datum
from backend.hardware.roofline import (attainable, gemm_intensity, last_level_cache_bytes, probe_bandwidth, probe_matmul,
                                       roof_lines)
from backend.result import Check, Result, Schema
from kernels.flash_attention import naive_attention


# The intensities (FLOP/byte) each roof's line is tabled at: 0.1 to 1,000, 60 points evenly spaced on a log axis.
LINE_INTENSITIES = tuple(10 ** (-1 + 4 * i / 59) for i in range(60))


@dataclasses.dataclass
class RooflineConfig(Config):
    seq_len: int = setting(1024, min=64, max=8192, help="attention N for the intensity points")
    head_dim: int = setting(64, choices=(16, 32, 64, 128), help="attention d")
    block: int = setting(64, choices=(16, 32, 64, 128), help="flash tile rows (block_m = block_n)")
    gemm_sizes: tuple[int, ...] = setting([64, 256, 1024], item_range=(16, 2048), length=(1, 8),
                                           help="square GEMM sizes to measure")

    def sizes(self) -> list[int]:
        return list(self.gemm_sizes)

    cost_drivers = ("seq_len",)

    def estimate(self):
        """Each GEMM size is timed (3 repeats of 2n³ flops) and attention materialises N × N scores; these large fp32
        products run at ~2.5x FLOPS a CPU second (1.3 s of CPU at the defaults, ~6 s at N = 8192 measured); the
        bandwidth probes ~0.3 s."""
        n, sizes = self.seq_len, self.sizes()
        return cost(data_bytes=4 * n * n * 4 + sum(3 * s * s * 4 for s in sizes) + (512 << 20),
                    flops=(sum(3 * 2 * s ** 3 for s in sizes) + 3 * 4 * n * n * self.head_dim) / 2.5, seconds=0.3)


# Seed 003's printed figures for the RTX 4090: fp32 "82.58 TFLOPS" and "1.01TB/s" (each good to half a unit in its
# last printed digit); its roofline's ridge follows from them: 82.58 / 1.01 = 81.76 FLOP per byte.
SEED_003_4090 = {"peak_flops": (82.58e12, 0.005e12), "bandwidth": (1.01e12, 0.005e12)}


def ridge_point(roof: dict) -> float:
    """Where the roofline turns flat, found on the roofline itself (bisection on attainable(), not peak ÷ bandwidth):
    the smallest arithmetic intensity at which attainable FLOP/s reach the peak."""
    lo, hi = 1e-6, 1e9
    for _ in range(200):
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if attainable(roof["peak_flops"], roof["bandwidth"], mid) < roof["peak_flops"] else (lo, mid)
    return hi


def seed_4090_checks(roofs: list[dict]) -> tuple[list[Check], float]:
    """The 4090 fp32 roof this run draws against seed 003's printed peak and bandwidth, and its ridge point against
    the ridge of the seed's two figures."""
    roof = next(r for r in roofs if r["device"] == "RTX 4090" and r["precision"] == "fp32")
    (peak, peak_tol), (bw, bw_tol) = SEED_003_4090["peak_flops"], SEED_003_4090["bandwidth"]
    ridge, seed_ridge = ridge_point(roof), peak / bw
    # the seed's ridge is uncertain by its figures' rounding: relative errors add
    ridge_tol = peak_tol / peak + bw_tol / bw
    return [Check("seed 003: RTX 4090 fp32 peak 82.58 TFLOPS", abs(roof["peak_flops"] - peak) / 1e12, peak_tol / 1e12,
                  reference="seed 003's printed figure (TFLOP/s, to 2 decimals)", detail=f"roof drawn at {roof['peak_flops'] / 1e12:g} TFLOP/s"),
            Check("seed 003: RTX 4090 memory bandwidth 1.01 TB/s", abs(roof["bandwidth"] - bw) / 1e12, bw_tol / 1e12,
                  reference="seed 003's printed figure (TB/s, to 2 decimals)", detail=f"roof drawn at {roof['bandwidth'] / 1e12:g} TB/s"),
            Check("RTX 4090 ridge point: where the fp32 roof turns flat, 82.58 / 1.01 FLOP/B", abs(ridge - seed_ridge) / seed_ridge, ridge_tol,
                  reference="seed 003's two figures: 81.76 FLOP per byte", detail=f"{ridge:.2f} FLOP/B on the roofline drawn (relative error; "
                                                                                 "tolerance from the figures' rounding)")], ridge


def hierarchy_rows(io: dict, seq_len: int, block: int) -> list[dict]:
    """Every preset's levels with the bytes naive and flash attention of this shape move at each and the time at the
    level's bandwidth (the IO model: flash re-reads its tiles on chip at every one of (N / block)² steps), seed 002's
    FP64 ops per datum where the preset has an fp64 tensor peak, and each figure's source."""
    rows = []
    for device, spec in DEVICES.items():
        onchip = io["sram_bytes_per_step"] * (seq_len / block) ** 2
        opd = ops_per_datum(device) if "fp64 tensor" in spec["peak_flops"] else {}
        rows += [{"device": device, **row, "approximate": (device, row["level"]) in APPROXIMATE,
                  "ops_per_datum_fp64": opd.get(row["level"]), "source": SOURCES.get((device, f"level:{row['level']}"), "no source")}
                 for row in hierarchy_traffic(device, io["standard_bytes"], io["flash_bytes"], onchip)]
    return rows


def _time(fn, repeats=3) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def run(config: RooflineConfig, ctx) -> Result:
    torch.set_num_threads(1)
    ctx.progress(0.1, "probing memory bandwidth")
    bw = probe_bandwidth()
    ctx.progress(0.3, "probing matmul")
    peak = probe_matmul()
    n, d, elem = config.seq_len, config.head_dim, 4
    io = io_model(n, d, elem, config.block, config.block)
    flops_attn = 4 * n * n * d
    points = []
    for size in config.sizes():
        a, b = torch.randn(size, size), torch.randn(size, size)
        t = _time(lambda: a @ b)
        points.append({"kernel": f"GEMM {size}³ fp32", "intensity": gemm_intensity(size, size, size, 4), "flops_per_s": 2 * size ** 3 / t,
                       "working_set_bytes": 3 * size * size * 4, "source": "measured (this CPU)"})
    q, k, v = (torch.randn(1, n, d) for _ in range(3))
    ctx.progress(0.6, "attention points")
    t_naive = _time(lambda: naive_attention(q, k, v), repeats=2)
    t_tiled = _time(lambda: tiled_attention(q[0], k[0], v[0], block_m=max(config.block, 256), block_n=max(config.block, 256)), repeats=2)
    qkv_bytes = 4 * n * d * elem  # Q, K, V and the output
    points.append({"kernel": "attention naive", "intensity": flops_attn / io["standard_bytes"], "flops_per_s": flops_attn / t_naive,
                   "working_set_bytes": qkv_bytes + 2 * n * n * elem, "source": "measured (this CPU)"})  # + scores, probabilities
    points.append({"kernel": "attention tiled", "intensity": flops_attn / io["flash_bytes"], "flops_per_s": flops_attn / t_tiled,
                   "working_set_bytes": qkv_bytes, "source": "measured (this CPU)"})
    cache = last_level_cache_bytes()
    from_dram = [p for p in points if p["working_set_bytes"] > cache]
    roofs = [{"device": "this CPU (measured)", "precision": "fp32", "peak_flops": peak, "bandwidth": bw}]
    for name, spec in DEVICES.items():  # each GPU at its fp16 tensor-core peak and its fp32 peak, labelled
        roofs += [{"device": name, "precision": p, "peak_flops": spec["peak_flops"][p], "bandwidth": dram(name)[2]}
                  for p in ("fp16/bf16 tensor", "fp32")]
    model_points = []
    for roof in (r for r in roofs[1:] if r["precision"] == "fp16/bf16 tensor"):
        for kernel, bytes_ in (("attention naive", io["standard_bytes"] / 2), ("attention flash", io["flash_bytes"] / 2)):  # fp16
            ai = flops_attn / bytes_
            model_points.append({"device": roof["device"], "kernel": kernel, "intensity": ai,
                                 "attainable_flops_per_s": attainable(roof["peak_flops"], roof["bandwidth"], ai)})
    hierarchy = hierarchy_rows(io, n, config.block)
    seed = ops_per_datum("A100 (80 GB SXM)")
    rtx_checks, rtx_ridge = seed_4090_checks(roofs)
    checks = rtx_checks + [Check("seed 002: A100 L1 needs about 8 operations per datum", abs(seed["L1 / shared"] - 8) / 8, 0.05,
                    reference="seed 002's figure", detail=f"{seed['L1 / shared']:.2f} = 19.5 TFLOP/s ÷ (19,400 GB/s ÷ 8 B)"),
              Check("seed 002: A100 PCIe needs about 6,240 operations per datum", abs(seed["PCIe 4"] - 6240) / 6240, 0.05,
                    reference="seed 002's figure", detail=f"{seed['PCIe 4']:.0f}"),
              Check("measured points lie under this CPU's measured compute roof (×1.5 for probe noise)",
                    max(0.0, max(p["flops_per_s"] / peak for p in points) - 1.5), 0.0, reference="the matmul probe's peak"),
              Check("points whose data exceed the last-level cache lie under the DRAM roof (×1.5 for probe noise)",
                    max([0.0] + [p["flops_per_s"] / attainable(peak, bw, p["intensity"]) - 1.5 for p in from_dram]), 0.0,
                    reference="min(peak, copy bandwidth × intensity) from the probes",
                    detail=f"{len(from_dram)} of {len(points)} points; the others run from a cache of up to "
                           f"{cache / 2**20:.0f} MiB, faster than DRAM, so the DRAM roof does not bound them")]
    notes = [] if len(from_dram) == len(points) else [
        f"{len(points) - len(from_dram)} of the {len(points)} measured points keep their data in this CPU's caches "
        f"(up to {cache / 2**20:.0f} MiB), so they can sit above the DRAM roof, which bounds only data streamed from "
        "memory; the GPU presets' points are modelled with every byte from HBM."]
    return Result(
        metrics={"cpu_bandwidth_GBps": round(bw / 1e9, 2), "cpu_matmul_GFLOPs": round(peak / 1e9, 2),
                 "ridge_point_flops_per_byte": round(peak / bw, 2), "ridge_4090_fp32_flops_per_byte": round(rtx_ridge, 2),
                 **{f"io_model.{k}": v for k, v in io.items()}},
        tables={"roofs": roofs, "roof_lines": roof_lines(roofs, LINE_INTENSITIES), "points": points, "model_points": model_points,
                "ops_per_datum_a100": [{"level": k, "ops_per_datum": v} for k, v in seed.items()], "hierarchy": hierarchy},
        checks=checks, notes=notes)


def _v1_to_v2(result: dict) -> None:
    """Runs stored before every preset's hierarchy was tabled and the RTX 4090's fp32 ridge found on the roofline: an
    empty hierarchy and no ridge say they were not computed; a roof without its precision was the measured CPU's fp32
    or a GPU's fp16/bf16 tensor-core peak (the only roofs then)."""
    result["tables"].setdefault("hierarchy", [])
    result["metrics"].setdefault("ridge_4090_fp32_flops_per_byte", None)
    for roof in result["tables"]["roofs"]:
        roof.setdefault("precision", "fp32" if "measured" in roof["device"] else "fp16/bf16 tensor")


def _v2_to_v3(result: dict) -> None:
    """Runs stored before the roofs' lines were tabled (the page computed min(peak, bandwidth × intensity))."""
    result["tables"]["roof_lines"] = roof_lines(result["tables"]["roofs"], LINE_INTENSITIES)


RESULT = Schema(
    metrics=(
        "cpu_bandwidth_GBps", "cpu_matmul_GFLOPs", "ridge_point_flops_per_byte", "ridge_4090_fp32_flops_per_byte",
        "io_model.sram_bytes_per_step", "io_model.standard_bytes", "io_model.flash_bytes",
        "io_model.flash_theta_N2d2_over_M",
    ),
    tables={
        "roofs": ("bandwidth", "device", "peak_flops", "precision"),
        "roof_lines": ("attainable_flops_per_s", "bandwidth", "device", "intensity", "peak_flops", "precision"),
        "points": ("flops_per_s", "intensity", "kernel", "source", "working_set_bytes"),
        "model_points": ("attainable_flops_per_s", "device", "intensity", "kernel"),
        "ops_per_datum_a100": ("level", "ops_per_datum"),
        "hierarchy": ("approximate", "bandwidth_Bps", "capacity_bytes", "device", "flash_bytes", "flash_seconds",
                      "level", "naive_bytes", "naive_seconds", "ops_per_datum_fp64", "source"),  # empty before v2
    },
    version=3, upgrades={1: _v1_to_v2, 2: _v2_to_v3},
)

EXPERIMENT = define(__name__, RooflineConfig,
         "this CPU's roofline measured (bandwidth and matmul probes) beside GPU presets; attention and GEMM points",
         run_fn=run, schema=RESULT)
