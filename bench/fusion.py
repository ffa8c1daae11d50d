"""Benchmark: the fused program's generated kernels against one kernel per op and against eager PyTorch, in
kernels launched, bytes the generated kernels touched (counted by the kernels) and time; and TorchInductor's
kernel counts on the same functions (its Triton kernels on a GPU, its C++ kernels on a CPU).
Writes bench/results/fusion.json.

On a CPU the generated kernels run in Triton's interpreter: their times measure the interpreter, not a GPU,
and are recorded only so the file has the same shape everywhere. Targets (from the issue): generated kernel
counts no higher than TorchInductor's Triton counts (LayerNorm+GELU forward 1, forward+backward 3; MLP
forward+backward 4), every group's touched bytes within 1.1x of its inputs and outputs once, and the error
against float64 PyTorch within 2x eager fp32's own.

    python bench/fusion.py [--rows 16 --width 32] [--repeats 5]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import kernels  # noqa: E402,F401  (Triton's interpreter on a CPU)
import torch  # noqa: E402

from backend import experiments  # noqa: E402
from backend.device import describe  # noqa: E402
from backend.graph import ir  # noqa: E402
from backend.graph.capture import capture, to_networkx  # noqa: E402
from backend.experiments.graph.fusion import FusionConfig, eager, lower  # noqa: E402
from backend.graph.models import model  # noqa: E402
from backend.graph.passes import unfused_plan  # noqa: E402
from backend.graph.runtime import FusedProgram  # noqa: E402

CASES = [("ln_gelu", False), ("ln_gelu", True), ("mlp", True), ("attention", True), ("block", True)]
TRITON_TARGET = {("ln_gelu", False): 1, ("ln_gelu", True): 3, ("mlp", True): 4}  # the TorchInductor counts


def timed(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-inductor", action="store_true")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = []
    for name, backward in CASES:
        # kernels, bytes, errors and Inductor's counts: the experiment's own measurement and checks
        result = experiments.run("graph.fusion", model=name, backward=backward, rows=args.rows, width=args.width,
                                 inductor=not args.no_inductor)
        m = result.metrics
        row = {"model": name, "backward": backward, "rows": args.rows, "width": args.width, "checks_passed": result.passed,
               **{k: m[k] for k in ("kernels_unfused", "kernels_fused", "generated_kernels_fused", "extern_kernels",
                                    "bytes_unfused", "bytes_fused", "requested_bytes_fused", "worst_group_unique_over_ideal",
                                    "error_fused_vs_fp64", "error_eager_fp32_vs_fp64")},
               **{k: m[k] for k in ("saved_bytes_naive", "saved_bytes_min_cut", "inductor_backend", "inductor_forward_kernels",
                                    "inductor_backward_kernels", "inductor_extern_calls") if k in m}}
        # time: the same programs, launched again and again
        fn, inputs = model(name, args.rows, args.width)
        captured = to_networkx(capture(fn, inputs, backward), backward)
        tangent = torch.randn(ir.get(captured, captured.graph["inputs"][-1]).shape).to(device) if backward else None
        g, plan, _, _ = lower(captured, FusionConfig(backward=backward))
        fused, unfused = FusedProgram(g, plan), FusedProgram(captured, unfused_plan(captured))
        inputs = [t.to(device) for t in inputs]
        feeds = inputs + ([tangent] if backward else [])
        row.update(seconds_eager=timed(lambda: eager(fn, inputs, tangent), args.repeats),
                   seconds_fused=timed(lambda: fused.run(feeds), args.repeats),
                   seconds_unfused=timed(lambda: unfused.run(feeds), args.repeats))
        if (name, backward) in TRITON_TARGET:
            row["target_triton_kernels"] = TRITON_TARGET[(name, backward)]
            row["meets_kernel_target"] = row["generated_kernels_fused"] <= TRITON_TARGET[(name, backward)]
        rows.append(row)
        print({k: v for k, v in row.items() if not k.startswith("seconds")})
    out = {"benchmark": "fusion", "device": describe(), "code_version": experiments.code_version(),
           "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "timing_note": "Triton interpreter on a CPU: fused/unfused seconds measure the interpreter" if device == "cpu" else "GPU",
           "rows": rows,
           "targets_met": all(r["checks_passed"] and r.get("meets_kernel_target", True)
                              and r["worst_group_unique_over_ideal"] <= 1.1 for r in rows)}
    path = Path(__file__).parent / "results" / "fusion.json"
    path.write_text(json.dumps(out, indent=1))
    print("targets met:", out["targets_met"], "->", path)


if __name__ == "__main__":
    main()
