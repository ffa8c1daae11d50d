import socket
import time

import pytest

from backend.config import ConfigError
from tests.conftest import processes_in_group

SMALL = {"world_size": "2", "max_bytes": "2048", "iters": "1", "ops": "all_reduce"}


def _port_free(port: int) -> bool:
    """Nothing listens on it any more (SO_REUSEADDR: sockets in TIME_WAIT do not count, as for TCPStore)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def _assert_cleaned_up(rec):
    assert rec.pid and processes_in_group(rec.pid) == [], "a process of the job is still alive"
    assert _port_free(rec.port)


def test_job_succeeds_and_identical_config_is_deduplicated(runner):
    first = runner.submit("comm.bandwidth", SMALL)
    again = runner.submit("comm.bandwidth", dict(SMALL))
    assert again == first
    rec = runner.wait(first, 120)
    assert rec.status == "succeeded", rec.error
    assert rec.result()["checks"][0]["passed"]
    assert runner.submit("comm.bandwidth", SMALL) == first  # stored run reused
    _assert_cleaned_up(rec)


def test_crashing_rank_fails_the_run_with_its_error(runner):
    rec = runner.wait(runner.submit("comm.selftest", {"world_size": "3", "fault": "crash", "fault_rank": "2"}), 120)
    assert rec.status == "failed"
    assert "rank 2" in rec.error and "injected crash on rank 2" in rec.error
    _assert_cleaned_up(rec)


def test_silently_exiting_rank_is_named(runner):
    rec = runner.wait(runner.submit("comm.selftest", {"world_size": "2", "fault": "exit", "fault_rank": "1"}), 120)
    assert rec.status == "failed" and "rank 1" in rec.error and "exit code 3" in rec.error
    _assert_cleaned_up(rec)


def test_hanging_rank_is_killed_at_the_timeout(runner):
    start = time.time()
    rid = runner.submit("comm.selftest", {"world_size": "2", "fault": "hang"}, timeout_s=6)
    rec = runner.wait(rid, 60)
    assert rec.status == "failed" and "timeout" in rec.error
    assert time.time() - start < 6 + 25
    _assert_cleaned_up(rec)


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
        assert r.wait(a, 30).status == "cancelled"
    finally:
        r.close()


def test_bad_input_is_rejected_before_anything_is_stored(runner):
    with pytest.raises(ConfigError, match="world_size"):
        runner.submit("comm.bandwidth", {"world_size": "1"})
    with pytest.raises(ConfigError, match="fault_rank: 5 is not a rank"):
        runner.submit("comm.selftest", {"world_size": "2", "fault": "crash", "fault_rank": "5"})
    assert runner.store.list() == []
