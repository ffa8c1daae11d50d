"""Benchmark: step time and bytes sent per rank for every data-parallel strategy on the tiny LLaMA at 2 and 4 ranks,
and DDP with its all-reduces overlapped with backward against launched after it. Writes bench/results/data_parallel.json.

    python bench/data_parallel.py [--hidden 128] [--layers 4]
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


def step_ms(result) -> float:
    events = [e for e in result.trace_events if e["rank"] == 0]
    return (max(e["ts"] + e["dur"] for e in events) - min(e["ts"] for e in events)) / 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=128, help="the tiny LLaMA's d_model")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    base = dict(hidden=args.hidden, layers=args.layers, batch=32, steps=args.steps)
    cases = [("parallel.ddp", {"overlap": True}), ("parallel.ddp", {"overlap": False}), ("parallel.zero", {"stage": 1}),
             ("parallel.zero", {"stage": 2}), ("parallel.zero", {"stage": 3}), ("parallel.fsdp", {}),
             ("parallel.dp_ps", {"mode": "sync", "server": "rank0"})]
    rows = []
    for world in (2, 4):
        for name, extra in cases:
            result = experiments.run(name, world_size=world, **base, **extra)
            assert result.passed, [c for c in result.checks if not c.passed]
            volume = result.tables.get("volume", [])
            sent = volume[0].get("sent_bytes_per_step", volume[0].get("sent_bytes", 0) / args.steps) if volume else None
            rows.append({"strategy": result.metrics["strategy"], "extra": extra, "world_size": world,
                         "ms_per_step_rank0": step_ms(result) / args.steps, "bytes_sent_per_step_rank0": sent})
            print(rows[-1])
    # DDP under a simulated slow network (20 ms per bucket all-reduce), with a backward long enough to hide it behind.
    overlap_rows = []
    for overlap in (True, False):
        result = experiments.run("parallel.ddp", world_size=2, hidden=256, layers=4, batch=64, steps=3, bucket_kb=1024,
                                 overlap=overlap, comm_delay_ms=20)
        assert result.passed
        buckets = [e for e in result.trace_events if e["rank"] == 0 and ("bucket" in e["name"])
                   and e["lane"] in ("comm", "collective")]  # overlapped: the wait's "comm" event; else the ring's span
        overlap_rows.append({"overlap": overlap, "comm_delay_ms_per_bucket": 20, "buckets": len(buckets) // 3,
                             "ms_per_step_rank0": step_ms(result) / 3, "dp_ms_exposed_last_step_rank0":
                             next(r["dp_ms"] for r in result.tables["step_split"] if r["rank"] == 0)})
        print(overlap_rows[-1])
    out = {"benchmark": "data_parallel", "device": describe(), "code_version": experiments.code_version(),
           "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "settings": base, "rows": rows,
           "ddp_overlap_simulated_network": overlap_rows,
           "overlap_not_slower": overlap_rows[0]["ms_per_step_rank0"] <= overlap_rows[1]["ms_per_step_rank0"]}
    (Path(__file__).parent / "results" / "data_parallel.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
