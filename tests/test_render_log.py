"""The server's own time per script run (pages/render_log.py), which bench/team_load.py lays beside the browser's,
and the run view's refresh period (pages/live_view.poll_s)."""
import json
import time
from types import SimpleNamespace

import pytest
from streamlit.testing.v1 import AppTest

from backend.jobs import QueuePlace
from pages import render_log
from tests.conftest import REPO

# pages.ui is imported inside the tests that use it: imported here, at collection, it would be imported before any
# AppTest ran the app, and a page switched to would then run alone, without app.py (pages/navigation_guard.py).


def test_a_script_run_is_logged_with_its_wall_and_cpu_time_even_when_it_stops(tmp_path, monkeypatch):
    log = tmp_path / "render.jsonl"
    monkeypatch.setenv("EXPLORER_RENDER_LOG", str(log))
    with pytest.raises(RuntimeError):  # st.stop and st.rerun end a script by raising: still one line
        with render_log.script_run(lambda: {"user": "ana", "page": "runs"}):
            end = time.thread_time() + 0.05
            while time.thread_time() < end:  # 50 ms of this thread's CPU
                pass
            raise RuntimeError("stopped")
    (line,) = [json.loads(x) for x in log.read_text().splitlines()]
    assert (line["event"], line["user"], line["page"]) == ("script", "ana", "runs")
    assert 0.05 <= line["cpu_s"] <= line["t1"] - line["t0"] + 0.01


def test_nothing_is_written_unless_the_log_is_asked_for(tmp_path, monkeypatch):
    monkeypatch.delenv("EXPLORER_RENDER_LOG", raising=False)
    monkeypatch.chdir(tmp_path)
    with render_log.script_run(lambda: {"user": "ana"}):
        pass
    render_log.write({"event": "final_seen"})
    assert list(tmp_path.iterdir()) == []


def test_the_app_logs_who_opened_which_page(tmp_path, monkeypatch):
    log = tmp_path / "render.jsonl"
    monkeypatch.setenv("EXPLORER_RENDER_LOG", str(log))
    monkeypatch.setenv("EXPLORER_OPEN_ON_DEFAULT_RUN", "0")
    at = AppTest.from_file(str(REPO / "app.py"), default_timeout=60)
    at.run()  # the default page (a switch_page in a worker that imported pages.ui earlier runs the page without app.py)
    assert not at.exception
    events = [json.loads(x) for x in log.read_text().splitlines()]
    lines = [e for e in events if e["event"] == "script"]
    assert [(e["event"], e["run"]) for e in lines] == [("script", None)]  # one line per script run
    assert isinstance(lines[0]["page"], str)  # (the default page's name; AppTest may leave it unnamed)
    assert lines[0]["user"]  # on loopback: this machine's user
    (queue,) = [e for e in events if e["event"] == "queue_tick"]  # the sidebar's queue drawn once, by the same user
    assert queue["user"] == lines[0]["user"] and lines[0]["t0"] <= queue["t"] <= lines[0]["t1"]


def _rec(status: str) -> SimpleNamespace:
    return SimpleNamespace(id="0" * 12, status=status)  # poll_s reads the status only


@pytest.mark.parametrize("status, ahead, period", [
    ("running", None, "FAST_POLL_S"), ("queued", 0, "NEXT_POLL_S"), ("queued", 1, "SLOW_POLL_S"),
    ("queued", 9, "SLOW_POLL_S")])
def test_a_run_view_polls_faster_the_nearer_its_run_is_to_its_end(status, ahead, period):
    from pages import live_view

    place = QueuePlace(running=1, ahead=ahead, wait_s=10.0) if ahead is not None else None
    assert live_view.poll_s(_rec(status), place) == getattr(live_view, period)
    # bench/team_load.py's target is Run-to-result within 1 s of queue + run: the view's share is at most its period
    assert live_view.FAST_POLL_S <= 0.25 and live_view.FAST_POLL_S < live_view.NEXT_POLL_S < live_view.SLOW_POLL_S <= 1.0
