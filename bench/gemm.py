"""Benchmark: the tiled Triton GEMM (kernels/matmul.py) against torch.matmul (cuBLAS on a GPU).

On a GPU: TFLOP/s for square M = N = K from 1024 to 8192 in fp16 and bf16, the best of a few tile
configurations (BLOCK_M x BLOCK_N x BLOCK_K, GROUP_M, warps, stages) against torch.matmul, each output
checked against torch.matmul first. Target (issue 17): >= 0.8x cuBLAS at 4096³ fp16.
On a CPU there is no GPU to time: it records the kernel's counted bytes and intensity per tile shape from
the `hardware.gemm` experiment (run in Triton's interpreter) and says that the GPU was not measured.
Writes bench/results/gemm.json with the device name.

    python bench/gemm.py
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import kernels  # noqa: E402,F401  (Triton's interpreter on a CPU)
import torch  # noqa: E402

from cuda_timing import timed  # noqa: E402  (bench/ is on the path when a script here runs)

from backend.device import describe  # noqa: E402

CONFIGS = [  # (block_m, block_n, block_k, group_m, num_warps, num_stages): Triton tutorial's fp16 choices
    (128, 256, 64, 8, 8, 3), (128, 128, 64, 8, 4, 4), (128, 128, 32, 8, 4, 4), (64, 128, 32, 8, 4, 4), (128, 64, 32, 8, 4, 4),
]


def gpu_rows() -> list[dict]:
    from kernels.matmul import matmul

    rows = []
    for dtype in (torch.float16, torch.bfloat16):
        for size in (1024, 2048, 4096, 8192):
            a, b = (torch.randn(size, size, device="cuda", dtype=dtype) for _ in range(2))
            ref = torch.matmul(a, b)
            flops = 2 * size ** 3
            best = None
            for cfg in CONFIGS:
                c = matmul(a, b, *cfg[:4], num_warps=cfg[4], num_stages=cfg[5])
                err = (c.float() - ref.float()).abs().max().item()
                t = timed(lambda: matmul(a, b, *cfg[:4], num_warps=cfg[4], num_stages=cfg[5]), repeats=20)
                if best is None or t < best[0]:
                    best = (t, cfg, err)
            t_torch = timed(lambda: torch.matmul(a, b), repeats=20)
            row = {"dtype": str(dtype).split(".")[1], "size": size, "triton_TFLOPs": flops / best[0] / 1e12,
                   "torch_TFLOPs": flops / t_torch / 1e12, "ratio": t_torch / best[0],
                   "best_config": dict(zip(("block_m", "block_n", "block_k", "group_m", "num_warps", "num_stages"), best[1])),
                   "max_abs_diff_vs_torch": best[2]}
            rows.append(row)
            print(row, flush=True)
    return rows


def cpu_rows() -> list[dict]:
    from backend import experiments

    result = experiments.run("hardware.gemm")
    assert result.passed, [c.name for c in result.checks if not c.passed]
    return result.tables["sweep"]


def main() -> None:
    gpu = torch.cuda.is_available()
    out = {"benchmark": "gemm", "device": describe(), "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "gpu_measured": gpu,
           "note": "TFLOP/s of the Triton GEMM vs torch.matmul (cuBLAS)" if gpu else
                   "GPU not measured (no GPU here): bytes counted by the kernel in Triton's interpreter and the intensity "
                   "2·M·N·K / bytes per tile shape; no timings",
           "rows": gpu_rows() if gpu else cpu_rows()}
    if gpu:
        at_4096 = [r["ratio"] for r in out["rows"] if r["size"] == 4096 and r["dtype"] == "float16"]
        out["target_4096_fp16_ratio_at_least_0.8"] = bool(at_4096 and at_4096[0] >= 0.8)
    path = Path(__file__).parent / "results" / "gemm.json"
    path.write_text(json.dumps(out, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
