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
    time.sleep(1.5)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    reopened = RunStore(tmp_path)
    assert reopened.check_integrity() == "ok"
    for rid in keep:
        assert reopened.get(rid).status == "succeeded"
    assert len(reopened.list(experiment="writer", limit=100_000)) > 0


def test_claim_is_exclusive_and_finish_is_first_writer_wins(tmp_path):
    store = RunStore(tmp_path)
    rid = store.create("demo", {}, "d", status="queued")
    assert store.claim_next().id == rid
    assert store.claim_next() is None
    store.finish(rid, "succeeded")
    store.finish(rid, "failed", error="late")
    assert store.get(rid).status == "succeeded"
