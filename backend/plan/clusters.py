"""GPU presets for planning: peak dense tensor FLOP/s, HBM, NVLink and the network, each with its source.

Where backend/hardware/devices.py has the chip (A100 80 GB, H100 SXM, H200) its figures are read from there, not
copied. Conventions as there: dense FLOP/s (no 2:4 sparsity), link bandwidths per direction. HBM capacity is the
datasheet's GB read as GiB (an 80 GB card shows 80 GiB: 81,920 MiB on an A100 80GB), the allocator's view.
The network is the bandwidth per GPU off the node (one NIC per GPU, rail-optimised), per direction.
"""
from __future__ import annotations

import dataclasses

from backend.hardware.devices import DEVICES, SOURCES

GiB = 2 ** 30
GB = 1e9


@dataclasses.dataclass(frozen=True)
class GPU:
    name: str
    bf16_flops: float
    fp8_flops: float | None      # None: no FP8 tensor cores
    hbm_bytes: float
    hbm_bw: float                # bytes/s
    nvlink_bw: float             # bytes/s per direction per GPU
    network_bw: float            # bytes/s per direction per GPU, the default inter-node link
    source: str
    sms: int = 0                 # streaming multiprocessors (the GEMM model's waves)
    l2_bw: float = 0.0           # bytes/s L2 → SMs (the GEMM model's tile roof); 0: unknown


# Chips backend/hardware/devices.py has: (its key, preset name, dense FP8 FLOP/s or None, network Gb/s per GPU, source of the rest)
FROM_DEVICES = [
    ("A100 (80 GB SXM)", "A100 80GB SXM", None, 200, "network HDR InfiniBand 200 Gb/s per GPU (DGX A100)"),
    ("H100 (SXM)", "H100 SXM 80GB", 1_979e12, 400, "FP8 1,979 TFLOP/s dense (datasheet); NDR InfiniBand 400 Gb/s per GPU"),
    ("H200 (SXM)", "H200 SXM", 1_979e12, 400, "FP8 1,979 TFLOP/s dense; NDR 400 Gb/s per GPU"),
]
# The others: (name, bf16 TFLOP/s, FP8 TFLOP/s or None, HBM GB, HBM GB/s, NVLink GB/s per direction, network Gb/s, source, SMs,
# L2 GB/s: the same die's figure in backend/hardware/devices.py, approximate; 0 where none is known)
DATASHEET = [
    ("A100 40GB SXM", 312, None, 40, 1_555, 300, 200,
     "NVIDIA A100 datasheet: 312 TFLOP/s bf16 dense, 40 GB HBM2 at 1,555 GB/s, NVLink 600 GB/s both directions; HDR 200 Gb/s per GPU; 108 SMs and L2 as the 80 GB (GA100)", 108, 4_000),
    ("H100 SXM 96GB", 989, 1_979, 96, 2_400, 450, 400,
     "H100 96 GB HBM2e at 2.4 TB/s, 500 W (torchtitan's Grand Teton hosts, docs/performance.md); GH100 peaks as the "
     "H100 SXM datasheet (132 SMs; torchtitan: its true peak lies between the SXM's and the NVL's, unknown); 400 Gb/s RDMA per GPU", 132, 12_000),
    ("H800 SXM", 989, 1_979, 80, 3_350, 200, 400,
     "H800 SXM: H100's compute and HBM3 with NVLink cut to 400 GB/s both directions (DeepSeek-V3 report, 3.3); "
     "InfiniBand 400 Gb/s per GPU; 132 SMs and L2 as H100 SXM (GH100)", 132, 12_000),
    ("B200", 2_250, 4_500, 180, 7_700, 900, 400,
     "NVIDIA DGX B200 datasheet: 72 PFLOP/s FP8 training for 8 GPUs (sparse) = 4.5 PFLOP/s dense FP8, 2.25 bf16 per GPU; "
     "180 GB HBM3e per GPU at 7.7 TB/s; NVLink 5 1.8 TB/s both directions; ConnectX-7 400 Gb/s per GPU; 148 SMs (two dies of 74); L2 bandwidth unpublished", 148, 0),
]


def _from_devices(key: str, name: str, fp8: float | None, network_gbps: float, extra: str) -> GPU:
    spec = DEVICES[key]
    nvlink = next(bw for level, (_, bw) in spec["levels"].items() if level.startswith("NVLink"))
    cap, bw = spec["levels"][spec["dram"]][0], spec["levels"][spec["dram"]][1]
    return GPU(name, spec["peak_flops"]["fp16/bf16 tensor"], fp8, round(cap / GB) * GiB, bw, nvlink, network_gbps / 8 * GB,
               f"{SOURCES[(key, 'peak_flops')]}; {extra}", spec["sms"], spec["levels"]["L2"][1])


def _from_datasheet(name, bf16, fp8, hbm_gb, hbm_gbps, nvlink_gbps, network_gbps, source, sms, l2_gbps) -> GPU:
    return GPU(name, bf16 * 1e12, fp8 * 1e12 if fp8 else None, hbm_gb * GiB, hbm_gbps * GB, nvlink_gbps * GB, network_gbps / 8 * GB, source,
               sms, l2_gbps * GB)


GPUS = {g.name: g for g in sorted([_from_devices(*row) for row in FROM_DEVICES] + [_from_datasheet(*row) for row in DATASHEET],
                                  key=lambda g: (g.bf16_flops, g.hbm_bytes, g.name))}


@dataclasses.dataclass(frozen=True)
class Cluster:
    gpu: GPU
    nodes: int
    gpus_per_node: int = 8
    network_bw: float | None = None   # per GPU per direction; None: the GPU preset's

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def net(self) -> float:
        return self.network_bw or self.gpu.network_bw
