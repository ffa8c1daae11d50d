"""Benchmark: bubble against the model for every schedule at p = 4 and m = 4, 8, 16: on the wall clock (ranks
share this machine's cores) and replayed with one core per rank from each action's measured CPU time.
Writes bench/results/pipeline.json. Target: the replayed bubble within 5 percentage points for GPipe and 1F1B
at p=4, m=8.

    python bench/pipeline.py [--hidden 512]
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
from backend.parallel.pp.schedules import SCHEDULES  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--schedules", default=",".join(SCHEDULES),
                        help="comma-separated; rows of the others are kept from the last results file")
    args = parser.parse_args()
    chosen = args.schedules.split(",")
    path = Path(__file__).parent / "results" / "pipeline.json"
    last = json.loads(path.read_text()) if path.exists() else {"rows": []}
    kept = [dict(r, measured=r.get("measured", last.get("when")), code_version=r.get("code_version", last.get("code_version")))
            for r in last["rows"] if r["schedule"] not in chosen]  # each row says when and on which code it was run
    when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    rows = []
    for schedule in chosen:
        plan = SCHEDULES[schedule]
        for m in (4, 8, 16):
            if plan.whole_batch and m != 4 or m < (plan.min_microbatches_fn(4) if plan.min_microbatches_fn else 1):
                continue
            settings = dict(schedule=schedule, world_size=4, microbatches=m, hidden=args.hidden, batch=16 * m, layers=8)
            if SCHEDULES[schedule].interleaved:
                settings["virtual_stages"] = 2
            result = experiments.run("parallel.pipeline", **settings)
            assert result.passed, [c for c in result.checks if not c.passed]
            mt = result.metrics
            rows.append({"schedule": schedule, "p": 4, "m": m, "bubble_wall_clock": mt["bubble_measured"],
                         "bubble_replayed": mt["bubble_replayed"], "bubble_model": mt["bubble_model"],
                         "gap_pp": mt["bubble_gap_pp"], "stage_imbalance": mt["stage_imbalance"],
                         "mean_action_cpu_ms": mt["mean_action_cpu_ms"], "measured": when,
                         "code_version": experiments.code_version(),
                         **({"bubble_published_measured_costs": mt["bubble_published_measured_costs"]}
                            if "bubble_published_measured_costs" in mt else {})})
            print(rows[-1])
    rows = kept + rows
    target = [r for r in rows if SCHEDULES[r["schedule"]].torch_peer and r["m"] == 8]  # GPipe and 1F1B
    out = {"benchmark": "pipeline", "device": describe(), "code_version": experiments.code_version(), "hidden": args.hidden,
           "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "rows": rows,
           "target_within_5pp": all(abs(r["gap_pp"]) <= 5 for r in target)}
    path.write_text(json.dumps(out, indent=1))
    print("target met:", out["target_within_5pp"])


if __name__ == "__main__":
    main()
