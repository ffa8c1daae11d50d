"""Every distributed experiment runs under torchrun (the cluster path) on 2 ranks, with its checks passing."""
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from backend import experiments
from tests.conftest import REPO

DISTRIBUTED = [e.name for e in experiments.all_experiments() if e.distributed]
# Smaller than the defaults where a default is sized to make the page's picture clear, not to be quick.
QUICK = {"parallel.pipeline": ["hidden=64", "batch=32"], "comm.bandwidth": ["max_bytes=4096", "iters=2", "ops=all_reduce,all_gather"],
         "parallel.mesh": ["tp=2", "pp=1"],  # its default mesh (tp=2, pp=2) needs 4 ranks
         "parallel.checkpoint": ["kill_rank=-1"]}  # a kill needs --max-restarts: test_checkpoint.py drives that


def _torchrun(name: str, out: Path, sets: list[str]) -> subprocess.CompletedProcess:
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which("torchrun")
    cmd = [torchrun, "--standalone", "--nproc-per-node", "2", "-m", "backend.launch", name,
           *[a for s in sets for a in ("--set", s)], "--out", str(out), "--json"]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240,
                          env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})


def _failure(out: subprocess.CompletedProcess) -> str:
    """Every rank's own lines first (torchrun's summary names only the first rank to fail), then the tail."""
    own = [line for line in out.stderr.splitlines() if re.match(r"\[rank\d+\]", line)]
    return "\n".join(own[-80:]) + "\n--- tail ---\n" + out.stderr[-2000:]


def test_every_distributed_experiment_is_listed():
    assert {"comm.bandwidth", "parallel.pipeline", "parallel.zero"} <= set(DISTRIBUTED)


@pytest.mark.parametrize("name", DISTRIBUTED)
def test_torchrun_runs_the_experiment(name, tmp_path):
    out = _torchrun(name, tmp_path, QUICK.get(name, []))
    assert out.returncode == 0, _failure(out)
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["config"]["world_size"] == 2  # taken from torchrun's WORLD_SIZE
    assert report["status"] == "succeeded" and report["passed"], [c for c in report["checks"] if not c["passed"]]
    trace = json.loads((tmp_path / "trace.json").read_text())
    assert {e["pid"] for e in trace["traceEvents"] if e["ph"] == "X"} == {0, 1}
    from backend.store import RunStore

    assert RunStore().get(report["run_id"]).origin == "torchrun"


@pytest.mark.parametrize("name, sets", [
    ("parallel.pipeline", ["schedule=dualpipe_v", "microbatches=4", "hidden=64", "batch=32"]),
    ("parallel.mesh", ["schedule=zb_v", "pp=2", "tp=1", "batch=4"]),
])
def test_torchrun_runs_the_v_schedules(name, sets, tmp_path):
    """The V-shaped schedules (the last stage beside the first on rank 0) under torchrun, on the pipeline page's model
    and on the tiny LLaMA's mesh, checks passing."""
    out = _torchrun(name, tmp_path, sets)
    assert out.returncode == 0, _failure(out)
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["config"]["schedule"] == sets[0].split("=")[1] and report["passed"]


def test_sigterm_to_torchrun_records_a_final_state_and_leaves_no_process(tmp_path):
    """A supervisor stopping a torchrun run (SIGTERM to the agent, which forwards it to every rank): rank 0's leader
    records "cancelled" with the signal, and no rank process outlives the agent."""
    import signal
    import time

    from backend.store import RunStore
    from tests.conftest import processes_in_group

    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which("torchrun")
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "EXPLORER_DATA_DIR": str(tmp_path)}
    agent = subprocess.Popen([torchrun, "--standalone", "--nproc-per-node", "2", "-m", "backend.launch", "comm.selftest",
                              "--set", "fault=hang", "--timeout", "100"], cwd=REPO, env=env, start_new_session=True,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    store = RunStore(tmp_path)
    try:
        deadline = time.monotonic() + 120
        while not (running := store.list(experiment="comm.selftest", statuses=("running",))):
            assert time.monotonic() < deadline and agent.poll() is None, "the run never started"
            time.sleep(0.2)
        time.sleep(2)  # both ranks are in the hanging collective by now
        agent.send_signal(signal.SIGTERM)
        agent.wait(timeout=60)
        stopped = time.monotonic()
        while processes_in_group(agent.pid) and time.monotonic() - stopped < 5:
            time.sleep(0.1)
        assert processes_in_group(agent.pid) == [], "a rank outlived torchrun"
        final = store.get(running[0].id)
        assert final.status == "cancelled" and "stopped by SIGTERM" in final.error, (final.status, final.error)
    finally:
        if processes_in_group(agent.pid):
            os.killpg(agent.pid, signal.SIGKILL)
