"""Shared page pieces: launching a run, the queue, live progress, a run's checks and downloads.
The settings form is pages/form.py, timelines pages/timeline.py, sign-in pages/sign_in.py.

Pages draw; everything they show comes from the run store. Nothing here computes a result.
Links are data, never markup: a run id from a URL is used only if it has the id format, and text a user
can influence (settings, error messages) is escaped before Markdown sees it.
"""
from __future__ import annotations

import contextvars
import importlib
import json
import math
import os
import re
import threading
import time
from pathlib import Path
from typing import Callable

import pandas as pd
import streamlit as st

from backend import experiments
from backend.config import ConfigError
from backend.device import describe
from backend.jobs import JobRunner, NotAllowed, QueuePlace, log_tail
from backend.store import ACTIVE, FINAL, QueueFull, RunRecord, RunStore, is_run_id
from pages.form import settings_form
from pages.markup import escape
from pages import render_log
from pages.navigation_guard import route_through_app
from pages.sign_in import current_user, is_admin, who_is_signed_in
from pages.tables import MISSING, number_format, readable, table, words  # noqa: F401  (every page's ui.table)

route_through_app()  # pages import this module first, so a page run alone reroutes through app.py

STATUS_ICON = {"queued": ":material/schedule:", "running": ":material/progress_activity:", "succeeded": ":material/check_circle:",
               "failed": ":material/error:", "cancelled": ":material/cancel:"}  # bundled: no emoji font needed
# The experiment of the page being drawn (per script run: Streamlit runs each in its own thread).
_page_experiment: contextvars.ContextVar[str | None] = contextvars.ContextVar("page_experiment", default=None)


def url_run_id(key: str = "run") -> str | None:
    """A run id from the URL, if it has the id format (12 hex digits); anything else is reported, not used."""
    value = st.query_params.get(key)
    if value is None:
        return None
    if not is_run_id(value):
        if re.fullmatch(r"[A-Za-z0-9_-]{1,64}", value):  # nothing Markdown acts on inside a code span
            st.warning(f"No run `{value}` in this server's store (a run id is 12 hex digits).")
        else:
            st.warning(f"The link's `{key}` is not a run id (12 hex digits), so it was ignored.")
        return None
    return value


def page_of(experiment: str) -> str:
    """The URL path of the page that draws an experiment's runs (the Runs page if no topic page does)."""
    from pages.catalog import SECTIONS

    name = experiments.canonical(experiment)
    return next((t.url_path for topics in SECTIONS.values() for t in topics if name in t.experiments), "runs")


def experiment_of(rec: RunRecord) -> str:
    """The experiment a stored run belongs to, by the name it has now (a run stored under an old name: ALIASES)."""
    return experiments.canonical(rec.experiment)


def result_of(rec: RunRecord) -> dict | None:
    """A stored run's result as pages read it: upgraded to its experiment's schema version, read by declared keys."""
    return experiments.open_result(rec.experiment, rec.result())


def all_experiments() -> list[experiments.Experiment]:
    """Every registered experiment, by name (the Overview's map and the Runs page's filter)."""
    return experiments.all_experiments()


def run_counts() -> dict[str, int]:
    """Runs on this server per experiment, by the name each has now (runs stored under an old name counted with it)."""
    counts: dict[str, int] = {}
    for stored, n in store().counts().items():
        name = experiments.canonical(stored)
        counts[name] = counts.get(name, 0) + n
    return counts


def runs_of(name: str, **filters) -> list[RunRecord]:
    """Stored runs of an experiment, newest first, whichever of its names (now or old) they were stored under."""
    return store().list(experiment=experiments.spellings(name), **filters)


@st.cache_resource
def runner() -> JobRunner:
    """One job runner per server process, shared by every browser session (the team's queue)."""
    return JobRunner()


def store() -> RunStore:
    return runner().store


@st.cache_resource
def warm_up() -> threading.Thread:
    """Once per server process, started by the first visit (app.py, before the sign-in form): the one-time work every
    page needs (every experiment module imported, Altair's schema validator built, the page helpers imported) in the
    background, so the first person to open a page does not wait for it (about 3 s of CPU on this box). Pages wait
    for it in sidebar() rather than import the same modules from two threads at once."""
    thread = threading.Thread(target=_warm, name="explorer-warm-up", daemon=True)
    thread.start()
    return thread


def _warm() -> None:
    experiments.all_experiments()
    import altair as alt

    alt.Chart(pd.DataFrame({"x": [0.0]})).mark_point().encode(x="x:Q").to_dict()  # builds the validator once
    for helper in sorted(Path(__file__).parent.glob("*_view.py")) + [Path("timeline.py"), Path("units.py")]:
        importlib.import_module(f"pages.{helper.stem}")


@st.cache_resource
def device_line() -> str:
    """The sidebar's device line (the device does not change while the server runs)."""
    info = describe()
    return f"**{info['name']}** · torch {info['torch']}  \nTriton {info['triton']} · {info['triton_mode']}"


def sidebar() -> None:
    warm_up().join()
    with st.sidebar:
        st.caption("Device")
        st.markdown(device_line())
        _queue()
        who_is_signed_in()


@st.fragment(run_every=2.0)
def _queue() -> None:
    """The team's queue, refreshed while the page is open (a run started elsewhere shows up here too)."""
    active = runner().queue()
    running = sum(rec.status == "running" for rec in active)
    st.caption(f"Job queue · {running} running, {len(active) - running} queued · cap {runner().max_jobs} at once")
    if not active:
        st.caption("No runs queued or running.")
    for rec in reversed(active):
        pct = f" {rec.progress:.0%}" if rec.status == "running" else ""
        st.caption(f"{STATUS_ICON[rec.status]} `{rec.id}` {escape(rec.experiment)}{pct} · {escape(rec.owner or '')}")
    mine = sum(rec.status == "queued" and rec.owner == current_user() for rec in active)
    if mine and st.button(f"Cancel my {mine} queued run(s)", key="cancel-mine"):
        runner().cancel_queued(current_user())


# --- one experiment's page ---------------------------------------------------------------------------
def experiment_page(name: str, render: Callable[[dict, RunRecord], None], intro: str = "",
                    page_params: tuple[str, ...] = ()) -> None:
    """Settings form -> job -> live progress -> checks, the page's own charts, downloads. `page_params` are the
    page's own URL parameters (a chosen view), kept in the URL when a run replaces the settings there."""
    exp = experiments.get(name)
    name = exp.name  # a page or a link may still use an old name
    _page_experiment.set(name)
    if intro:
        st.markdown(intro)
    run_id = url_run_id()
    shown = store().get(run_id) if run_id else None
    values = settings_form(exp, shown.config if shown and experiment_of(shown) == name else None)
    if values is not None:
        run_id = submit(name, values)
        if run_id is None:
            return
        kept = {k: st.query_params[k] for k in page_params if k in st.query_params}
        st.query_params.from_dict({**kept, **{k: str(v) for k, v in values.items()}, "run": run_id})
    elif run_id is None and _opens_on_the_default_run() and not any(f.name in st.query_params for f in exp.config_cls.fields()):
        run_id = submit(name, {})  # a first visit: the run of the defaults, found by its digest if it exists, else started now
        if run_id is None:  # the defaults over this server's budget, or a full queue
            return
        st.query_params["run"] = run_id
    if run_id:
        show_run(run_id, render)
    else:
        st.info("Choose settings and press **Run**; the charts below are drawn from that run.")
        latest = runs_of(name, statuses=("succeeded",), limit=1)
        if latest:
            st.caption(f"Or open the latest run of {name}: [{latest[0].id}](?run={latest[0].id})")


def submit(name: str, settings: dict) -> str | None:
    """Start a run of `name` (or find the stored run of the same settings) as the signed-in user; a refusal (a setting
    out of its range, over the server's budget, a full queue) is shown as an error naming the field, and gives None."""
    try:
        return runner().submit(name, settings, owner=current_user())
    except (ConfigError, QueueFull) as err:
        st.error(escape(str(err)))
        return None


def preset_buttons(name: str, per_row: int = 4) -> None:
    """An experiment's presets (its Config's `presets`, each with a one-line note in `preset_notes`) as buttons that
    put the preset's settings in the URL, for the form to show and the next Run to use."""
    config_cls = experiments.get(name).config_cls
    cols = st.columns(per_row)
    for i, (preset, values) in enumerate(config_cls.presets.items()):
        if cols[i % per_row].button(f"Preset: {preset}", help=config_cls.preset_notes[preset]):
            st.query_params.from_dict({k: str(v) for k, v in values.items()})
            st.rerun()


def _opens_on_the_default_run() -> bool:
    """A topic page opens on a result: its defaults' run. EXPLORER_OPEN_ON_DEFAULT_RUN=0 turns that off (the tests
    that draw every page without starting runs)."""
    return os.environ.get("EXPLORER_OPEN_ON_DEFAULT_RUN", "1") != "0"


def show_run(run_id: str, render: Callable[[dict, RunRecord], None] | None = None) -> None:
    """A run's status, checks, the page's own charts (render) and downloads. On a topic page, a run of another
    experiment is named and linked to its own page instead of being drawn with charts made for this one."""
    if not is_run_id(run_id):
        st.warning("That is not a run id (12 hex digits).")
        return
    rec = store().get(run_id)
    if rec is None:
        st.warning(f"No run `{run_id}` in this server's store.")
        return
    expected = _page_experiment.get()
    if render and expected and experiment_of(rec) != expected:
        st.warning(f"Run `{rec.id}` is a run of {escape(experiment_of(rec))}, not of {escape(expected)}: "
                   f"[open it on its page]({page_of(rec.experiment)}?run={rec.id}).")
        return
    if rec.status in ACTIVE:
        _live_status(run_id)  # draws its own header, so "queued" turns "running" as it happens
        return
    _header(rec)
    if rec.status != "succeeded":
        _stopped(rec)
        return
    result = result_of(rec)
    if result is None:
        st.error(f"Run {rec.id} succeeded but its result file is missing ({rec.result_path}).")
        return
    _checks(result)
    for note in result.get("notes", []):  # what the run says about its own figures, on every page alike
        st.info(escape(note), icon=":material/info:")
    if render:
        render(result, rec)
    _downloads(rec)


def _stopped(rec: RunRecord) -> None:
    """A run that failed, hit a limit or was cancelled: why (the message names the settings to lower), how far
    it got, what it had computed by then, and every rank's log."""
    st.error(escape(rec.error or rec.status))
    if rec.progress > 0:
        st.progress(rec.progress, text=f"Stopped at {rec.progress:.0%}: {escape(rec.progress_msg or '')} · "
                                       f"after {rec.duration_s or 0:.0f} s")
    partial = store().partial(rec.id)
    if partial:
        st.subheader("Results so far")
        st.caption(escape(partial.get("note", "")))
        if partial.get("metrics"):
            table(pd.DataFrame([{"metric": k, "value": str(v)} for k, v in partial["metrics"].items()]))
        for name, rows in partial.get("tables", {}).items():
            if rows:
                st.markdown(f"**{escape(name)}**")
                table(rows)
    log = log_tail(store(), rec.id, lines=200)
    if log:
        with st.expander("Log: every rank's traceback and, after a time limit, its stack", expanded=not partial):
            st.code(log, language=None)


def _header(rec: RunRecord) -> None:
    st.subheader(f"{STATUS_ICON[rec.status]} Run `{rec.id}` · {escape(experiment_of(rec))} · {rec.status}")


# How often a run view asks the store (each time the browser's timer fires: a message, a script run, a redraw). A
# running run's end is noticed within FAST_POLL_S; the next to start asks every NEXT_POLL_S (its start, then at the fast
# rate); one with others queued ahead changes only when one of those ends and asks every SLOW_POLL_S. Ten people
# waiting on one job slot then ask 4 + 2 + 8 = 14 times a second, not 20 (every view at 0.5 s), and each end is drawn
# sooner.
FAST_POLL_S, NEXT_POLL_S, SLOW_POLL_S = 0.25, 0.5, 1.0


def poll_s(rec: RunRecord, place: QueuePlace | None) -> float:
    """The run view's refresh period for a run in this state (place: the queued run's place, None otherwise)."""
    if rec.status != "queued" or place is None:
        return FAST_POLL_S
    return NEXT_POLL_S if place.ahead == 0 else SLOW_POLL_S


def _live_status(run_id: str) -> None:
    """A queued or running run's view, redrawn every poll_s; a change of period redraws the page, which sets it."""
    rec = store().get(run_id)
    period = poll_s(rec, runner().place(run_id) if rec.status == "queued" else None)
    st.fragment(_live_view, run_every=period)(run_id, period)


def _live_view(run_id: str, period: float) -> None:
    rec = store().get(run_id)
    render_log.write({"event": "tick", "run": run_id, "t": time.time()})  # when the browser's timer asked (bench)
    if rec.status in FINAL:
        render_log.write({"event": "final_seen", "run": run_id, "t": time.time(), "user": current_user()})
        st.rerun()
    place = runner().place(run_id) if rec.status == "queued" else None
    if poll_s(rec, place) != period:  # nearer the front, or started: the page sets the new period
        st.rerun()
    _header(rec)
    if place:
        when = (f"expected to start within about {place.wait_s:.0f} s (the cost estimates of the runs ahead, "
                f"upper bounds); at most {runner().max_jobs} run at a time on this server"
                if math.isfinite(place.wait_s) else "this server starts no runs itself (EXPLORER_MAX_JOBS = 0)")
        st.info(f"Queued: position {place.ahead + 1}, behind {place.running} running and {place.ahead} queued "
                f"run(s); {when}.")
    elif rec.status == "running":
        elapsed = time.time() - (rec.started or time.time())
        st.progress(rec.progress, text=f"{rec.progress:.0%} · {rec.progress_msg or 'starting ranks'} · {elapsed:.0f} s (timeout {rec.timeout_s:g} s)")
    refused = f"cancel-refused-{run_id}"  # kept: this fragment redraws itself
    if st.button("Cancel run", key=f"cancel-{run_id}"):
        try:
            runner().cancel(run_id, by=current_user(), admin=is_admin())
        except NotAllowed as err:
            st.session_state[refused] = str(err)
    if refused in st.session_state:
        st.error(escape(st.session_state[refused]))


def _checks(result: dict) -> None:
    checks = result.get("checks", [])
    if not checks:
        st.warning("This run made no check against a reference.")
        return
    failed = [c for c in checks if not c["passed"]]
    if failed:
        st.error(f"{len(failed)} of {len(checks)} checks against independent references failed.")
    else:
        st.success(f"All {len(checks)} checks against independent references passed.")
    with st.expander("Checks: error against each reference", expanded=bool(failed)):
        table(pd.DataFrame(checks)[["passed", "name", "error", "tolerance", "reference", "detail"]])


def _downloads(rec: RunRecord) -> None:
    cols = st.columns([1, 1, 3])
    with cols[0]:
        st.download_button("Result JSON", json.dumps(rec.result(), indent=1), file_name=f"{rec.id}-result.json",
                           mime="application/json", key=f"dl-result-{rec.id}")
    trace = rec.trace_bytes()
    with cols[1]:
        if trace:
            st.download_button("Trace (Chrome JSON)", trace, file_name=f"{rec.id}-trace.json",
                               mime="application/json", key=f"dl-trace-{rec.id}",
                               help="Opens in ui.perfetto.dev or chrome://tracing")
    with cols[2]:
        st.caption(f"Link to this run: add `?run={rec.id}` to this page's address. "
                   f"Code version {rec.code_version} · {rec.duration_s or 0:.1f} s.")


def resume_button(experiment: str) -> None:
    """On a failed run of `experiment` that left a checkpoint: resume it as a new run whose record names it as its
    parent (the runner finds the checkpoint from the store, never from the URL)."""
    run_id = url_run_id()
    rec = store().get(run_id) if run_id and is_run_id(run_id) else None
    if rec is None or experiment_of(rec) != experiment or rec.status != "failed":
        return
    why = runner().why_not_resumable(rec.id)
    if why:
        st.caption(f"Cannot be resumed: {escape(why)}")
        return
    if st.button("Resume from its newest checkpoint", help="A new run with the same settings that loads this run's "
                 "last complete checkpoint and finishes it; it names this run as its parent."):
        try:
            child = runner().resume(rec.id, owner=current_user())
        except (ConfigError, QueueFull) as err:
            st.error(escape(str(err)))
            return
        st.query_params["run"] = child
        st.rerun()
