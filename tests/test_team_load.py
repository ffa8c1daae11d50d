"""bench/team_load.py once at N = 5 people (warm browser cache): every person's run is in the store once, succeeded,
under their name.
Timings are recorded in its JSON, not asserted (the box is shared)."""
import json
import os
import subprocess
import sys

import pytest

from tests.browser.test_app_browser import _require_browser
from tests.conftest import REPO


def test_five_people_at_once_lose_and_double_no_run(tmp_path):
    _require_browser()
    out = tmp_path / "team_load.json"
    done = subprocess.run([sys.executable, "bench/team_load.py", "--people", "5", "--layout", "shared", "--cache",
                           "warm", "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    phases = json.loads(out.read_text())["phases"]
    # all 5 arrive together, once (the "once in CI"; the bench's own passes add the cold browser cache)
    assert [(p["people"], p["cache"]) for p in phases] == [(5, "warm")]
    for phase in phases:
        assert phase["runs_lost"] == 0 and phase["runs_doubled"] == 0, phase
        assert phase["pressed_run"] == 5, phase["error_messages"]  # every person got as far as pressing Run
        assert not phase["stalled_views"], phase["stalled_views"]  # each saw their result (the way it stopped, if not)
        assert all(r["queue_wait_s"] >= 0 and r["run_time_s"] > 0 for r in phase["runs_detail"])
        renders = [s for p in phase["people_detail"] for s in p["first_render_split"]]
        assert len(renders) == 10 and all(s["first_message_s"] is not None for s in renders)


def test_people_on_the_wire_open_pages_press_run_and_read_their_result(tmp_path):
    """The "own" layout, once: three people arrive together, one in Chromium and two speaking Streamlit's protocol
    (bench/wire_person.py), as browsers elsewhere do. Each opens both pages, their Run reaches the server's queue under
    their own name and they read its verdict (a press the server did not take, or a page whose timers were not fired,
    leaves their run lost or their verdict unseen)."""
    _require_browser()
    out = tmp_path / "team_load.json"
    done = subprocess.run([sys.executable, "bench/team_load.py", "--people", "3", "--layout", "own", "--cache", "warm",
                           "--rounds", "1", "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (phase,) = json.loads(out.read_text())["phases"]
    assert (phase["layout"], phase["in_chromium"], phase["on_the_wire"]) == ("own", 1, 2)
    assert phase["errors"] == 0, phase["error_messages"]
    assert phase["runs_lost"] == phase["runs_doubled"] == 0 and not phase["stalled_views"]
    wire = [p for p in phase["people_detail"] if p["kind"] == "wire"]
    assert all(len(p["first_render_s"]) == 2 and p["run_to_result_s"] > 0 for p in wire)
    assert sorted(r["person"] for r in phase["runs_detail"]) == sorted(p["person"] for p in phase["people_detail"])


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


def test_the_server_part_of_a_render_and_of_a_runs_overhead_is_read_off_its_own_log(monkeypatch, store):
    """The bench's split on a store and a render log made here: the render is matched to that person's first script
    run of that page after the navigation (not another person's, not an earlier one), and a run's overhead splits
    into submit, notice, result and browser parts that sum to it, a late notice landing in notice_s."""
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    import team_load

    rid = store.create(team_load.EXPERIMENT, {"seed": 50_000}, "digest", status="queued", owner="person-5-0")
    created = store.get(rid).created
    store.update(rid, started=created + 3.0)
    store.finish(rid, "succeeded")
    store.update(rid, finished=created + 5.0)
    clicked, seen, drawn = created - 0.4, created + 7.0, (created + 7.05, created + 7.35)
    events = [
        {"event": "script", "t0": created - 0.1, "t1": created + 0.05, "cpu_s": 0.01, "user": "person-5-0",
         "page": "number_formats", "run": rid},  # the script run that queued it
        *({"event": "tick", "run": rid, "t": created + t} for t in (4.5, 4.75, 6.75, 7.0)),
        {"event": "script", "t0": 100.0, "t1": 100.2, "cpu_s": 0.1, "user": "person-5-0", "page": "number_formats"},  # before
        {"event": "script", "t0": 101.0, "t1": 101.9, "cpu_s": 0.5, "user": "person-5-1", "page": "number_formats"},  # another
        {"event": "script", "t0": 101.2, "t1": 101.5, "cpu_s": 0.05, "user": "person-5-0", "page": "number_formats"},
        {"event": "script", "t0": 101.6, "t1": 101.7, "cpu_s": 0.01, "user": "person-5-0", "page": "number_formats"},
        {"event": "final_seen", "run": rid, "t": seen},
        {"event": "script", "t0": drawn[0], "t1": drawn[1], "cpu_s": 0.2, "user": "person-5-0", "page": "number_formats",
         "run": rid},
    ]
    person = {"person": "person-5-0", "first_render_at": [101.0], "first_render_s": [1.5],
              "first_render_page": ["number_formats"], "clicked_at": clicked}
    (render,) = team_load.server_renders(events, [person])
    assert (render["server_s"], render["server_cpu_s"], render["before_s"]) == (0.3, 0.05, 0.2)

    row = {"person": "person-5-0", "run": rid, "run_to_result_s": 8.0}
    row["overhead_s"] = row["run_to_result_s"] - 5.0  # minus queue (3 s) and run (2 s), as account() does
    team_load.server_overhead(events, [person], store, [row])
    assert (row["click_s"], row["submit_s"], row["notice_s"], row["result_s"]) == (0.3, 0.1, 2.0, 0.35)
    assert row["tick_gap_s"] == 2.0  # the view noticed 2 s late because its ticks came 2 s apart
    assert row["browser_s"] == round(clicked + 8.0 - drawn[1], 3)
    parts = row["click_s"] + row["submit_s"] + row["notice_s"] + row["result_s"] + row["browser_s"]
    assert abs(parts - row["overhead_s"]) < 0.003
    assert row["server_overhead_s"] == 2.45


def test_the_servers_targets_fail_when_its_share_is_over(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    import team_load

    met = team_load.server_targets({"first_render_server_p95_s": 0.3, "overhead_server_p95_s": 0.9})
    assert all(met.values())
    missed = team_load.server_targets({"first_render_server_p95_s": 3.2, "overhead_server_p95_s": 1.4})
    assert not any(missed.values())
    assert not any(team_load.server_targets({}).values())  # nothing measured is not a pass


def test_a_first_render_splits_into_parts_that_sum_to_it(monkeypatch):
    """The page's own marks (ms from its navigation's start) cut the bench's time into the navigation's start, the
    document, the JS/CSS, the WebSocket's opening, the server's first message and the drawing; a missing mark adds
    nothing to its part."""
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    import team_load

    marks = {"time_origin": 1_000_050.0, "response_end": 100.0, "dom_content_loaded": 600.0, "ws_open": 900.0,
             "first_message": 1000.0}
    split = team_load.render_split(marks, {"renderer_task_s": 0.7}, 2.0, 1000.0)
    assert (split["start_s"], split["html_s"], split["assets_s"], split["connect_s"], split["first_message_s"],
            split["draw_s"]) == (0.05, 0.1, 0.5, 0.3, 0.1, 0.95)
    assert split["renderer_task_s"] == 0.7
    gone = team_load.render_split({**marks, "ws_open": None}, {}, 2.0, 1000.0)  # no WebSocket mark: no connect part
    assert (gone["connect_s"], gone["first_message_s"], gone["draw_s"]) == (0.0, 0.4, 0.95)
    for s in (split, gone):
        parts = ("start_s", "html_s", "assets_s", "connect_s", "first_message_s", "draw_s")
        assert abs(sum(s[k] for k in parts) - 2.0) < 1e-9


_BURN = "import time\nend = time.process_time() + {s}\nwhile time.process_time() < end: pass\n"


def _cpu_of_waited(proc) -> float:
    """The kernel's own count of a finished child's CPU (and its waited-for children's): os.wait4's rusage."""
    _, _, usage = os.wait4(proc.pid, 0)
    proc.returncode = 0
    return usage.ru_utime + usage.ru_stime


@pytest.mark.parametrize("broken", [False, True])
def test_the_sampler_splits_cpu_between_the_server_its_runs_and_the_browser(broken, monkeypatch):
    """A 'server' child whose own child burns 0.8 s (a run) and a second child of the bench burning 0.8 s (Chromium):
    each part within one sample's loss of the kernel's count for that child (os.wait4). With the server's
    descendants not looked up (the rule broken), the run's CPU lands in the browser's part and the check fails."""
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    import team_load

    if broken:
        real = team_load.limits.descendants
        monkeypatch.setattr(team_load.limits, "descendants", lambda root: [] if root != os.getpid() else real(root))
    server = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time\n"
                               f"subprocess.run([sys.executable, '-c', {_BURN.format(s=0.8)!r}])\ntime.sleep(0.6)"])
    sampler = team_load.ProcessSampler(server.pid)
    browser = subprocess.Popen([sys.executable, "-c", _BURN.format(s=0.8)])
    run_and_server, browser_cpu = _cpu_of_waited(server), _cpu_of_waited(browser)
    parts = sampler.stop()["cpu_s"]
    ok = (abs(parts["server"] + parts["runs"] - run_and_server) < 0.35 and parts["runs"] > 0.4
          and abs(parts["chromium"] - browser_cpu) < 0.35)
    assert ok != broken, (parts, run_and_server, browser_cpu)


def test_a_view_that_stopped_ticking_is_named_with_its_last_ticks(monkeypatch, store):
    """A person who pressed Run and never saw the verdict: their run (succeeded), the last tick of its view 3 s before
    the run ended, their sidebar still ticking 20 s after, read off the server's log; a person who saw theirs is left out."""
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    import team_load

    rid = store.create(team_load.EXPERIMENT, {"seed": int(team_load.settings_of(5, 1)["seed"])}, "d", status="queued",
                       owner="person-5-1")
    store.update(rid, started=store.get(rid).created + 1)
    store.finish(rid, "succeeded")
    end = store.get(rid).finished
    events = [{"event": "tick", "run": rid, "t": end - t} for t in (5.0, 4.0, 3.0)]
    events += [{"event": "queue_tick", "user": "person-5-1", "t": end + t} for t in (10.0, 20.0)]
    events += [{"event": "queue_tick", "user": "person-5-0", "t": end + 50.0},
               {"event": "script", "user": "person-5-1", "t0": end - 6.0, "t1": end - 5.5, "cpu_s": 0.01}]
    people = [{"person": "person-5-0", "pressed_run": True, "run_to_result_s": 4.0},
              {"person": "person-5-1", "pressed_run": True, "run_to_result_s": None, "clicked_at": end - 8.0}]
    (stalled,) = team_load.stalled_views(events, people, store, 5)
    assert (stalled["person"], stalled["run"], stalled["status"], stalled["from"]) == (
        "person-5-1", rid, "succeeded", "the run's end")
    assert (stalled["last_view_tick_s"], stalled["last_queue_tick_s"], stalled["last_script_s"]) == (-3.0, 20.0, -6.0)
    assert stalled["candidate"].startswith("dropped") and stalled["watchdog_redraws"] == 0


@pytest.mark.parametrize("case", ["dropped", "raised", "every timer", "ticks went on"])
def test_a_stalled_view_is_matched_to_the_way_it_stopped(monkeypatch, store, case):
    """The stalled person's log laid against the candidates: view ticks ending while the sidebar's go on, with no
    script run after (dropped) or one (raised); no tick of either after the view's last (every timer); view ticks
    past the run's end (ticks went on)."""
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    import team_load

    rid = store.create(team_load.EXPERIMENT, {"seed": 1}, "d", status="queued", owner="p")
    store.update(rid, started=store.get(rid).created + 1)
    store.finish(rid, "succeeded")
    end = store.get(rid).finished
    view_end = end + 2.0 if case == "ticks went on" else end - 3.0
    events = [{"event": "tick", "run": rid, "t": view_end - t} for t in (2.0, 1.0, 0.0)]
    if case != "every timer":
        events += [{"event": "queue_tick", "user": "p", "t": view_end + 5.0}]
    if case == "raised":
        events += [{"event": "script", "user": "p", "t0": view_end + 1.0, "t1": view_end + 1.2, "cpu_s": 0.1}]
    assert team_load.stall_candidate(events, "p", store.get(rid)).startswith(case)
