"""The run view's live fragment and the URL its redraw runs at (the browser walk's stale-run-id flake).

A fragment's run carries the URL of the browser request that asked for it, and st.rerun() inside it reruns the whole
page at that URL. The browser sends the URL it knows: a timer's request sent (or queued on the server behind the Run
click's script run) before the browser saw the URL that Run put there carries the previous run's URL. The fragment
itself is the new run's (its id is its call site, and the click's run registered the new closure), so when that run
ends the page was redrawn at the old URL: the old run drawn over the one just started (walk: the mesh page's zb_v run
"moved" to another run id, paged_attention's run heading never came). These tests drive that fragment run through
Streamlit's own script runner, with the stale URL, deterministically."""
import functools
import sys

import pytest
from streamlit.runtime.scriptrunner_utils.script_requests import RerunData
from streamlit.testing.v1 import AppTest


MAIN = sys.modules["__main__"]  # pytest's; AppTest makes its script __main__, which the ranks' fork server would re-run
PAGE = """
import streamlit as st
from pages import run_view
run_view.show_run(st.query_params["run"])  # the run the URL names, as ui.experiment_page and the Runs page draw it
"""


def _app_test(source: str):
    """An AppTest of `source`, with __main__ put back after it (AppTest replaces it)."""
    try:
        yield AppTest.from_string(source, default_timeout=60)
    finally:
        sys.modules["__main__"] = MAIN


@pytest.fixture
def app():
    yield from _app_test(PAGE)


def _fragment_run(at: AppTest, url: dict) -> AppTest:
    """One run of the page's live fragment (the only one registered), as a browser timer's request asks for it, with
    the URL that request carried."""
    from streamlit.testing.v1 import local_script_runner

    (fragment_id,) = at._fragment_storage._fragments
    at.query_params.clear()
    at.query_params.update(url)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(local_script_runner, "RerunData", functools.partial(RerunData, fragment_id_queue=[fragment_id]))
        return at.run()


def _headings(at: AppTest) -> list[str]:
    return [h.value for h in at.subheader]


@pytest.fixture(scope="module")
def earlier() -> str:
    """The page's previous run, ended."""
    from tests.sweep import recorded

    return recorded("comm.selftest", {"world_size": "1"})


@pytest.fixture
def runs(earlier):
    """The earlier run, and a run started after it, still running when the page draws it (and how to end it)."""
    from backend import experiments
    from backend.store import RunStore

    exp = experiments.get("comm.selftest")
    config = exp.make_config({"world_size": "2"})
    started = RunStore().create(exp.name, config.to_dict(), "test-run-view", status="running", timeout_s=120)
    return earlier, started, (exp, config)


def _end(started: str, exp, config) -> None:
    from backend import experiments, record
    from backend.store import RunStore

    page, sys.modules["__main__"] = sys.modules["__main__"], MAIN
    try:
        report = record.run_recorded(exp, config, experiments.RunContext(timeout_s=120), RunStore(), started)
    finally:
        sys.modules["__main__"] = page
    assert report["status"] == "succeeded", report.get("error")


def test_a_fragment_request_with_a_stale_url_does_not_redraw_the_page_at_it(app, runs):
    """The page draws the started run live; it ends; a timer's request still carrying the earlier run's URL runs the
    fragment: the page is not redrawn at that URL (the earlier run is not drawn); the next request, with the page's
    URL, redraws the page on the ended run."""
    earlier, started, (exp, config) = runs
    app.query_params["run"] = started
    app.run()
    assert any(f"Run `{started}`" in h and "running" in h for h in _headings(app)), _headings(app)
    _end(started, exp, config)
    stale = _fragment_run(app, {"run": earlier})
    assert not any(earlier in h for h in _headings(stale)), f"the page was redrawn on the earlier run: {_headings(stale)}"
    fresh = _fragment_run(app, {"run": started})
    assert any(f"Run `{started}`" in h and "succeeded" in h for h in _headings(fresh)), _headings(fresh)


def test_with_the_redraw_at_whatever_url_the_request_carried_the_earlier_run_is_drawn(app, runs, monkeypatch):
    """The rule broken (the fragment redraws the page at any URL its request carried, as before the fix): the stale
    request puts the earlier run on the page, the walk's flake."""
    from pages import live_view

    monkeypatch.setattr(live_view, "_url_names", lambda run_id: True)
    earlier, started, (exp, config) = runs
    app.query_params["run"] = started
    app.run()
    _end(started, exp, config)
    assert any(f"Run `{earlier}`" in h for h in _headings(_fragment_run(app, {"run": earlier})))


# --- a live view that lost its timer (issue #31's stalled person) ---------------------------------------------------
# The browser's timer for a fragment lives until the next full run starts (it clears every timer, and only fragments
# that run re-registers get one again); the server drops a timer's request for a fragment id its storage no longer
# holds (AppSession.request_rerun), silently, while the browser keeps firing. So a view stops polling, for good, when:
# - "dropped": its fragment leaves the storage while its timer lives. With runner.fastReruns (on by default) a Run
#   click starts a new script runner while the page's previous full run finishes on its own thread; that run's
#   storage.clear() keeps only the fragments it registered (the sidebar's queue), removing the run view the new run
#   registered a moment before (the sidebar keeps ticking, the view does not);
# - "raised": a full run (the view's own redraw when its run moves up or starts) stops before it reaches the view: an
#   exception in the page (a store read that failed under load) or st.stop; the browser cleared the view's timer at
#   that run's start and nothing sets it again.
# - "lost" (read in the code, not reproduced here: it needs the server's event loop): a full run's last messages, the
#   view's auto_rerun among them, are ignored when a timer's request finds that run's runner just stopped and starts a
#   new one before the loop forwarded them (AppSession ignores a non-current runner's events); the page then shows
#   part of the run's output and no timer for the view. The watchdog covers it as it covers "dropped".
# Ruled out by reading Streamlit 1.67: an exception inside the view's fragment (its timer is kept: the next tick
# retries), a fragment run's st.rerun() (a full run in the same runner, which re-registers the view), the sidebar
# fragment's runs (they clear only their own descendants' timers; the view is not one), a timer request coalesced
# with another (fragment ids are merged, a full run outranks both and redraws the view), widget interactions (none in
# the bench after the click).
QUEUE_PAGE = """
import streamlit as st
from pages import run_view, ui
ui._queue()  # the sidebar's queue fragment, drawn first as ui.sidebar() draws it
run_view.show_run(st.query_params["run"])
"""


@pytest.fixture
def page_with_queue():
    yield from _app_test(QUEUE_PAGE)


def _run_fragment(at: AppTest, fragment_id: str, url: dict) -> AppTest:
    from streamlit.testing.v1 import local_script_runner

    at.query_params.clear()
    at.query_params.update(url)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(local_script_runner, "RerunData", functools.partial(RerunData, fragment_id_queue=[fragment_id]))
        return at.run()


def _lose_the_view_timer(at: AppTest, how: str, started: str, view_id: str, queue_id: str, monkeypatch) -> None:
    """The view's timer lost, one of the two ways above."""
    from pages import run_view

    if how == "dropped":  # the previous full run's storage.clear(): it had drawn the sidebar's queue only
        at._fragment_storage.clear(new_fragment_ids=frozenset({queue_id}))
        assert not at._fragment_storage.contains(view_id)
        return
    real = run_view.store

    def failing():
        raise RuntimeError("database is locked")  # what a store read under load raises

    monkeypatch.setattr(run_view, "store", failing)
    at.query_params.clear()
    at.query_params["run"] = started
    at.run()  # the view's redraw, stopped by the exception before the view
    assert at.exception
    monkeypatch.setattr(run_view, "store", real)


def _stalled(page_with_queue, runs, how, monkeypatch):
    """A page drawing a running run live, whose view then lost its timer; the run ends; the view's own timer is
    gone (a tick of it draws nothing), so only the sidebar's timer still reaches the server. Returns what the next
    sidebar tick drew, and the run."""
    from pages import live_view

    earlier, started, (exp, config) = runs
    at = page_with_queue
    at.query_params["run"] = started
    at.run()
    queue_id, view_id = list(at._fragment_storage._fragments)  # registered in this order
    _lose_the_view_timer(at, how, started, view_id, queue_id, monkeypatch)
    _end(started, exp, config)
    if how == "dropped":  # its timer still fires, into nothing: no tick, no redraw
        assert not any("succeeded" in h for h in _headings(_run_fragment(at, view_id, {"run": started})))
    live = at.session_state[live_view.LIVE_KEY]
    live[started] -= live_view.STALE_S + 1  # its last tick longer ago than the watchdog allows
    at.session_state[live_view.LIVE_KEY] = live
    return _run_fragment(at, queue_id, {"run": started}), started


@pytest.mark.parametrize("how", ["dropped", "raised"])
def test_a_view_that_lost_its_timer_is_redrawn_with_its_result_by_the_sidebars_tick(page_with_queue, runs, how,
                                                                                     monkeypatch):
    at, started = _stalled(page_with_queue, runs, how, monkeypatch)
    assert any(f"Run `{started}`" in h and "succeeded" in h for h in _headings(at)), _headings(at)
    assert not at.exception


@pytest.mark.parametrize("how", ["dropped", "raised"])
def test_without_the_watchdog_a_view_that_lost_its_timer_never_shows_its_result(page_with_queue, runs, how,
                                                                                monkeypatch):
    """The rule broken (the sidebar's tick does not watch the view): the run ended, the page never says so."""
    from pages import ui

    monkeypatch.setattr(ui, "watchdog", lambda: None)
    at, started = _stalled(page_with_queue, runs, how, monkeypatch)
    assert not any("succeeded" in h for h in _headings(at)), _headings(at)


@pytest.mark.parametrize("broken", [False, True])
def test_a_view_that_ticks_is_not_redrawn_by_the_watchdog(page_with_queue, runs, broken, monkeypatch):
    """A live view whose last tick is recent: the sidebar's tick draws the sidebar only (no full redraw per tick).
    With the staleness rule broken (any view counts as stalled), the page is redrawn."""
    from pages import live_view

    if broken:
        monkeypatch.setattr(live_view, "STALE_S", -1.0)
    earlier, started, (exp, config) = runs
    at = page_with_queue
    at.query_params["run"] = started
    at.run()
    queue_id, view_id = list(at._fragment_storage._fragments)
    _end(started, exp, config)
    redrawn = any("succeeded" in h for h in _headings(_run_fragment(at, queue_id, {"run": started})))
    assert redrawn == broken


# --- a change of the view's period (queued -> next -> running) -------------------------------------------------------
def _timers(monkeypatch) -> list[tuple[str, float]]:
    """Every fragment timer the script sends the browser from now on: (fragment id, interval)."""
    from streamlit.runtime.scriptrunner_utils.script_run_context import ScriptRunContext

    sent, real = [], ScriptRunContext.enqueue

    def spy(self, msg):
        if msg.WhichOneof("type") == "auto_rerun":
            sent.append((msg.auto_rerun.fragment_id, round(msg.auto_rerun.interval, 3)))
        real(self, msg)

    monkeypatch.setattr(ScriptRunContext, "enqueue", spy)
    return sent


def _moved(app, runs, monkeypatch) -> tuple[list, str, AppTest]:
    """The page draws a running run live; its state then asks for another period (as a queued run's does when it
    moves up or starts); one tick of the view's timer, then a second. Returns the timers sent, the view's id and
    the page after the ticks."""
    from pages import live_view

    earlier, started, _ = runs
    app.query_params["run"] = started
    sent = _timers(monkeypatch)
    app.run()
    (view_id,) = app._fragment_storage._fragments
    assert sent == [(view_id, live_view.FAST_POLL_S)]
    monkeypatch.setattr(live_view, "poll_s", lambda rec, place: 1.0)
    for _ in range(2):
        at = _fragment_run(app, {"run": started})
    return sent, view_id, at


def test_a_tick_that_finds_a_new_period_sets_its_timer_without_redrawing_the_page(app, runs, monkeypatch):
    """The view's tick sets the browser's timer for itself to the new period once (the next tick sends nothing), and
    the page is not redrawn: still the live view, its fragment the only one registered."""
    sent, view_id, at = _moved(app, runs, monkeypatch)
    assert sent[1:] == [(view_id, 1.0)], sent
    assert any("running" in h for h in _headings(at)) and list(at._fragment_storage._fragments) == [view_id]


def test_without_setting_the_period_the_view_keeps_its_first_timer(app, runs, monkeypatch):
    """The rule broken (the tick does not set the new period): the browser's timer stays at the first period."""
    from pages import live_view

    monkeypatch.setattr(live_view, "_set_period", lambda run_id, period: None)
    sent, view_id, _ = _moved(app, runs, monkeypatch)
    assert sent[1:] == [], sent


# --- a running run's end, noticed within the tick that is waiting for it ----------------------------------------------
def _tick_as_it_ends(app, runs, wait_s: float, monkeypatch) -> list[str]:
    """The page draws a running run live; the view's timer ticks; the run ends 1 s into that tick (recorded in the store
    by another thread, as its leader does). Returns the headings after that one tick."""
    import threading

    from backend.store import RunStore
    from pages import live_view

    monkeypatch.setattr(live_view, "END_WAIT_S", wait_s)
    _, started, _ = runs
    app.query_params["run"] = started
    app.run()
    assert any("running" in h for h in _headings(app)), _headings(app)
    ender = threading.Timer(1.0, lambda: RunStore().finish(started, "cancelled", error="ended by the test"))
    ender.start()
    try:
        return _headings(_fragment_run(app, {"run": started}))
    finally:
        ender.join()


def test_a_tick_notices_the_run_ending_while_it_waits(app, runs, monkeypatch):
    """The tick waits on the server for the running run's end: the end 1 s in is drawn by that same tick (the page
    redrawn with the ended run), not by a later one."""
    headings = _tick_as_it_ends(app, runs, 5.0, monkeypatch)
    assert any("cancelled" in h for h in headings), headings


def test_without_the_wait_the_tick_draws_the_run_still_running(app, runs, monkeypatch):
    """The rule broken (no wait): the tick reads the store once and draws the run as running; its end waits for the
    browser's next tick."""
    headings = _tick_as_it_ends(app, runs, 0.0, monkeypatch)
    assert any("running" in h for h in headings) and not any("cancelled" in h for h in headings), headings
