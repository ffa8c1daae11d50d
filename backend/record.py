"""Recording a run: run an experiment in this process, write its artifacts, move its store row to a final state.

The registry (backend.experiments) only finds and runs experiments; this module is what the CLI, torchrun's
launcher and the tests use to leave a run behind in the run store: result.json (settings, code version, wall time
and the Result) and trace.json (a Chrome trace), each written whole or not at all.
"""
from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

from backend.config import Config
from backend.experiments import Experiment, RunContext, code_version
from backend.result import Result
from backend.store import RunStore
from backend.trace import to_chrome_trace


def write_artifacts(exp: Experiment, result: Result, out_dir: Path, header: dict) -> dict[str, str]:
    """result.json (header + result) and trace.json (Chrome trace) in out_dir; returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    result_path, trace_path = out_dir / "result.json", out_dir / "trace.json"
    _atomic_write(result_path, json.dumps({**header, **result.to_dict()}, indent=1, default=_json_default))
    _atomic_write(trace_path, json.dumps(to_chrome_trace(result.trace_events, exp.lanes)))
    return {"result": str(result_path), "trace": str(trace_path)}


def run_recorded(exp: Experiment, config: Config, ctx: RunContext, store: RunStore, run_id: str, out_dir: Path | None = None) -> dict:
    """Run in this process, write artifacts, move the store row to its final state. Returns the report."""
    out_dir = out_dir or store.run_dir(run_id)
    started = time.time()
    header = {"experiment": exp.name, "run_id": run_id, "config": config.to_dict(), "code_version": code_version()}
    try:
        result = exp.run(config, ctx)
    except Exception as err:  # the run failed; say why, store it, never as succeeded
        message = f"{type(err).__name__}: {err}"
        store.finish(run_id, "failed", error=message)
        return {**header, "status": "failed", "error": message, "metrics": {}, "checks": [], "artifacts": {}}
    header["wall_s"] = round(time.time() - started, 3)
    artifacts = write_artifacts(exp, result, out_dir, header)
    store.finish(run_id, "succeeded", result_path=artifacts["result"], trace_path=artifacts["trace"], progress=1.0)
    store.drop_partial(run_id)  # the whole result replaces it
    report = {**header, "status": "succeeded", **result.to_dict(), "passed": result.passed, "artifacts": artifacts}
    report.pop("tables")
    return report


def _atomic_write(path: Path, text: str) -> None:
    with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
        f.write(text)
    Path(f.name).replace(path)


def _json_default(obj):
    if hasattr(obj, "item"):
        return obj.item()
    if hasattr(obj, "tolist"):
        return obj.tolist()
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")
