"""This server's job runner and run store as the pages reach them, and the names a run goes by: its id from a link,
its experiment (by the name it has now), the page that draws it. The run view (pages/run_view.py) and the launch
(pages/ui.py) build on these; nothing here draws more than a warning about a link."""
from __future__ import annotations

import re

import streamlit as st

from backend import experiments
from backend.jobs import JobRunner
from backend.store import RunRecord, RunStore, is_run_id
from pages.catalog import SECTIONS

STATUS_ICON = {"queued": ":material/schedule:", "running": ":material/progress_activity:", "succeeded": ":material/check_circle:",
               "failed": ":material/error:", "cancelled": ":material/cancel:"}  # bundled: no emoji font needed


@st.cache_resource
def runner() -> JobRunner:
    """One job runner per server process, shared by every browser session (the team's queue)."""
    return JobRunner()


def store() -> RunStore:
    return runner().store


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
    name = experiments.canonical(experiment)
    return next((t.url_path for topics in SECTIONS.values() for t in topics if name in t.experiments), "runs")


def experiment_of(rec: RunRecord) -> str:
    """The experiment a stored run belongs to, by the name it has now (a run stored under an old name: ALIASES)."""
    return experiments.canonical(rec.experiment)


def result_of(rec: RunRecord) -> dict | None:
    """A stored run's result as pages read it: upgraded to its experiment's schema version, read by declared keys."""
    return experiments.open_result(rec.experiment, rec.result())
