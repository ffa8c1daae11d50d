"""A run's view: its status while queued or running (pages/live_view.py, redrawn as it moves), then its checks, notes, the page's own
charts and downloads; a run stopped early shows why, how far it got and its log. Pages reach it through pages/ui.py."""
from __future__ import annotations

import contextvars
import json
import time
from typing import Callable

import pandas as pd
import streamlit as st

from backend.config import ConfigError
from backend.jobs import log_tail
from backend.store import ACTIVE, QueueFull, RunRecord, is_run_id
from pages.live_view import LIVE_KEY, header, live_status
from pages import render_log
from pages.markup import escape
from pages.server import experiment_of, page_of, result_of, runner, store, url_run_id
from pages.sign_in import current_user
from pages.tables import table

# The experiment of the page being drawn (per script run: Streamlit runs each in its own thread).
page_experiment: contextvars.ContextVar[str | None] = contextvars.ContextVar("page_experiment", default=None)


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
    expected = page_experiment.get()
    if render and expected and experiment_of(rec) != expected:
        st.warning(f"Run `{rec.id}` is a run of {escape(experiment_of(rec))}, not of {escape(expected)}: "
                   f"[open it on its page]({page_of(rec.experiment)}?run={rec.id}).")
        return
    if rec.status in ACTIVE:
        live_status(run_id)  # draws its own header, so "queued" turns "running" as it happens
        return
    st.session_state.get(LIVE_KEY, {}).pop(run_id, None)  # its result is drawn: nothing left to watch
    header(rec)
    if rec.status != "succeeded":
        _stopped(rec)
        return
    result = result_of(rec)
    if result is None:
        st.error(f"Run {rec.id} succeeded but its result file is missing ({rec.result_path}).")
        return
    render_log.write({"event": "verdict", "run": rec.id, "t": time.time()})  # the checks' verdict drawn (bench)
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
    """The run's result and trace, read from the store when clicked (a result can be tens of MB: formatting it on every
    draw of the page cost a second per draw and held a copy per session); a click does not redraw the page."""
    cols = st.columns([1, 1, 3])
    with cols[0]:
        st.download_button("Result JSON", lambda: json.dumps(rec.result(), indent=1), file_name=f"{rec.id}-result.json",
                           mime="application/json", key=f"dl-result-{rec.id}", on_click="ignore")
    with cols[1]:
        if rec.has_trace():
            st.download_button("Trace (Chrome JSON)", rec.trace_bytes, file_name=f"{rec.id}-trace.json",
                               mime="application/json", key=f"dl-trace-{rec.id}", on_click="ignore",
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
