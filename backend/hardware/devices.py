"""Device presets: published peak compute, bandwidth and capacity per memory level, and the SM figures
the execution model needs. These are specifications, not measurements; pages label them so, and every
figure carries its source and convention in SOURCES.

Conventions (one per kind of figure, so presets compare):
- peak FLOP/s are dense (no 2:4 sparsity); tensor figures accumulate in fp32.
- capacities of registers and L1/shared are chip totals: SMs x the per-SM figure (binary KiB per SM, as NVIDIA
  quotes them); L2 and device memory are decimal bytes, as the datasheets write "40 MB" or "24 GB".
- link bandwidths (NVLink, PCIe) are per direction; NVIDIA quotes NVLink as both directions added
  (A100 600 GB/s, H100/H200 900 GB/s), which is twice the figure here.

Seed 002 states the hierarchy of an A100 by how many operations per datum keep the units busy:
ops/datum = FP64 (tensor core, 19.5 TFLOP/s) FLOP/s ÷ (bandwidth ÷ 8 bytes) — L1 at 19,400 GB/s needs about 8,
PCIe about 6,240 (at the seed's 25 GB/s).
"""
from __future__ import annotations

import copy

GB = 1e9
KiB = 1024


def _with_memory(base: dict, dram: str, capacity: float, bandwidth: float) -> dict:
    """A device that is `base` but for its device memory: the same SMs, caches and links, another DRAM level in its place."""
    levels = {(dram if name == base["dram"] else name): ((capacity, bandwidth) if name == base["dram"] else level)
              for name, level in base["levels"].items()}
    return {**copy.deepcopy(base), "dram": dram, "levels": levels}


# levels: name -> (capacity in bytes, bandwidth in bytes/s); "dram" names the device-memory level.
_H100_SPEC = {
    "sms": 132, "max_warps_per_sm": 64, "registers_per_sm": 256 * KiB, "shared_per_sm": 228 * KiB,
    "peak_flops": {"fp16/bf16 tensor": 989e12, "fp32": 67e12, "fp64": 34e12, "fp64 tensor": 67e12},
    "dram": "HBM3",
    "levels": {"registers": (132 * 256 * KiB, None), "L1 / shared": (132 * 256 * KiB, 33_000 * GB), "L2": (50e6, 12_000 * GB),
               "HBM3": (80e9, 3_350 * GB), "NVLink 4": (None, 450 * GB), "PCIe 5": (None, 64 * GB)},
}

DEVICES = {
    "A100 (80 GB SXM)": {
        "sms": 108, "max_warps_per_sm": 64, "registers_per_sm": 256 * KiB, "shared_per_sm": 164 * KiB,
        "peak_flops": {"fp16/bf16 tensor": 312e12, "fp32": 19.5e12, "fp64": 9.7e12, "fp64 tensor": 19.5e12},
        "dram": "HBM2e",
        "levels": {"registers": (108 * 256 * KiB, None), "L1 / shared": (108 * 192 * KiB, 19_400 * GB), "L2": (40e6, 4_000 * GB),
                   "HBM2e": (80e9, 2_039 * GB), "NVLink 3": (None, 300 * GB), "PCIe 4": (None, 25 * GB)},
    },
    "H100 (SXM)": _H100_SPEC,
    "H200 (SXM)": _with_memory(_H100_SPEC, "HBM3e", 141e9, 4_800 * GB),  # the same GH100 chip, with HBM3e
    "RTX 4090": {
        "sms": 128, "max_warps_per_sm": 48, "registers_per_sm": 256 * KiB, "shared_per_sm": 100 * KiB,
        "peak_flops": {"fp16/bf16 tensor": 165.2e12, "fp32": 82.58e12},
        "dram": "GDDR6X",
        "levels": {"registers": (128 * 256 * KiB, None), "L1 / shared": (128 * 128 * KiB, None), "L2": (72e6, None),
                   "GDDR6X": (24e9, 1.008e12), "PCIe 4": (None, 32 * GB)},
    },
}

_A100 = "NVIDIA A100 Tensor Core GPU Architecture whitepaper (2020) and A100 80GB datasheet"
_H100 = "NVIDIA H100 Tensor Core GPU Architecture whitepaper (2022) and H100 SXM datasheet"
_H200 = "NVIDIA H200 datasheet (HBM3e 141 GB, 4.8 TB/s); SM figures as H100 (same GH100 chip)"
_ADA = "NVIDIA Ada GPU Architecture whitepaper (RTX 4090: 128 SMs, 72 MB L2, 24 GB GDDR6X at 1,008 GB/s)"
# (device, figure) -> source; convention. Figures are "peak_flops:<precision>", "level:<name>" or an SM key.
SOURCES = {
    ("A100 (80 GB SXM)", "peak_flops"): f"{_A100}; dense, fp32 accumulate",
    ("A100 (80 GB SXM)", "level:registers"): f"{_A100}: 108 SMs x 256 KB (65,536 32-bit registers)",
    ("A100 (80 GB SXM)", "level:L1 / shared"): f"{_A100}: 108 SMs x 192 KB combined L1/shared; 19,400 GB/s as seed 002 gives it",
    ("A100 (80 GB SXM)", "level:L2"): f"{_A100}: 40 MB; bandwidth approximate (microbenchmarks)",
    ("A100 (80 GB SXM)", "level:HBM2e"): f"{_A100}: 80 GB HBM2e at 2,039 GB/s",
    ("A100 (80 GB SXM)", "level:NVLink 3"): f"{_A100}: 600 GB/s both directions = 300 GB/s per direction",
    ("A100 (80 GB SXM)", "level:PCIe 4"): "seed 002's 25 GB/s (PCIe 4.0 x16 is 32 GB/s per direction nominal; ~25 GB/s achieved)",
    ("H100 (SXM)", "peak_flops"): f"{_H100}; dense, fp32 accumulate",
    ("H100 (SXM)", "level:registers"): f"{_H100}: 132 SMs x 256 KB",
    ("H100 (SXM)", "level:L1 / shared"): f"{_H100}: 132 SMs x 256 KB combined L1/shared; bandwidth approximate (microbenchmarks)",
    ("H100 (SXM)", "level:L2"): f"{_H100}: 50 MB; bandwidth approximate (microbenchmarks)",
    ("H100 (SXM)", "level:HBM3"): f"{_H100}: 80 GB HBM3 at 3.35 TB/s",
    ("H100 (SXM)", "level:NVLink 4"): f"{_H100}: 900 GB/s both directions = 450 GB/s per direction",
    ("H100 (SXM)", "level:PCIe 5"): f"{_H100}: PCIe 5.0 x16, 128 GB/s both directions = 64 GB/s per direction",
    ("H200 (SXM)", "peak_flops"): f"{_H200}; dense, fp32 accumulate",
    ("H200 (SXM)", "level:registers"): f"{_H200}: 132 SMs x 256 KB",
    ("H200 (SXM)", "level:L1 / shared"): f"{_H200}: 132 SMs x 256 KB; bandwidth approximate (microbenchmarks)",
    ("H200 (SXM)", "level:L2"): f"{_H200}: 50 MB; bandwidth approximate (microbenchmarks)",
    ("H200 (SXM)", "level:HBM3e"): f"{_H200}",
    ("H200 (SXM)", "level:NVLink 4"): f"{_H200}: 900 GB/s both directions = 450 GB/s per direction",
    ("H200 (SXM)", "level:PCIe 5"): f"{_H200}: 64 GB/s per direction",
    ("RTX 4090", "peak_flops"): f"{_ADA}: fp32 82.58 TFLOP/s (also seed 003's figure); fp16 tensor 165.2 TFLOP/s dense with "
                                 "fp32 accumulate (330.3 with fp16 accumulate)",
    ("RTX 4090", "level:registers"): f"{_ADA}: 128 SMs x 256 KB = 33.5 MB",
    ("RTX 4090", "level:L1 / shared"): f"{_ADA}: 128 SMs x 128 KB combined L1/shared",
    ("RTX 4090", "level:L2"): f"{_ADA}: 72 MB",
    ("RTX 4090", "level:GDDR6X"): f"{_ADA}: GDDR6X (not HBM); seed 003 rounds the bandwidth to 1.01 TB/s",
    ("RTX 4090", "level:PCIe 4"): "PCIe 4.0 x16: 32 GB/s per direction",
}
for _name, _spec in DEVICES.items():
    SOURCES[(_name, "sm")] = {"A100 (80 GB SXM)": _A100, "H100 (SXM)": _H100, "H200 (SXM)": _H200, "RTX 4090": _ADA}[_name] + \
        ": SMs, max resident warps per SM, register file and max shared memory per SM (per-SM figures)"

# Bandwidths that are microbenchmark values rather than vendor figures; the page marks them approximate.
APPROXIMATE = {("H100 (SXM)", "L1 / shared"), ("H100 (SXM)", "L2"), ("H200 (SXM)", "L1 / shared"), ("H200 (SXM)", "L2"),
               ("A100 (80 GB SXM)", "L2")}


def dram(device: str) -> tuple[str, float, float]:
    """(name, capacity, bandwidth) of a device's main memory level."""
    spec = DEVICES[device]
    return (spec["dram"], *spec["levels"][spec["dram"]])


def ops_per_datum(device: str, precision: str = "fp64 tensor", bytes_per_datum: int = 8) -> dict[str, float]:
    """Seed 002's measure: operations per datum needed to keep the units busy at each level's bandwidth."""
    spec = DEVICES[device]
    flops = spec["peak_flops"][precision]
    return {level: flops / (bw / bytes_per_datum) for level, (_, bw) in spec["levels"].items() if bw}


def hierarchy_traffic(device: str, standard_bytes: float, flash_bytes: float, flash_onchip_bytes: float) -> list[dict]:
    """Bytes naive and flash attention move at each level and the time that would take at the level's bandwidth.
    Device memory: the IO model's bytes. L1/shared: everything loaded from it passes once; flash also re-reads its
    tiles on chip (flash_onchip_bytes). Single-GPU attention moves nothing over NVLink or PCIe."""
    rows, spec = [], DEVICES[device]
    for level, (capacity, bw) in spec["levels"].items():
        if level in (spec["dram"], "L2"):
            naive, flash = standard_bytes, flash_bytes
        elif level.startswith("L1"):
            naive, flash = standard_bytes, flash_bytes + flash_onchip_bytes
        else:
            naive = flash = 0.0
        rows.append({"level": level, "capacity_bytes": capacity, "bandwidth_Bps": bw,
                     "naive_bytes": naive, "flash_bytes": flash,
                     "naive_seconds": naive / bw if bw else None, "flash_seconds": flash / bw if bw else None})
    return rows
