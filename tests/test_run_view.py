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


@pytest.fixture
def app():
    try:
        yield AppTest.from_string(PAGE, default_timeout=60)
    finally:
        sys.modules["__main__"] = MAIN


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
    from pages import run_view

    monkeypatch.setattr(run_view, "_url_names", lambda run_id: True)
    earlier, started, (exp, config) = runs
    app.query_params["run"] = started
    app.run()
    _end(started, exp, config)
    assert any(f"Run `{earlier}`" in h for h in _headings(_fragment_run(app, {"run": earlier})))
