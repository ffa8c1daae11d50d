"""Benchmark: our ring all-reduce (send/recv on gloo) against gloo's built-in all_reduce, 4 ranks,
1, 16 and 64 MiB per rank, both timed in the same run. Target: ratio >= 0.9 at 16 and 64 MiB.
Writes bench/results/collectives.json.

    python bench/collectives.py [--iters N] [--sizes-mib 1,16,64]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from backend import experiments  # noqa: E402
from backend.device import describe  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--sizes-mib", default="1,16,64")
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3, help="separate runs per size; the median ratio is the result")
    args = p.parse_args()
    rows = []
    for mib in (int(s) for s in args.sizes_mib.split(",")):
        numel = mib * (1 << 20) // 4
        repeats = []
        for _ in range(args.repeats):
            result = experiments.run("comm.collectives", op="all_reduce", algo="ring", world_size=args.world_size,
                                     numel=numel, iters=args.iters)
            assert result.passed, [c for c in result.checks if not c.passed]
            m = result.metrics
            repeats.append({"ring_busbw_GBps": m["busbw_GBps"], "builtin_busbw_GBps": m["builtin_busbw_GBps"],
                            "ratio": m["busbw_ratio_vs_builtin"], "ring_time_us": m["time_us"], "builtin_time_us": m["builtin_time_us"]})
        ratios = sorted(r["ratio"] for r in repeats)
        rows.append({"size_MiB": mib, "ratio": statistics.median(ratios), "ratios": ratios, "repeats": repeats})
        print(f"{mib:3d} MiB: ratio ring/builtin busbw, median {statistics.median(ratios):.3f} of {ratios}")
    out = {"benchmark": "collectives", "target": "ring busbw >= 0.9 x builtin at 16 and 64 MiB on 4 ranks",
           "device": describe(), "world_size": args.world_size, "iters": args.iters,
           "code_version": experiments.code_version(), "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "rows": rows, "target_met": all(r["ratio"] >= 0.9 for r in rows if r["size_MiB"] >= 16)}
    path = Path(__file__).parent / "results" / "collectives.json"
    path.write_text(json.dumps(out, indent=1))
    print(f"wrote {path}; target met: {out['target_met']}")


if __name__ == "__main__":
    main()
