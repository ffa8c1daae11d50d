import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO


def test_torchrun_runs_the_same_experiment(tmp_path):
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which("torchrun")
    cmd = [torchrun, "--standalone", "--nproc-per-node", "2", "-m", "backend.launch", "comm.bandwidth",
           "--set", "max_bytes=4096", "--set", "iters=2", "--set", "ops=all_reduce,all_gather",
           "--out", str(tmp_path), "--json"]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=180,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["config"]["world_size"] == 2  # taken from torchrun's WORLD_SIZE
    assert report["status"] == "succeeded" and report["passed"]
    trace = json.loads((tmp_path / "trace.json").read_text())
    assert {e["pid"] for e in trace["traceEvents"] if e["ph"] == "X"} == {0, 1}
    from backend.store import RunStore

    assert RunStore().get(report["run_id"]).origin == "torchrun"
