"""Device presets: published peak compute and bandwidth per memory level (vendor datasheets; RTX 4090 as
seed 003 gives it). These are specifications, not measurements, and pages label them so.

Seed 002 states the hierarchy of an A100 by how many operations per datum keep the units busy:
ops/datum = FP64 (tensor core, 19.5 TFLOP/s) FLOP/s ÷ (bandwidth ÷ 8 bytes) — L1 at 19,400 GB/s needs about 8, PCIe about 6,240.
"""
from __future__ import annotations

GB = 1e9

# level: (capacity in bytes, bandwidth in bytes/s)
DEVICES = {
    "A100 (80 GB SXM)": {
        "peak_flops": {"fp16/bf16 tensor": 312e12, "fp32": 19.5e12, "fp64": 9.7e12, "fp64 tensor": 19.5e12},
        "levels": {"registers": (27e6, None), "L1 / shared": (20.7e6, 19_400 * GB), "L2": (40e6, 4_000 * GB),
                   "HBM": (80e9, 2_039 * GB), "NVLink": (None, 300 * GB), "PCIe 4": (None, 25 * GB)},
    },
    "H100 (SXM)": {
        "peak_flops": {"fp16/bf16 tensor": 989e12, "fp32": 67e12, "fp64": 34e12, "fp64 tensor": 67e12},
        "levels": {"registers": (33e6, None), "L1 / shared": (33e6, 33_000 * GB), "L2": (50e6, 12_000 * GB),
                   "HBM": (80e9, 3_350 * GB), "NVLink": (None, 900 * GB), "PCIe 5": (None, 64 * GB)},
    },
    "H200 (SXM)": {
        "peak_flops": {"fp16/bf16 tensor": 989e12, "fp32": 67e12, "fp64": 34e12, "fp64 tensor": 67e12},
        "levels": {"registers": (33e6, None), "L1 / shared": (33e6, 33_000 * GB), "L2": (50e6, 12_000 * GB),
                   "HBM": (141e9, 4_800 * GB), "NVLink": (None, 900 * GB), "PCIe 5": (None, 64 * GB)},
    },
    "RTX 4090 (seed 003)": {
        "peak_flops": {"fp16/bf16 tensor": 165e12, "fp32": 82.58e12},
        "levels": {"registers": (16.5e6, None), "L1 / shared": (16.5e6, None), "L2": (72e6, None),
                   "HBM": (24e9, 1.01e12), "PCIe 4": (None, 32 * GB)},
    },
}
# Bandwidths of the levels above come from vendor material where published; the L1 and L2 figures of the
# H100/H200 are commonly quoted microbenchmark values and are marked approximate on the page.
APPROXIMATE = {("H100 (SXM)", "L1 / shared"), ("H100 (SXM)", "L2"), ("H200 (SXM)", "L1 / shared"), ("H200 (SXM)", "L2"),
               ("A100 (80 GB SXM)", "L2")}


def ops_per_datum(device: str, precision: str = "fp64 tensor", bytes_per_datum: int = 8) -> dict[str, float]:
    """Seed 002's measure: operations per datum needed to keep the units busy at each level's bandwidth."""
    spec = DEVICES[device]
    flops = spec["peak_flops"][precision]
    return {level: flops / (bw / bytes_per_datum) for level, (_, bw) in spec["levels"].items() if bw}


def hierarchy_traffic(device: str, standard_bytes: float, flash_bytes: float, flash_onchip_bytes: float) -> list[dict]:
    """Bytes naive and flash attention move at each level and the time that would take at the level's bandwidth.
    HBM: the IO model's bytes. L1/shared: everything loaded from HBM passes it once; flash also re-reads its
    tiles on chip (flash_onchip_bytes). Single-GPU attention moves nothing over NVLink or PCIe."""
    rows = []
    for level, (capacity, bw) in DEVICES[device]["levels"].items():
        if level == "HBM":
            naive, flash = standard_bytes, flash_bytes
        elif level.startswith("L1"):
            naive, flash = standard_bytes, flash_bytes + flash_onchip_bytes
        elif level == "L2":
            naive, flash = standard_bytes, flash_bytes
        else:
            naive = flash = 0.0
        rows.append({"level": level, "capacity_bytes": capacity, "bandwidth_Bps": bw,
                     "naive_bytes": naive, "flash_bytes": flash,
                     "naive_seconds": naive / bw if bw else None, "flash_seconds": flash / bw if bw else None})
    return rows
