"""Benchmark: step time, bytes sent and memory per rank for tensor (and sequence), expert and context parallel
at 2 and 4 ranks (with DTensor's bytes beside ours for tensor parallel), and the mesh at 2, 4 (with and without
a context-parallel dimension), its presets (seed 002's 8 ranks, 3D on 8, MoE over ep) and pp x ep x tp on 8. Writes bench/results/model_parallel.json.

    python bench/model_parallel.py
    python bench/model_parallel.py --mesh-schedules   # every pipeline schedule on the mesh, and the presets
    python bench/model_parallel.py --presets          # each mesh preset by name (bench/results/mesh_presets.json)
    python bench/model_parallel.py --depth            # recompute's price, the step split, schedules side by side
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from backend import experiments  # noqa: E402
from backend.device import describe  # noqa: E402
from backend.experiments.parallel.mesh import PRESET_NOTES, PRESETS  # noqa: E402


def step_ms(name: str, result) -> dict:
    """Rank 0's measured time for one training step: its forward and backward spans (tp: each mode; ep), the
    traced ring (cp, whose trace starts at the ring), or the traced training divided by the steps (mesh)."""
    events = [e for e in result.trace_events if e["rank"] == 0]
    if name in ("parallel.tp", "parallel.ep"):
        timed = [e for e in events if e.get("args", {}).get("kind") in ("forward", "backward")]
        modes = {e["name"].rsplit(" ", 1)[0] for e in timed}
        return {mode: sum(e["dur"] for e in timed if e["name"] in (f"{mode} forward", f"{mode} backward")) / 1e3 for mode in sorted(modes)}
    span = (max(e["ts"] + e["dur"] for e in events) - min(e["ts"] for e in events)) / 1e3
    return {"step": span / result.metrics["steps"] if name == "parallel.mesh" else span}


def per_rank(name: str, result, world: int) -> list[dict]:
    """Bytes each rank sent and the activation bytes it saved, read from the experiment's own tables."""
    t = result.tables
    if name == "parallel.tp":
        rows = []
        for mode in ("TP", "TP + SP"):
            sent = sum(r["sent_bytes"] for r in t["collectives"] if r["mode"] == mode)  # rank 0's; ranks are symmetric
            rows += [{"mode": mode, "rank": m["rank"], "bytes_sent": sent, "activation_bytes": m["measured_bytes"]}
                     for m in t["memory"] if m["layout"].startswith(mode + ",")]
        return rows
    if name == "parallel.ep":
        return [{"rank": m["rank"], "bytes_sent_dispatch_forward": sum(r["bytes"] for r in t["all_to_all"] if r["from rank"] == m["rank"]
                                                                       and r["to rank"] != m["rank"]),
                 "activation_bytes": m["activation_bytes"]} for m in t["memory"]]
    if name == "parallel.cp":
        return [{"rank": w["rank"], "bytes_sent": sum(r["sent_bytes"] for r in t["ring"] if r["rank"] == w["rank"]),
                 "activation_bytes": w["activation_bytes"]} for w in t["work"]]
    return [{"rank": r["rank"], **{k: v for k, v in r.items() if k.endswith("bytes sent")},
             **{m["category"]: m["measured_bytes"] for m in t["memory"] if m["rank"] == r["rank"]}} for r in t["ranks"]]


def timed_run(name: str, settings: dict):
    """One run of an experiment in this process and its wall time in seconds (the ranks' start and the leader's
    one-process reference included)."""
    started = time.time()
    result = experiments.run(name, **settings)
    return result, round(time.time() - started, 2)


def write_results(benchmark: str, rows: list[dict], note: str) -> None:
    """bench/results/<benchmark>.json: the rows with the device, code version, time and load average they ran at."""
    out = {"benchmark": benchmark, "device": describe(), "code_version": experiments.code_version(),
           "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "rows": rows,
           "load_average_1_5_15_min_at_end": [round(x, 2) for x in os.getloadavg()], "note": note}
    (Path(__file__).parent / "results" / f"{benchmark}.json").write_text(json.dumps(out, indent=1))


def mesh_schedules() -> None:
    """Every synchronous schedule on the mesh at its defaults (pp 2 x tp 2; interleaved with 2 chunks, DualPipe-V
    with 4 micro-batches) and each preset under ZB-V and 1F1B: wall time of the whole run (reference included)
    and rank 0's traced step. Writes bench/results/mesh_schedules.json."""
    from backend.parallel.pp.schedules import SCHEDULES
    cases = [{"schedule": n, **({"virtual_stages": 2} if s.interleaved else {}), **({"microbatches": 4} if s.v_shape else {})}
             for n, s in SCHEDULES.items() if not s.asynchronous]
    cases += [dict(preset, schedule=n, **({"layers": max(preset.get("layers", 4), 2 * preset["pp"])} if n == "zb_v" else {}))
              for preset in PRESETS.values() for n in ("1f1b", "zb_v")]
    rows = []
    for settings in cases:
        result, wall_s = timed_run("parallel.mesh", settings)
        rows.append({"settings": settings, "passed": result.passed, "wall_s": wall_s, "rank0_step_ms": step_ms("parallel.mesh", result)})
        print(json.dumps(rows[-1]), flush=True)
    write_results("mesh_schedules", rows, "2-core CPU shared with other work (the load average says how much), ranks are "
                  "processes on gloo: wall_s includes the leader's one-process reference and the ranks' start.")


def presets() -> None:
    """Each mesh preset run by name (`preset=`), as a user picks it: wall time of the whole run (ranks' start and the
    leader's one-process reference included; the target is 30 s), rank 0's traced step, each rank's bytes by
    dimension and memory by category. Writes bench/results/mesh_presets.json."""
    rows = []
    for name in PRESETS:
        result, wall_s = timed_run("parallel.mesh", {"preset": name})
        rows.append({"preset": name, "note": PRESET_NOTES[name], "settings": PRESETS[name], "passed": result.passed,
                     "failed_checks": [c.name for c in result.checks if not c.passed], "wall_s": wall_s,
                     "rank0_step_ms": step_ms("parallel.mesh", result), "metrics": result.metrics,
                     "per_rank": per_rank("parallel.mesh", result, PRESETS[name]["world_size"])})
        print(json.dumps({k: rows[-1][k] for k in ("preset", "passed", "wall_s", "rank0_step_ms")}), flush=True)
    write_results("mesh_presets", rows, "2-core CPU shared with seven other engineers' work (the load average says how "
                  "much), ranks are processes on gloo: wall_s includes the ranks' start and the leader's one-process reference.")


def depth() -> None:
    """The mesh's depth options at their defaults on 4 ranks: the plan alone, with every schedule beside it
    (compare_schedules, target 30 s), with selective recompute, and full recompute (tp 1) under GPipe and ZB-V: wall
    time of the whole run, recompute's counted FLOPs and measured CPU overheads, and each rank's step split.
    Writes bench/results/mesh_depth.json."""
    cases = [{}, {"compare_schedules": True}, {"recompute": "selective"},
             {"recompute": "full", "tp": 1, "microbatches": 2}, {"recompute": "full", "tp": 1, "schedule": "zb_v", "layers": 4}]
    rows = []
    for settings in cases:
        result, wall_s = timed_run("parallel.mesh", settings)
        rows.append({"settings": settings, "passed": result.passed, "wall_s": wall_s,
                     "metrics": {k: v for k, v in result.metrics.items() if "recompute" in k or "bubble" in k or "step" in k
                                 or k in ("activation_peak_saved_bytes", "backward_to_forward_flops")},
                     "step_split_ms": [{k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}
                                       for r in result.tables["step_split"]]})
        print(json.dumps({k: rows[-1][k] for k in ("settings", "passed", "wall_s", "metrics")}), flush=True)
    write_results("mesh_depth", rows, "2-core CPU shared with seven other engineers' work (the load average says how "
                  "much): wall times and CPU overheads are contended; FLOPs are counted, not timed.")


def main() -> None:
    if "--depth" in sys.argv:
        return depth()
    if "--mesh-schedules" in sys.argv:
        return mesh_schedules()
    if "--presets" in sys.argv:
        return presets()
    cases = [(name, world, {}) for world in (2, 4) for name in ("parallel.tp", "parallel.ep", "parallel.cp")]
    cases += [("parallel.mesh", 2, {"tp": 2, "pp": 1}), ("parallel.mesh", 4, {"tp": 2, "pp": 2}), ("parallel.mesh", 4, {"tp": 1, "pp": 2}),
              ("parallel.mesh", 4, {"tp": 2, "pp": 1, "cp": 2}), ("parallel.mesh", 4, {"tp": 1, "pp": 2, "cp": 2})]
    cases += [("parallel.mesh", preset.get("world_size", 4), dict(preset)) for preset in PRESETS.values()]
    cases += [("parallel.mesh", 8, {"pp": 2, "tp": 2, "ep": 2, "experts": 4, "batch": 8, "d_model": 16})]  # four dimensions at once
    rows = []
    for name, world, extra in cases:
        settings = {"world_size": world, **extra}
        if name == "parallel.cp":
            settings["seq"] = 512
        result, wall_s = timed_run(name, settings)
        rows.append({"experiment": name, "settings": settings, "passed": result.passed, "wall_s": wall_s,
                     "rank0_step_ms": step_ms(name, result), "per_rank": per_rank(name, result, world)})
        if name == "parallel.tp":  # DTensor's bytes on the same layers, written to rank 0's sockets, beside ours
            rows[-1]["dtensor_vs_ours_bytes"] = [{k: r[k] for k in ("layer", "dtensor_bytes_written", "ours_bytes_written")}
                                                 for r in result.tables["dtensor"]]
        print(json.dumps(rows[-1])[:300], flush=True)
    write_results("model_parallel", rows, "2-core CPU (the load average says what else ran), so times are noisy; ranks are "
                  "processes on gloo. rank0_step_ms: rank 0's forward + backward spans (tp per mode, ep), its traced ring forward "
                  "+ backward (cp), its traced training / steps (mesh, whose steps include its pipeline schedule, the dp "
                  "all-reduce and Adam).")


if __name__ == "__main__":
    main()
