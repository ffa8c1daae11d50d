import os
import signal
import subprocess
import sys
import time

import pytest

from backend.config import ConfigError
from tests.conftest import REPO, processes_in_group

SMALL = {"world_size": "2", "max_bytes": "2048", "iters": "1", "ops": "all_reduce"}


def _port_free(port: int) -> bool:
    """Nothing listens on it any more. Read from the kernel's socket tables rather than by binding: with two test
    workers, another job's outgoing connection may hold the same number as its ephemeral local port."""
    LISTEN = "0A"
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                if state == LISTEN and int(local.rsplit(":", 1)[1], 16) == port:
                    return False
    return True


def _assert_cleaned_up(rec):
    assert rec.pid and processes_in_group(rec.pid) == [], "a process of the job is still alive"
    assert _port_free(rec.port)


def test_a_free_port_is_drawn_below_the_ephemeral_range():
    """Rank 0 binds the port after the leader picks it; no outgoing connection can be handed it in between."""
    from backend.comm.spawn import free_port

    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        ephemeral_low = int(f.read().split()[0])
    ports = {free_port() for _ in range(20)}
    assert len(ports) > 1 and all(10000 <= p < ephemeral_low for p in ports), ports
    assert all(_port_free(p) for p in ports)


def test_job_succeeds_and_identical_config_is_deduplicated(runner):
    first = runner.submit("comm.bandwidth", SMALL)
    again = runner.submit("comm.bandwidth", dict(SMALL))
    assert again == first
    rec = runner.wait(first, 120)
    assert rec.status == "succeeded", rec.error
    assert rec.result()["checks"][0]["passed"]
    assert runner.store.partial(first) is None  # the sizes it recorded as it went gave way to the whole result
    assert runner.submit("comm.bandwidth", SMALL) == first  # stored run reused
    _assert_cleaned_up(rec)


def test_crashing_rank_fails_the_run_with_its_error(runner):
    rec = runner.wait(runner.submit("comm.selftest", {"world_size": "3", "fault": "crash", "fault_rank": "2"}), 120)
    assert rec.status == "failed"
    assert "rank 2" in rec.error and "injected crash on rank 2" in rec.error
    log = (runner.store.run_dir(rec.id) / "log.txt").read_text()
    whole = log.split("--- rank 2 failed ---")[1]  # the whole traceback, not its last line
    assert "Traceback (most recent call last)" in whole and 'selftest.py", line' in whole
    _assert_cleaned_up(rec)


def test_silently_exiting_rank_is_named(runner):
    rec = runner.wait(runner.submit("comm.selftest", {"world_size": "2", "fault": "exit", "fault_rank": "1"}), 120)
    assert rec.status == "failed" and "rank 1" in rec.error and "exit code 3" in rec.error
    _assert_cleaned_up(rec)


def test_hanging_rank_is_named_and_its_stack_logged(runner):
    start = time.time()
    # 40 s: three ranks start on two cores while the other test worker runs; in CI rank 0 had not reached the
    # all-reduce within 20 s, so the run was (rightly) diagnosed as computing, not as hanging in the collective.
    rid = runner.submit("comm.selftest", {"world_size": "3", "fault": "hang", "fault_rank": "1"}, timeout_s=40)
    rec = runner.wait(rid, 150)
    assert rec.status == "failed" and "time limit: not finished within 40 s" in rec.error, rec.error
    assert "ranks [1] had not reached the collective" in rec.error and "rank 0 in all_reduce" in rec.error
    log = (runner.store.run_dir(rid) / "log.txt").read_text()
    hung = log.split("--- rank 1: Python stack")[1].split("--- rank 2")[0]
    assert 'selftest.py", line' in hung and "in rank_main" in hung and "distributed_c10d" not in hung
    assert time.time() - start < 40 + 60  # the diagnosis comes before the runner's backstop
    _assert_cleaned_up(rec)
    # What a stopped run keeps: what helps (for a hang not smaller settings), how far it got, what it had computed.
    assert "lower world_size" not in rec.error and "do not end a hang: this run's fault = 'hang'" in rec.error
    assert rec.progress == 0.5 and rec.progress_msg == "rank 0 in the all-reduce, waiting for every rank"
    assert runner.store.partial(rid)["metrics"] == {"rank 0 input": 0.0}


def test_a_leader_that_stopped_obeying_is_ended_by_the_runner(store):
    """The leader holds the time limit itself; one that cannot (frozen here by SIGSTOP) is ended by the runner,
    backstop_s past the limit: its run is recorded failed with the time message and its process group killed."""
    from backend.jobs import JobRunner

    runner = JobRunner(store, backstop_s=2.0, warm=False)
    try:
        rid = runner.submit("comm.selftest", {"world_size": "2", "fault": "hang", "fault_rank": "1"}, timeout_s=15)
        rec = _wait_for_ranks(store, 2, rid)
        os.killpg(rec.pid, signal.SIGSTOP)
        rec = runner.wait(rid, 60)
        assert rec.status == "failed" and "time limit: not finished within 15 s" in rec.error, rec.error
        assert "had not reached the collective" not in rec.error  # the runner's words, not the frozen leader's
        _assert_cleaned_up(rec)
    finally:
        runner.close()


def test_a_cancelled_sweep_keeps_the_sizes_it_finished(runner, monkeypatch):
    """comm.bandwidth records rank 0's time per finished size as it goes; a stopped run keeps them."""
    monkeypatch.setenv("EXPLORER_JOB_TIMEOUT_S", "3600")  # the sweep is long on purpose; it is cancelled midway
    long_sweep = {"world_size": "2", "ops": "all_reduce", "min_bytes": "1024", "max_bytes": str(64 << 20), "iters": "100"}
    rid = runner.submit("comm.bandwidth", long_sweep, timeout_s=600)
    deadline = time.time() + 240
    while len((runner.store.partial(rid) or {}).get("tables", {}).get("rank 0 times", [])) < 2:
        assert time.time() < deadline and runner.store.get(rid).status in ("queued", "running")
        time.sleep(0.2)
    runner.cancel(rid)
    rec = runner.wait(rid, 60)
    assert rec.status == "cancelled" and 0 < rec.progress < 1
    rows = runner.store.partial(rid)["tables"]["rank 0 times"]
    assert [r["size_bytes"] for r in rows[:2]] == [1024, 2048] and all(r["time_us"] > 0 for r in rows)
    assert (runner.store.run_dir(rid) / "log.txt").exists()
    _assert_cleaned_up(rec)


def test_time_and_memory_messages_name_the_settings_to_lower():
    from backend import experiments, limits

    config = experiments.get("parallel.pipeline").make_config({"hidden": "256"})
    assert "lower batch (now 128), hidden (now 256), layers (now 8), microbatches (now 8) or world_size (now 4)" \
        in limits.time_message(60, config)
    assert "lower batch (now 128)" in limits.memory_message(5 << 30, 4 << 30, config)
    assert "choose smaller settings" in limits.time_message(60)


def test_a_hang_is_not_told_to_lower_its_settings():
    """A run that is only slow should lower the settings its cost grows with; a hang never ends, whatever they are."""
    from backend import experiments, limits

    injected = experiments.get("comm.selftest").make_config({"world_size": "3", "fault": "hang"})
    waiting = "ranks [1] had not reached the collective the others wait in (rank 0 in all_reduce)"
    message = limits.time_message(40, injected, hang=waiting)
    assert waiting in message and "lower" not in message and "choose fault = none" in message
    other = limits.time_message(40, experiments.get("parallel.pipeline").make_config({}), hang=waiting)
    assert "lower" not in other and "same collectives in the same order" in other
    assert "lower world_size (now 3)" in limits.time_message(40, injected)  # slow, not hung: the settings help


def test_two_runs_at_once_get_different_ports(runner):
    a = runner.submit("comm.selftest", {"world_size": "2"})
    b = runner.submit("comm.selftest", {"world_size": "1"})
    deadline = time.time() + 60
    while time.time() < deadline:
        ra, rb = runner.store.get(a), runner.store.get(b)
        if ra.port and rb.port:
            break
        time.sleep(0.05)
    assert ra.port != rb.port
    assert runner.wait(a).status == runner.wait(b).status == "succeeded"


def test_cancel_kills_a_running_job(runner):
    rid = runner.submit("comm.selftest", {"world_size": "2", "fault": "hang"}, timeout_s=60)
    while runner.store.get(rid).status != "running":
        time.sleep(0.05)
    time.sleep(1)
    runner.cancel(rid)
    rec = runner.wait(rid, 30)
    assert rec.status == "cancelled"
    _assert_cleaned_up(rec)


def test_queue_respects_the_cap_and_cancels_queued(store):
    from backend.jobs import JobRunner

    r = JobRunner(store, max_jobs=1)
    try:
        a = r.submit("comm.selftest", {"world_size": "2", "fault": "hang"}, timeout_s=30)
        b = r.submit("comm.selftest", {"world_size": "1"})
        while store.get(a).status != "running":
            time.sleep(0.05)
        time.sleep(0.5)
        assert store.get(b).status == "queued"
        r.cancel(b)
        assert store.get(b).status == "cancelled"
        r.cancel(a)
        rec = r.wait(a, 30)
        assert rec.status == "cancelled", rec.error
    finally:
        r.close()


RUNNER_PROCESS = """
import sys, time
sys.path.insert(0, {repo!r})
from backend.jobs import JobRunner
from backend.store import RunStore
JobRunner(RunStore({root!r}), max_jobs=1, poll_s=0.05)
time.sleep(10_000)
"""


def _running(store) -> list:
    return store.list(statuses=("running",))


def _cancel_within_a_second(store, rid: str) -> None:
    """Cancel from this process, which did not start the job: its leader must stop it within a second."""
    from backend.jobs import JobRunner

    JobRunner(store, max_jobs=0).cancel(rid)  # a runner that only submits and cancels, like a page process
    asked = time.monotonic()
    while store.get(rid).status == "running":
        assert time.monotonic() - asked < 1.5, "the leader did not act on the cancel flag within a second"
        time.sleep(0.02)
    assert store.get(rid).status == "cancelled"


def test_cap_holds_across_runner_processes_and_a_new_server_adopts_their_jobs(store):
    """Two runner processes with cap 1 never run two jobs; cancel works from a third process; after both runners
    die (kill -9), their running job's leader lives on: a fresh runner counts it against the cap and cancels it."""
    from backend.jobs import JobRunner

    code = RUNNER_PROCESS.format(repo=str(REPO), root=str(store.root))
    runners = [subprocess.Popen([sys.executable, "-c", code], start_new_session=True) for _ in range(2)]
    submitter = JobRunner(store, max_jobs=0)
    hangs = [submitter.submit("comm.selftest", {"world_size": "2", "fault": "hang", "fault_rank": str(r)}, timeout_s=60)
             for r in (0, 1)]
    try:
        seen = set()
        for rid in hangs[:1]:
            deadline = time.time() + 60
            while not (running := _running(store)) and time.time() < deadline:
                time.sleep(0.05)
            assert len(running) == 1
            seen.add(running[0].id)
            _wait_for_ranks(store, 2, running[0].id)
            for _ in range(30):  # both runners are polling; still one job at a time
                assert len(_running(store)) <= 1
                time.sleep(0.1)
            _cancel_within_a_second(store, running[0].id)
        deadline = time.time() + 60
        while not (running := _running(store)) and time.time() < deadline:
            time.sleep(0.05)
        assert len(running) == 1 and running[0].id not in seen
        adopted = _wait_for_ranks(store, 2, running[0].id)
        for proc in runners:
            proc.kill()
            proc.wait()
        time.sleep(1)
        assert store.get(adopted.id).status == "running"  # the leader outlives the server that started it
        fresh = JobRunner(store, max_jobs=1)
        try:
            queued = fresh.submit("comm.selftest", {"world_size": "1"})
            time.sleep(1)
            assert store.get(queued).status == "queued"  # the adopted job holds the one slot
            _cancel_within_a_second(store, adopted.id)
            deadline = time.time() + 5
            while processes_in_group(adopted.pid) and time.time() < deadline:
                time.sleep(0.1)
            assert processes_in_group(adopted.pid) == []
            fresh.cancel(queued)
        finally:
            fresh.close()
    finally:
        for proc in runners:
            proc.kill()


# store.py alone (stdlib only), so 8 processes start in a moment instead of each importing torch.
SUBMITTER = """
import importlib.util, os, sys, time
spec = importlib.util.spec_from_file_location("store", {path!r})
store_module = sys.modules["store"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(store_module)
store = store_module.RunStore({root!r})
print("ready", flush=True)
while not os.path.exists({go!r}):
    time.sleep(0.001)
print(store.submit("demo", {{"n": 1}}, "same-digest", timeout_s=60, code_version="v")[0], flush=True)
"""


def test_identical_simultaneous_submissions_make_one_run(store, tmp_path):
    go = tmp_path / "go"
    code = SUBMITTER.format(path=str(REPO / "backend" / "store.py"), root=str(store.root), go=str(go))
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True) for _ in range(8)]
    assert all(p.stdout.readline().strip() == "ready" for p in procs)  # all waiting at the line
    go.touch()
    ids = {p.communicate(timeout=60)[0].strip() for p in procs}
    assert len(ids) == 1 and len(store.list(experiment="demo")) == 1


def _wait_for_ranks(store, world: int, run_id: str | None = None, timeout_s: float = 90):
    """The run's row (or any running selftest's), once every rank is past start-up (each created its stack file)."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        for rec in store.list(experiment="comm.selftest", statuses=("running",)):
            if run_id and rec.id != run_id:
                continue
            stacks = store.root / "runs" / rec.id / "stacks"
            if stacks.exists() and len(list(stacks.iterdir())) == world:
                return rec
        time.sleep(0.1)
    raise TimeoutError("ranks did not start")


@pytest.mark.parametrize("how", ["ctrl-c", "sigterm", "sigkill"])
def test_stopped_cli_run_is_never_left_running_nor_its_ranks(store, how):
    env = {**os.environ, "EXPLORER_DATA_DIR": str(store.root), "PYTHONPATH": str(REPO)}
    cli = subprocess.Popen([sys.executable, "-m", "backend", "run", "comm.selftest", "--set", "world_size=2",
                            "--set", "fault=hang", "--timeout", "100"], cwd=REPO, env=env, start_new_session=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        rec = _wait_for_ranks(store, 2)
        assert len(processes_in_group(cli.pid)) >= 3
        if how == "ctrl-c":
            os.killpg(cli.pid, signal.SIGINT)  # a terminal's Ctrl-C reaches the whole foreground group
        else:
            os.kill(cli.pid, signal.SIGTERM if how == "sigterm" else signal.SIGKILL)
        stopped = time.monotonic()
        cli.wait(timeout=10)
        # the ranks' fork server sees its leader gone and the ranks their parent gone: seconds on a loaded machine
        while processes_in_group(cli.pid) and time.monotonic() - stopped < 30:
            time.sleep(0.1)
        assert processes_in_group(cli.pid) == [], "a rank outlived its leader"
        while store.get(rec.id).status == "running" and time.monotonic() - stopped < 30:
            time.sleep(0.2)
        final = store.get(rec.id)
        assert final.status == ("failed" if how == "sigkill" else "cancelled")
        assert ("is gone" if how == "sigkill" else "stopped by SIG") in final.error, final.error
    finally:
        if processes_in_group(cli.pid):
            os.killpg(cli.pid, signal.SIGKILL)


def test_bad_input_is_rejected_before_anything_is_stored(runner):
    with pytest.raises(ConfigError, match="world_size"):
        runner.submit("comm.bandwidth", {"world_size": "1"})
    with pytest.raises(ConfigError, match="fault_rank: 5 is not a rank"):
        runner.submit("comm.selftest", {"world_size": "2", "fault": "crash", "fault_rank": "5"})
    assert runner.store.list() == []


def test_a_distributed_run_listens_on_loopback_only(runner):
    rid = runner.submit("comm.selftest", {"world_size": "3", "fault": "hang", "fault_rank": "2"}, timeout_s=60)
    rec = _wait_for_ranks(runner.store, 3, rid)
    time.sleep(3)  # past the rendezvous: every rank has connected
    pids = set(processes_in_group(rec.pid))
    listening = [line.split() for line in subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True).stdout.splitlines()]
    ours = [cols[3] for cols in listening if any(f"pid={pid}," in cols[-1] for pid in pids)]
    runner.cancel(rid)
    assert ours, "found no listening socket of the run's ranks"
    assert all(addr.startswith("127.0.0.1:") for addr in ours), ours


def test_only_the_owner_or_an_admin_cancels(store):
    from backend.jobs import JobRunner, NotAllowed

    r = JobRunner(store, max_jobs=0)  # submits and cancels; runs nothing
    rid = r.submit("comm.selftest", {"world_size": "1"}, owner="ana@team")
    assert store.get(rid).owner == "ana@team"
    with pytest.raises(NotAllowed, match="launched by ana@team"):
        r.cancel(rid, by="bo@team", admin=False)
    assert store.get(rid).status == "queued"
    r.cancel(rid, by="ana@team", admin=False)
    rec = store.get(rid)
    assert rec.status == "cancelled" and "by ana@team" in rec.error
    other = r.submit("comm.selftest", {"world_size": "2"}, owner="ana@team")
    r.cancel(other, by="admin@team", admin=True)
    assert store.get(other).status == "cancelled"


def test_a_warm_leader_takes_the_next_run_and_a_stale_one_is_not_used(store, monkeypatch):
    from backend import experiments
    from backend.jobs import JobRunner

    r = JobRunner(store, max_jobs=1, poll_s=0.05, warm=True)
    try:
        deadline = time.monotonic() + 10
        while r._standby is None and time.monotonic() < deadline:  # started at once: no run holds the slot
            time.sleep(0.05)
        warm = r._standby.proc.pid
        rec = r.wait(r.submit("comm.bandwidth", SMALL), 120)
        assert rec.status == "succeeded", rec.error
        assert rec.pid == warm  # the warm process led the run, in its own process group, as a cold one does
        log = (store.run_dir(rec.id) / "log.txt").read_text()
        assert f'"run_id": "{rec.id}"' in log  # its report went to the run's log, not the standby's output
        _assert_cleaned_up(rec)
        deadline = time.monotonic() + 10
        while r._standby is None and time.monotonic() < deadline:  # the next one is warmed once the slot is free
            time.sleep(0.05)
        stale = r._standby.proc.pid
        assert stale != warm
        monkeypatch.setattr(experiments, "code_version", lambda: "edited-code")  # the sources changed since it started
        rec = r.wait(r.submit("comm.bandwidth", {**SMALL, "iters": "2"}), 120)
        assert rec.status == "succeeded", rec.error
        assert rec.pid != stale and processes_in_group(stale) == []  # ended, and a cold leader ran the new code
    finally:
        r.close()
    assert r._standby is None and processes_in_group(stale) == []
