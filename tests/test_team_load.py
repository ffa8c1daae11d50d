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
    assert phase["errors"] == 0, phase["error_messages"]
    assert len(phase["runs_detail"]) == 5 and all(r["queue_wait_s"] >= 0 and r["run_time_s"] > 0
                                                  for r in phase["runs_detail"])
