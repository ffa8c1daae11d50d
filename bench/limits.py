"""Benchmark: every experiment at its largest accepted settings (and at its defaults), its measured peak memory and
run time beside Config.estimate(). The target: each estimate at least its measurement and at most 3x it, memory
against the peak and seconds against the run's CPU seconds; nothing accepted may pass the server's budget
(EXPLORER_RUN_MEMORY_GIB, EXPLORER_JOB_TIMEOUT_S). Writes bench/results/limits.json (limits_defaults.json).

"Largest accepted": every numeric setting at its maximum, then, while validate() refuses, the setting its
message names lowered to the largest value it says fits. Each run is `python -m backend run` (the job
leader, as the server starts it); memory is the resident anonymous memory of its whole process tree,
sampled every 50 ms, the same sum the leader enforces. Each row also has the run's CPU seconds (the leader and
its ranks, sampled with the memory, from the run's start: the leader's imports are left out, as a server's warm
leader has them done) and the load average when it started: wall time on a shared 2-core box depends on the
load, CPU time does not.

    nice python bench/limits.py [--only NAME,...] [--defaults] [--serve-traces]

--serve-traces measures kvcache.serve on uploaded traces instead (bench/results/limits_serve_traces.json): what
its estimate is fitted to, the step, token, sample and snapshot costs of its two simulations, out to the uploads'
last allowed arrival (backend/uploads.py MAX_ARRIVAL).
"""
from __future__ import annotations

import argparse
import atexit
import json
import os
import re
import shutil
import subprocess
import tempfile
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from backend import experiments, limits  # noqa: E402
from backend.config import ConfigError  # noqa: E402
from backend.device import describe  # noqa: E402

ALLOWED = re.compile(r"allowed with the other settings as they are: (\w+) = ([^)]+)\)")
ALLOWED_WITH = re.compile(r"allowed: (\w+) = (\S+) with (.+)\)$")  # no single setting fits: others given too


def largest_accepted(exp) -> dict:
    """Every numeric setting at its maximum, then lowered as the refusals say until validate() accepts."""
    values = {f.name: f.metadata["max"] for f in exp.config_cls.fields() if f.metadata.get("max") is not None}
    for _ in range(30):
        try:
            return exp.make_config(values).to_dict()
        except ConfigError as err:
            fix, fix_with = ALLOWED.search(str(err)), ALLOWED_WITH.search(str(err))
            field = exp.config_cls.field_of(err.field)
            if fix:
                values[fix.group(1)] = fix.group(2)
            elif fix_with:
                values[fix_with.group(1)] = fix_with.group(2)
                values.update(pair.split(" = ") for pair in fix_with.group(3).split(", "))
            elif field.metadata.get("min") is not None and str(values.get(err.field)) != str(field.metadata["min"]):
                values[err.field] = field.metadata["min"]  # a cross-field rule or no single fit: try its smallest
            else:
                values.pop(err.field, None)  # back to its default
    raise RuntimeError(f"{exp.name}: no accepted settings found from the maxima")


RUN_LIMIT_S = 900  # a measured run's wall-clock limit


def measure(name: str, config: dict) -> dict:
    """One cold `python -m backend run` of `name` at `config`: the peak resident anonymous memory of its process
    tree, its wall and CPU seconds (the whole tree, imports included), and the run's own: its CPU seconds from the
    moment its run directory appears in the store (the leader's imports done, the run about to start) to its end,
    and its wall seconds by its own clock (run_wall_s)."""
    cmd = [sys.executable, "-m", "backend", "run", name, "--config-json", json.dumps(config), "--json"]
    runs = limits_store_runs()
    before = set(runs.iterdir()) if runs.exists() else set()
    start, load = time.monotonic(), os.getloadavg()[0]
    # the run's own time limit is RUN_LIMIT_S, not the budget its settings were chosen for: on a loaded box its wall
    # time may pass the budget while its CPU seconds, what is measured, do not depend on the load
    env = {**os.environ, "EXPLORER_JOB_TIMEOUT_S": str(RUN_LIMIT_S)}
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.append(proc.stdout.read()), daemon=True)
    reader.start()
    peak, cpu = 0, {}  # cpu: the last CPU seconds seen of each process of the tree (ranks are not our children)
    started_cpu = None  # the tree's CPU seconds when the run began
    while proc.poll() is None:
        peak = max(peak, limits.tree_memory(proc.pid))
        for pid in [proc.pid, *limits.descendants(proc.pid)]:
            cpu[pid] = max(cpu.get(pid, 0.0), limits.cpu_seconds(pid))
        if started_cpu is None and runs.exists() and set(runs.iterdir()) - before:
            started_cpu = sum(cpu.values())
        time.sleep(0.05)
        if time.monotonic() - start > RUN_LIMIT_S + 60:
            proc.kill()
    wall = time.monotonic() - start
    reader.join(timeout=30)  # the rank fork server may hold stdout a moment after the leader ends
    lines = "".join(out).strip().splitlines()
    report = json.loads(lines[-1]) if lines else {}
    total = sum(cpu.values())
    return {"status": report.get("status", f"exit {proc.returncode}"), "error": report.get("error"),
            "passed": report.get("passed"), "peak_bytes": peak, "process_wall_s": round(wall, 2),
            "process_cpu_s": round(total, 2), "run_cpu_s": round(total - (started_cpu or 0.0), 2),
            "load_average": round(load, 1), "run_wall_s": report.get("wall_s")}


def limits_store_runs() -> Path:
    """Where the CLI's run store keeps its run directories (a run's appears when its leader starts it)."""
    from backend.store import data_dir

    return data_dir() / "runs"


NOTE = ("a shared, contended 2-core VM: wall times depend on the load (load_average, when each run started); "
        "time_ratio is the estimate over the run's CPU seconds (leader and ranks, its imports excluded), which do not")
WITHIN = 3.0  # the target: an estimate at least its measurement and at most this many times it


def judged(est, got: dict) -> dict:
    """The estimate beside the measurement: memory against the tree's peak, time against the run's CPU seconds (its
    wall time with a core to itself; wall seconds on this shared box depend on the load, recorded beside)."""
    return {"estimate_bytes": est.memory_bytes, "estimate_s": round(est.seconds, 2), **got,
            "memory_ratio": round(est.memory_bytes / max(got["peak_bytes"], 1), 2),
            "estimate_wait_s": round(est.wait_s, 2), "time_ratio": time_ratio(est, got),
            "memory_covered": est.memory_bytes >= got["peak_bytes"],
            "time_covered": est.seconds - est.wait_s >= got["run_cpu_s"]}


def time_ratio(est, got: dict) -> float:
    """The estimate's seconds over the run's CPU seconds, less the wall seconds the run waits on purpose."""
    return round((est.seconds - est.wait_s) / max(got["run_cpu_s"], 0.01), 2)


def _covered(row: dict) -> bool:
    """Measured within its estimate, in a run that ran to its end (whether its checks passed is reported beside)."""
    return row["memory_covered"] and row["time_covered"] and row["status"] == "succeeded"


def serve_traces() -> list[tuple[str, bytes, dict]]:
    """Uploaded traces that separate the estimate's terms: idle steps (one late request), the pool's size (sampled
    and snapshotted), many rows, long outputs."""
    import random

    rng = random.Random(0)
    late = b"arrival,prompt_len,output_len\n100000,10,10\n"
    many = "arrival,prompt_len,output_len\n" + "".join(
        f"{i * 10},{rng.randint(1, 200)},{rng.randint(1, 200)}\n" for i in range(10_000))
    long = "arrival,prompt_len,output_len\n" + "".join(f"{i * 10},100,1000\n" for i in range(2000))
    return [("one request at step 100,000", late, {}),
            ("one request at step 100,000, 16,384 blocks", late, {"num_blocks": 16384}),
            ("10,000 rows to step 100,000", many.encode(), {}),
            ("2,000 requests of 1,100 tokens", long.encode(), {})]


def measure_serve_traces() -> list[dict]:
    from backend import uploads

    rows = []
    for label, data, settings in serve_traces():
        config = experiments.get("kvcache.serve").make_config({**settings, "trace": uploads.save_trace(data)}).to_dict()
        est = experiments.get("kvcache.serve").make_config(config).estimate()
        got = measure("kvcache.serve", config)
        rows.append({"experiment": "kvcache.serve", "trace": label, "config": config, **judged(est, got)})
        print(f"{label:44s} run {got['run_wall_s']} s (est {est.seconds:5.1f}; CPU {got['run_cpu_s']} s, load "
              f"{got['load_average']})  {got['status']}", flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--only", help="comma-separated experiment names")
    p.add_argument("--defaults", action="store_true", help="measure default settings instead (calibration)")
    p.add_argument("--serve-traces", action="store_true", help="kvcache.serve on uploaded traces (its estimate's fit)")
    args = p.parse_args()
    # A store of the bench's own: a run's directory appearing in it marks its start (measure())
    os.environ["EXPLORER_DATA_DIR"] = tempfile.mkdtemp(prefix="limits-bench-")
    atexit.register(shutil.rmtree, os.environ["EXPLORER_DATA_DIR"], True)
    if args.serve_traces:
        rows = measure_serve_traces()
        out = {"device": describe()["name"], "note": NOTE,
               "all_covered": all(_covered(r) for r in rows), "rows": rows}
        path = ROOT / "bench" / "results" / "limits_serve_traces.json"
        path.write_text(json.dumps(out, indent=1))
        print(f"wrote {path}")
        return
    chosen = [e for e in experiments.all_experiments() if not args.only or e.name in args.only.split(",")]
    rows = []
    for exp in chosen:
        config = exp.config_cls().to_dict() if args.defaults else largest_accepted(exp)
        est = exp.make_config(config).estimate()
        got = measure(exp.name, config)
        # The leader's own clock starts after its imports; the estimate covers the run, compared with run_wall_s.
        row = {"experiment": exp.name, "config": config, **judged(est, got),
               "within_budget": est.memory_bytes <= limits.memory_budget() and est.seconds <= limits.time_budget()}
        rows.append(row)
        print(f"{exp.name:24s} peak {got['peak_bytes'] / 2**30:5.2f} GiB (est {est.memory_bytes / 2**30:5.2f})  "
              f"CPU {got['run_cpu_s']} s (est {est.seconds:6.1f}; wall {got['run_wall_s']} s, load "
              f"{got['load_average']})  {got['status']}", flush=True)
    out = {"device": describe()["name"], "note": NOTE, "memory_budget_bytes": limits.memory_budget(),
           "time_budget_s": limits.time_budget(), "mode": "defaults" if args.defaults else "largest accepted",
           "all_covered": all(_covered(r) for r in rows), "rows": rows}
    path = ROOT / "bench" / "results" / ("limits_defaults.json" if args.defaults else "limits.json")
    if args.only and path.exists():  # re-measured experiments replace their rows; the others stay
        kept = [r for r in json.loads(path.read_text())["rows"] if r["experiment"] not in {r["experiment"] for r in rows}]
        out["rows"] = sorted(kept + rows, key=lambda r: r["experiment"])
        out["all_covered"] = all(_covered(r) for r in out["rows"])
    path.write_text(json.dumps(out, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
