"""Benchmark (GPU only): TFLOP/s of the Triton FlashAttention-2 kernels, forward and backward, against torch
SDPA; batch 4, (32 heads, d 64) and (16 heads, d 128), N = 1k..16k, fp16 and bf16, causal and not.
FLOPs: 4·N²·d·heads·batch, halved for causal, ×2.5 for backward. Writes bench/results/flash_attention.json.
Targets on an H100: forward >= 1.1x SDPA at N >= 4k, backward >= 0.9x.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from cuda_timing import timed  # noqa: E402  (bench/ is on the path when a script here runs)


def main() -> None:
    if not torch.cuda.is_available():
        print("no GPU here: this benchmark measures the native kernels and writes nothing on a CPU")
        return
    import torch.nn.functional as F

    from kernels.flash_attention import flash_attention, sdpa_reference

    rows = []
    for heads, d in ((32, 64), (16, 128)):
        for n in (1024, 2048, 4096, 8192, 16384):
            for dtype in (torch.float16, torch.bfloat16):
                for causal in (False, True):
                    q, k, v = (torch.randn(4, heads, n, d, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
                    flops = 4 * n * n * d * heads * 4 * (0.5 if causal else 1)
                    row = {"heads": heads, "d": d, "N": n, "dtype": str(dtype).split(".")[1], "causal": causal}
                    out, ref = flash_attention(q, k, v, causal, 128, 64), sdpa_reference(q, k, v, causal)[0]
                    row["max_abs_err_vs_sdpa"] = (out - ref).abs().max().item()
                    for name, fn in (("triton", lambda: flash_attention(q, k, v, causal, 128, 64)),
                                     ("sdpa", lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal))):
                        row[f"{name}_fwd_TFLOPs"] = flops / timed(fn) / 1e12
                        out = fn()
                        grad = torch.randn_like(out)
                        row[f"{name}_bwd_TFLOPs"] = 2.5 * flops / timed(lambda: torch.autograd.grad(out, (q, k, v), grad, retain_graph=True)) / 1e12
                    row["fwd_ratio"] = row["triton_fwd_TFLOPs"] / row["sdpa_fwd_TFLOPs"]
                    row["bwd_ratio"] = row["triton_bwd_TFLOPs"] / row["sdpa_bwd_TFLOPs"]
                    rows.append(row)
                    print(row)
    out = {"benchmark": "flash_attention", "device": torch.cuda.get_device_name(0),
           "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "rows": rows}
    (Path(__file__).parent / "results" / "flash_attention.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
