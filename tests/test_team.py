"""A team on one server: one person's burst cannot starve the others (a per-person cap on queued runs), a queued
run's place and expected wait, cancelling one's own queued runs, and a server killed with runs queued."""
import os
import subprocess
import sys
import time

import pytest

from backend.store import QueueFull
from tests.conftest import REPO, processes_in_group


def _formats(i: int) -> dict:
    """Distinct cheap settings (dedupe must not merge them)."""
    return {"seed": str(1000 + i), "sum_values": "uniform", "n_terms": "100"}


@pytest.fixture
def paused(store):
    """A runner that never claims (max_jobs=0): the test plays the dispatcher with store.claim_next, so the order
    runs start in is the queue's own, without running anything."""
    from backend.jobs import JobRunner

    r = JobRunner(store, max_jobs=0, warm=False, max_queued_per_person=3)
    yield r
    r.close()


def _delay_of_a_single_run(runner) -> int:
    """Ana submits as fast as the server takes her runs (a burst of 30, then again after every start); Ben submits
    one run once Ana's burst is in. Returns how many of Ana's runs start before Ben's."""
    submitted, started_before = 0, 0

    def burst():
        nonlocal submitted
        while submitted < 30:
            try:
                runner.submit("numerics.formats", _formats(submitted), owner="ana")
            except QueueFull:
                return
            submitted += 1

    burst()
    ben = runner.submit("numerics.formats", _formats(99), owner="ben")
    while (rec := runner.store.claim_next(1)) is not None:
        if rec.id == ben:
            return started_before
        started_before += rec.owner == "ana"
        runner.store.finish(rec.id, "succeeded")
        burst()
    raise AssertionError("Ben's run never started")


def test_a_burst_delays_another_persons_run_by_at_most_the_cap_and_one(paused):
    assert _delay_of_a_single_run(paused) <= paused.max_queued_per_person + 1


def test_without_the_cap_a_burst_starves_the_others(paused):
    """The same burst with the per-person cap removed: Ben waits behind all 30 of Ana's runs."""
    paused.max_queued_per_person = None
    assert _delay_of_a_single_run(paused) > 3 + 1


def test_the_refusal_names_the_cap_and_the_setting(paused):
    for i in range(3):
        paused.submit("numerics.formats", _formats(i), owner="ana")
    with pytest.raises(QueueFull, match=r"ana already has 3 run\(s\) queued.*EXPLORER_MAX_QUEUED_PER_PERSON = 3"):
        paused.submit("numerics.formats", _formats(3), owner="ana")
    assert paused.submit("numerics.formats", _formats(0), owner="ana")  # the same settings again: its own run
    assert paused.submit("numerics.formats", _formats(4), owner="ben")  # others are not held back


def test_a_person_cancels_their_own_queued_runs_and_nobody_elses(paused):
    mine = [paused.submit("numerics.formats", _formats(i), owner="ana") for i in range(3)]
    theirs = paused.submit("numerics.formats", _formats(10), owner="ben")
    assert sorted(paused.cancel_queued("ana")) == sorted(mine)
    assert [paused.store.get(r).status for r in mine] == ["cancelled"] * 3
    assert paused.store.get(theirs).status == "queued"
    assert "cancelled by ana before it started" in paused.store.get(mine[0]).error


def test_a_queued_runs_place_and_wait_come_from_the_runs_ahead(store):
    """Two slots: the wait is when the earliest slot frees after the runs ahead are laid on them, worked out here by
    hand from each run's estimate (a running one counts what its estimate has left)."""
    from backend import experiments
    from backend.jobs import JobRunner

    runner = JobRunner(store, max_jobs=0, warm=False, max_queued_per_person=10)
    try:
        runner.max_jobs = 2  # the places on a two-slot server; the dispatcher's own loop read 0 when it started
        ids = [runner.submit("numerics.formats", _formats(i), owner="ana") for i in range(4)]
        est = [experiments.get("numerics.formats").make_config(_formats(i)).estimate().seconds for i in range(4)]
        first = store.claim_next(2)  # running, started just now
        assert first.id == ids[0]
        place = runner.place(ids[3])
        assert (place.running, place.ahead) == (1, 2)
        # slots free at est0 (running) and 0; run 1 takes the free one (ends est1), run 2 the next to free
        slots = sorted([est[0], 0.0])
        slots = sorted([slots[0] + est[1], slots[1]])
        slots = sorted([slots[0] + est[2], slots[1]])
        assert place.wait_s == pytest.approx(slots[0], abs=0.5)
        assert runner.place(ids[0]) is None  # running: no longer queued
    finally:
        runner.close()


# --- a server killed with runs queued --------------------------------------------------------------------------------
SERVER = """
import sys, time
from backend.jobs import JobRunner
from backend.store import RunStore
JobRunner(RunStore(sys.argv[1]), max_jobs=1)
print("serving", flush=True)
while True:
    time.sleep(1)
"""


def _server(data) -> subprocess.Popen:
    """A server's job runner (what pages/server.py keeps per Streamlit process), in its own process."""
    proc = subprocess.Popen([sys.executable, "-c", SERVER, str(data)], cwd=REPO, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.stdout.readline().strip() == "serving"
    return proc


def _wait_for(predicate, timeout_s: float, what: str):
    end = time.time() + timeout_s
    while time.time() < end:
        if value := predicate():
            return value
        time.sleep(0.2)
    raise AssertionError(f"not within {timeout_s:g} s: {what}")


def test_kill_9_of_the_server_with_runs_queued_loses_none(store, monkeypatch):
    """kill -9 of the server while one run runs and ten wait: the running one's leader (its own session) goes on and
    records its end; the restarted server runs the ten, one at a time (the cap holds across the restart: none starts
    before the adopted run ends), each exactly once."""
    from backend import uploads
    from backend.jobs import JobRunner
    from backend.store import pid_alive

    monkeypatch.setenv("EXPLORER_DATA_DIR", str(store.root))  # the servers', the runs' and the uploads' store
    submitter = JobRunner(store, max_jobs=0, warm=False, max_queued_per_person=None)  # submits only
    first = _server(store.root)
    second = None
    try:
        # ~18,000 busy scheduler steps (~4 s of CPU): idle steps before a late arrival are skipped, so it must be busy
        busy = "arrival,prompt_len,output_len\n" + "".join(f"{i * 6},{50 + i % 90},{20 + i % 150}\n" for i in range(3000))
        long_trace = uploads.save_trace(busy.encode(), store.root)
        long_run = submitter.submit("kvcache.serve", {"trace": long_trace, "num_blocks": "8192"}, owner="ana")
        running = _wait_for(lambda: (r := store.get(long_run)).status == "running" and r.pid and r, 120, "claimed")
        queued = [submitter.submit("numerics.formats", _formats(i), owner=f"p{i}") for i in range(10)]
        assert store.get(long_run).status == "running" and all(store.get(q).status == "queued" for q in queued)
        first.kill()
        first.wait()
        assert pid_alive(running.pid), "the run's leader died with the server"
        second = _server(store.root)
        every = [long_run, *queued]
        _wait_for(lambda: all(store.get(r).status in ("succeeded", "failed", "cancelled") for r in every), 400,
                  "every run final after the restart")
        records = [store.get(r) for r in every]
        adopted = records[0]
        assert adopted.status == "succeeded" or (adopted.status == "failed" and adopted.error), adopted.error
        assert [r.status for r in records[1:]] == ["succeeded"] * 10, [(r.status, r.error) for r in records[1:]]
        assert len(store.list()) == 11  # none doubled
        spans = sorted((r.started, r.finished) for r in records)
        assert all(later[0] >= earlier[1] - 0.05 for earlier, later in zip(spans, spans[1:])), spans  # one at a time
    finally:
        submitter.close()
        for proc in (first, second):
            if proc and proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.mark.parametrize("name, ok", [("Ana Lima", True), ("ana@example.org", True), ("x" * 40, True), ("", False),
                                      (" ", False), ("x" * 41, False), ("<b>ana</b>", False), ("ana;path=/", False),
                                      ("-ana", False)])
def test_a_token_holders_name_is_checked_and_survives_its_cookie(name, ok):
    from backend import auth

    if not ok:
        with pytest.raises(ValueError, match=r"^name: .* \(allowed: 1 to 40 characters"):
            auth.check_name(name)
        assert auth.name_from_cookie(name) is None  # a forged cookie is ignored, not trusted
        return
    value = auth.name_cookie_value(name)
    assert ";" not in value and " " not in value and "'" not in value  # safe inside document.cookie = '...'
    assert auth.name_from_cookie(value) == name
