"""Benchmark: gloo built-in collectives, 2 and 4 ranks, 1 KiB..4 MiB. Writes bench/results/comm_bandwidth.json.

    python bench/comm_bandwidth.py [--max-bytes N] [--iters N]
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
    p = argparse.ArgumentParser()
    p.add_argument("--max-bytes", type=int, default=4 << 20)
    p.add_argument("--iters", type=int, default=10)
    args = p.parse_args()
    out = {"benchmark": "comm_bandwidth", "device": describe(), "code_version": experiments.code_version(),
           "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "runs": []}
    for world in (2, 4):
        result = experiments.run("comm.bandwidth", world_size=world, max_bytes=args.max_bytes, iters=args.iters)
        assert result.passed, [c for c in result.checks if not c.passed]
        out["runs"].append({"world_size": world, "metrics": result.metrics, "table": result.tables["bandwidth"]})
        print(f"world_size={world}: " + ", ".join(f"{k.split('.')[1]} {v:.3f}" for k, v in result.metrics.items()
                                                  if k.startswith("peak_busbw")) + " GB/s peak busbw")
    path = Path(__file__).parent / "results" / "comm_bandwidth.json"
    path.write_text(json.dumps(out, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
