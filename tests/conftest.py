import os
import signal
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
# Every test session gets its own run store unless one is given, and each pytest-xdist worker its own folder in it
# (tests that count a store's runs must not see the other worker's).
os.environ.setdefault("EXPLORER_DATA_DIR", tempfile.mkdtemp(prefix="explorer-test-"))
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["EXPLORER_DATA_DIR"] = os.path.join(os.environ["EXPLORER_DATA_DIR"], os.environ["PYTEST_XDIST_WORKER"])
os.environ.setdefault("PYTHONWARNINGS", "ignore::FutureWarning")
# Pages open on their defaults' run (started on a first visit); tests that draw pages start the runs they need.
os.environ.setdefault("EXPLORER_OPEN_ON_DEFAULT_RUN", "0")

from backend.limits import group_members as processes_in_group  # noqa: E402,F401  (the tests' name for it)


def torchrun_killed_and_restarted(name: str, sets: dict, nproc: int, tmp_path: Path,
                                  timeout_s: float) -> tuple[dict, dict]:
    """`name` under torchrun --max-restarts 1 with `sets` that kill a rank: asserts it ended passing after two
    attempts, the killed process is gone and no rank outlived torchrun (killing the group if one did); returns the
    report printed by rank 0 and the result it wrote."""
    import json
    import shutil
    import subprocess

    from backend.store import pid_alive

    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which("torchrun")
    args = [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "EXPLORER_DATA_DIR": str(tmp_path)}
    agent = subprocess.Popen([torchrun, "--standalone", "--nproc-per-node", str(nproc), "--max-restarts", "1", "-m",
                              "backend.launch", name, *args, "--out", str(tmp_path / "out"), "--json"],
                             cwd=REPO, env=env, start_new_session=True, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        out, err = agent.communicate(timeout=timeout_s)
        assert agent.returncode == 0, err[-3000:]
        report = json.loads(out.strip().splitlines()[-1])
        assert report["passed"] and report["metrics"]["attempts"] == 2, report["checks"]
        result = json.loads((tmp_path / "out" / "result.json").read_text())
        kill = [e for e in result["tables"]["checkpoint_timeline"] if e["event"] == "kill"]
        assert kill and not pid_alive(kill[0]["pid"])
        assert processes_in_group(agent.pid) == [], "a rank outlived torchrun"
        return report, result
    finally:
        if processes_in_group(agent.pid):
            os.killpg(agent.pid, signal.SIGKILL)


@pytest.fixture(scope="session", autouse=os.environ.get("PYTEST_XDIST_WORKER") is not None)
def ranks_fork_server():
    """In the suite's workers, the ranks' fork server starts at once with every experiment's preload, as the server's
    standby leader starts it: a worker runs runs of every experiment, and the first one would otherwise fix the
    preload for all (the others' ranks then import torch.distributed.pipelining, DTensor and DCP each, about 1 s)."""
    from backend import experiments
    from backend.comm.spawn import start_fork_server

    start_fork_server(experiments.every_preload())


@pytest.fixture
def store(tmp_path):
    from backend.store import RunStore

    return RunStore(tmp_path / "data")


@pytest.fixture
def runner(store):
    from backend.jobs import JobRunner

    r = JobRunner(store, max_jobs=2, timeout_s=60)
    yield r
    r.close()
