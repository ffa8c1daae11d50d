"""Benchmark: what a sharded DCP checkpoint of the mesh run costs, for ZeRO-3 over dp 4, tp 2 x pp 2 and FSDP2 over
dp 4 (4 gloo ranks each): each rank's checkpoint bytes against its share of the model and the total against the
model's state, the save time (each sync save, blocking), the load time (the last checkpoint before the end loaded on
the same mesh: reshard_tp/pp equal to the run's, the slowest rank), and the step time after a save under dcp.save
against dcp.async_save beside the steps without one (each step of a run is a repeat: median and min-max). The load
average at the start and the machine are recorded: on a shared box the times scale with how busy it is. Writes
bench/results/checkpoint.json.

    python bench/checkpoint.py [--steps 11]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from backend import experiments  # noqa: E402
from backend.device import describe  # noqa: E402
from backend.checkpoint.mesh_checks import rest_bytes, step_intervals  # noqa: E402
from backend.checkpoint.mesh_state import reference_shapes  # noqa: E402

PLANS = {
    "zero3 dp 4": {"world_size": 4, "tp": 1, "pp": 1, "dp_strategy": "zero3", "microbatches": 1},
    "tp 2 x pp 2": {"world_size": 4, "tp": 2, "pp": 2, "schedule": "1f1b"},
    "fsdp2 dp 4": {"world_size": 4, "tp": 1, "pp": 1, "dp_strategy": "fsdp2", "microbatches": 1},
}


def spread(xs: list[float]) -> dict:
    """Median, min and max (seconds) of the repeats, and how many."""
    return {"median_s": float(np.median(xs)), "min_s": min(xs), "max_s": max(xs), "n": len(xs)} if xs else {"n": 0}


def measure(plan: dict, mode: str, steps: int) -> dict:
    """One mesh run saving every other step with `mode` (sync or async), continued from its last checkpoint before the
    end on the same mesh (what the load costs): bytes, save, load and step times from the run's own tables."""
    every = 2
    started = time.time()
    result = experiments.run("parallel.mesh", **plan, steps=steps, checkpoint_every=every, checkpoint_save=mode,
                             reshard_tp=plan["tp"], reshard_pp=plan["pp"])
    wall = time.time() - started
    timeline, m = result.tables["checkpoint_timeline"], result.metrics
    saving, plain = step_intervals(timeline, 0)
    config = experiments.get("parallel.mesh").make_config({k: str(v) for k, v in {**plan, "steps": steps}.items()})
    model = 3 * 8 * sum(int(np.prod(s)) for s in reference_shapes(config).values()) + rest_bytes(config)  # float64
    return {"mode": mode, "passed": result.passed, "failed": [c.name for c in result.checks if not c.passed],
            "run_wall_s": round(wall, 1), "checkpoint_tensor_bytes": m["checkpoint_tensor_bytes"],
            "model_state_bytes": model, "checkpoint_file_bytes": m["checkpoint_file_bytes"],
            "per_rank_bytes": result.tables["checkpoint_share_per_rank"],
            "save_blocking": spread([e["seconds"] for e in timeline if e["event"] == "save"]),
            "blocking_is": "the whole save" if mode == "sync" else "staging the copy (the write runs in a thread)",
            "load": {"seconds_slowest_rank": m["reshard_load_s"], "from": m["reshard_from"]},
            "step_after_save": spread(saving), "step_without_save": spread(plain)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=11)
    args = parser.parse_args()
    load, began = [round(x, 2) for x in os.getloadavg()], time.time()
    rows = []
    for name, plan in PLANS.items():
        for mode in ("sync", "async"):
            rows.append({"plan": name, "settings": plan, **measure(plan, mode, args.steps)})
            r = rows[-1]
            print(f"{name:12s} {mode:5s} passed={r['passed']} bytes={r['checkpoint_tensor_bytes']:,} "
                  f"save={r['save_blocking'].get('median_s', 0):.3f}s load={r['load']['seconds_slowest_rank']:.3f}s "
                  f"step with/without save={r['step_after_save'].get('median_s', 0):.3f}/"
                  f"{r['step_without_save'].get('median_s', 0):.3f}s wall={r['run_wall_s']}s", flush=True)
    out = {"benchmark": "checkpoint", "device": describe(), "code_version": experiments.code_version(),
           "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "load_average_1_5_15_min_at_start": load,
           "load_average_1_5_15_min_at_end": [round(x, 2) for x in os.getloadavg()], "cpu_count": os.cpu_count(),
           "steps": args.steps, "checkpoint_every": 2, "wall_s": round(time.time() - began, 1), "rows": rows,
           "all_passed": all(r["passed"] for r in rows),
           "note": "4 gloo ranks on CPU, d_model etc. at parallel.mesh's defaults, float64; a repeat is one step of a run "
                   "(steps after a save and steps without one); the load is the last checkpoint before the end loaded "
                   "on the same mesh by every rank (the slowest rank's time)"}
    (Path(__file__).parent / "results" / "checkpoint.json").write_text(json.dumps(out, indent=1))
    print("all passed:", out["all_passed"], "wall", out["wall_s"], "s")


if __name__ == "__main__":
    main()
