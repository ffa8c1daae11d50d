"""bench/team_load.py once at N = 5 people: every person's run is in the store once, succeeded, under their name.
Timings are recorded in its JSON, not asserted (the box is shared)."""
import json
import subprocess
import sys

from tests.browser.test_app_browser import _require_browser
from tests.conftest import REPO


def test_five_people_at_once_lose_and_double_no_run(tmp_path):
    _require_browser()
    out = tmp_path / "team_load.json"
    done = subprocess.run([sys.executable, "bench/team_load.py", "--people", "5", "--out", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    (phase,) = json.loads(out.read_text())["phases"]
    assert phase["people"] == 5 and phase["runs_lost"] == 0 and phase["runs_doubled"] == 0, phase
    assert phase["pressed_run"] == 5, phase["error_messages"]  # every person got as far as pressing Run
    assert all(r["queue_wait_s"] >= 0 and r["run_time_s"] > 0 for r in phase["runs_detail"])


def test_the_count_of_lost_and_doubled_runs_sees_both(monkeypatch, store):
    """The bench's accounting on a store made here: one person's run succeeded, one pressed Run and has none, one has
    two rows for their settings, one never got to Run (an error, not a lost run)."""
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    import team_load

    def row(i: int, status: str, owner: str, twin: str = "") -> str:
        config = {"seed": int(team_load.settings_of(5, i)["seed"])}
        rid = store.create(team_load.EXPERIMENT, config, f"digest-{i}{twin}", status="queued", owner=owner)
        store.update(rid, started=store.get(rid).created + 1)
        store.finish(rid, status)
        return rid

    people = [{"person": f"person-5-{i}", "run_id": None, "pressed_run": i < 3, "run_to_result_s": 5.0} for i in range(4)]
    row(0, "succeeded", "person-5-0")
    row(2, "succeeded", "person-5-2")
    row(2, "succeeded", "person-5-2", twin="b")
    counted = team_load.account(store, 5, people)
    assert (counted["lost"], counted["doubled"]) == (1, 1)
    assert [r["person"] for r in counted["rows"]] == ["person-5-0", "person-5-2"]
    assert counted["rows"][0]["queue_wait_s"] == 1.0
