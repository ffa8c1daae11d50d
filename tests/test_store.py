import os
import signal
import subprocess
import sys
import textwrap
import time

from backend.store import RunStore


def test_writer_killed_mid_write_leaves_store_intact(tmp_path):
    store = RunStore(tmp_path)
    keep = [store.create("demo", {"i": i}, f"d{i}", status="succeeded") for i in range(5)]
    writer = textwrap.dedent(f"""
        import sys; sys.path.insert(0, {str(os.getcwd())!r})
        from backend.store import RunStore
        s = RunStore({str(tmp_path)!r})
        i = 0
        while True:
            rid = s.create("writer", {{"i": i}}, "w%d" % i, status="running")
            s.update(rid, progress=0.5, progress_msg="x" * 10000)
            i += 1
    """)
    proc = subprocess.Popen([sys.executable, "-c", writer])
    deadline = time.time() + 60
    while not store.list(experiment="writer", limit=1) and time.time() < deadline:  # writing, not starting up
        time.sleep(0.05)
    time.sleep(0.5)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    reopened = RunStore(tmp_path)
    assert reopened.check_integrity() == "ok"
    for rid in keep:
        assert reopened.get(rid).status == "succeeded"
    assert len(reopened.list(experiment="writer", limit=100_000)) > 0


def test_a_new_store_opened_while_another_process_writes_waits_for_it(tmp_path):
    """Ranks of a torchrun open one new store at once: switching it to WAL while another connection writes was
    refused at once ("database is locked", rank 1 of a CI run died of it); it must wait for the writer."""
    import sqlite3
    import threading

    writer = sqlite3.connect(tmp_path / "runs.sqlite", isolation_level=None, check_same_thread=False)
    writer.execute("CREATE TABLE other (x)")
    writer.execute("BEGIN IMMEDIATE")
    writer.execute("INSERT INTO other VALUES (1)")
    threading.Timer(0.5, lambda: writer.execute("COMMIT")).start()
    store = RunStore(tmp_path)
    writer.close()
    assert store.create("x", {}, "d")
    assert sqlite3.connect(tmp_path / "runs.sqlite").execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_claim_is_exclusive_and_finish_is_first_writer_wins(tmp_path):
    store = RunStore(tmp_path)
    rid = store.create("demo", {}, "d", status="queued")
    assert store.claim_next(cap=1).id == rid
    assert store.claim_next(cap=1) is None
    store.finish(rid, "succeeded")
    store.finish(rid, "failed", error="late")
    assert store.get(rid).status == "succeeded"


def test_a_dead_run_is_failed_by_any_reader_and_never_reused(tmp_path):
    store = RunStore(tmp_path)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    dead = store.create("demo", {}, "same", status="running", pid=gone.pid, origin="jobs")
    rid, created = store.submit("demo", {}, "same", timeout_s=60, code_version="v")
    assert created and rid != dead
    rec = store.get(dead)
    assert rec.status == "failed" and f"pid {gone.pid}) is gone" in rec.error


def test_a_silent_leader_is_failed_after_the_heartbeat_limit(tmp_path):
    from backend import store as store_module

    store = RunStore(tmp_path)
    rid = store.create("demo", {}, "d", status="running", pid=os.getpid())  # alive, but it stops beating
    store.update(rid, heartbeat=time.time() - store_module.STALE_S + 1)
    assert store.get(rid).status == "running"
    store.update(rid, heartbeat=time.time() - store_module.STALE_S - 1)
    rec = store.list(statuses=("failed",))[0]
    assert rec.id == rid and "no heartbeat" in rec.error


def test_claim_honours_a_cap_shared_by_every_runner(tmp_path):
    store = RunStore(tmp_path)
    first, _ = store.submit("demo", {"i": 1}, "a", timeout_s=60, code_version="v")
    second, _ = store.submit("demo", {"i": 2}, "b", timeout_s=60, code_version="v")
    assert store.claim_next(cap=1).id == first
    assert store.claim_next(cap=1) is None  # whichever runner asks, one is already running
    assert store.claim_next(cap=2).id == second


def test_cancel_is_a_flag_the_leader_reads_with_its_heartbeat(tmp_path):
    store = RunStore(tmp_path)
    rid = store.create("demo", {}, "d", status="running", pid=os.getpid())
    assert store.beat(rid) is False
    assert store.request_cancel(rid, by="ana") == "running"
    assert store.beat(rid) is True and store.get(rid).error == "cancelled by ana"  # what the leader records
    queued, _ = store.submit("demo", {"q": 1}, "q", timeout_s=60, code_version="v")
    store.request_cancel(queued, by="bo")
    assert store.get(queued).status == "cancelled" and store.get(queued).error == "cancelled by bo before it started"


def test_counts_per_experiment(tmp_path):
    store = RunStore(tmp_path)
    for name in ("a", "a", "b"):
        store.create(name, {}, f"{name}-{len(store.list())}", status="succeeded")
    assert store.counts() == {"a": 2, "b": 1}
