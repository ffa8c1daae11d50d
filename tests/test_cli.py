import json
import os
import subprocess
import sys

from tests.conftest import REPO

SMALL = ["--set", "world_size=2", "--set", "max_bytes=4096", "--set", "iters=2", "--set", "ops=all_reduce,all_to_all"]


def cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "backend", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=180, env={**os.environ, **(env or {})})


def test_list_names_every_experiment_with_summary():
    out = cli("list")
    assert out.returncode == 0
    assert "comm.bandwidth" in out.stdout and "nccl-tests" in out.stdout


def test_run_json_contract_and_show(tmp_path):
    out = cli("run", "comm.bandwidth", *SMALL, "--json", "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["experiment"] == "comm.bandwidth"
    assert report["config"]["world_size"] == 2 and report["config"]["ops"] == ["all_reduce", "all_to_all"]
    assert report["metrics"]["peak_busbw_GBps.all_reduce"] > 0
    assert {c["name"].split()[0] for c in report["checks"]} == {"all_reduce", "all_to_all"}
    assert all(set(c) >= {"name", "error", "tolerance", "passed"} and c["passed"] for c in report["checks"])
    assert report["artifacts"]["result"] == str(tmp_path / "result.json")
    trace = json.loads((tmp_path / "trace.json").read_text())
    assert {e["pid"] for e in trace["traceEvents"]} == {0, 1}
    shown = cli("show", report["run_id"], "--json")
    assert shown.returncode == 0
    assert json.loads(shown.stdout)["status"] == "succeeded"


def test_bad_config_exits_2_with_one_line_and_stores_nothing_succeeded():
    from backend.store import RunStore

    before = len(RunStore().list())
    for args, field in [(["--set", "world_size=64"], "world_size"), (["--set", "iters=abc"], "iters"),
                        (["--set", "bogus=1"], "bogus"), (["--set", "noequals"], "--set")]:
        out = cli("run", "comm.bandwidth", *args, "--json")
        assert out.returncode == 2
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"error: {field}:"), out.stderr
        assert out.stdout == ""
    assert len(RunStore().list()) == before
    unknown = cli("run", "no.such.experiment")
    assert unknown.returncode == 2 and "unknown experiment" in unknown.stderr and "comm.bandwidth" in unknown.stderr
