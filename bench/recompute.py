"""Benchmark: recomputation's price on GPipe and 1F1B at p = 4, m = 8 (the pipeline page's defaults), a few seeds
each: a recomputation's CPU time against the same micro-batch's forward without it (the run's check: within 30 %),
the whole run's extra CPU time against F/(F+B) and the textbook +33 %, the extra FLOPs counted and the peak
activation bytes saved. Writes bench/results/recompute.json; the spread over seeds is what the 30 % tolerance
must cover on this machine.

    python bench/recompute.py [--seeds 3]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from backend import experiments  # noqa: E402
from backend.device import describe  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    rows = []
    for schedule in ("gpipe", "1f1b"):
        for seed in range(args.seeds):
            result = experiments.run("parallel.pipeline", schedule=schedule, recompute=True, seed=seed)
            mt = result.metrics
            rows.append({"schedule": schedule, "seed": seed, "passed": result.passed,
                         "recompute_to_forward_time": mt["recompute_to_forward_time"],
                         "time_overhead": mt["recompute_time_overhead"], "time_model": mt["recompute_time_model"],
                         "flops_overhead": mt["recompute_flops_overhead"],
                         "activation_peak_saved_bytes": mt["activation_peak_saved_bytes"]})
            print(rows[-1])
    ratios = [r["recompute_to_forward_time"] for r in rows]
    out = {"benchmark": "recompute", "device": describe(), "code_version": experiments.code_version(),
           "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "rows": rows,
           "ratio_range": [min(ratios), max(ratios)], "all_passed": all(r["passed"] for r in rows)}
    (Path(__file__).parent / "results" / "recompute.json").write_text(json.dumps(out, indent=1))
    print("recompute / forward:", out["ratio_range"], "all passed:", out["all_passed"])


if __name__ == "__main__":
    main()
