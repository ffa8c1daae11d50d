"""Shared page pieces: an experiment's page (settings form, launch, the run view), the sidebar's queue, presets.
The run view is pages/run_view.py, the runner and store pages/server.py, the settings form pages/form.py, timelines
pages/timeline.py, sign-in pages/sign_in.py; pages reach them all through this module.

Pages draw; everything they show comes from the run store. Nothing here computes a result.
Links are data, never markup: a run id from a URL is used only if it has the id format, and text a user
can influence (settings, error messages) is escaped before Markdown sees it.
"""
from __future__ import annotations

import importlib
import os
import threading
import time
from pathlib import Path
from typing import Callable

import pandas as pd
import streamlit as st

from backend import experiments
from backend.config import ConfigError
from backend.device import describe
from backend.store import QueueFull, RunRecord
from pages import render_log
from pages.form import settings_form
from pages.markup import escape
from pages.navigation_guard import route_through_app
from pages.live_view import watchdog  # noqa: F401
from pages.run_view import page_experiment, resume_button, show_run  # noqa: F401  (pages call ui.show_run, ui.resume_button)
from pages.server import STATUS_ICON, experiment_of, page_of, result_of, runner, store, url_run_id  # noqa: F401  (every page's ui.store)
from pages.sign_in import current_user, who_is_signed_in
from pages.tables import MISSING, number_format, readable, table, words  # noqa: F401  (every page's ui.table)

route_through_app()  # pages import this module first, so a page run alone reroutes through app.py



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


def latest_run(name: str, where: str, what: str) -> tuple[dict, RunRecord] | None:
    """The latest succeeded run of `name` and its result, for a short view on another topic's page; where there is none,
    a caption saying on which page (`where`, a Markdown link) to run it and `what` then appears here."""
    runs = runs_of(name, statuses=("succeeded",), limit=1)
    result = result_of(runs[0]) if runs else None
    if not result:
        st.caption(f"No run of {name} on this server yet: run it on {where} and {what} here.")
        return None
    return result, runs[0]


def run_link(rec: RunRecord) -> str:
    """A Markdown link to a run on the page that draws it."""
    return f"[run {rec.id}]({page_of(rec.experiment)}?run={rec.id})"


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


# How often an open page's sidebar redraws the team's queue. Each redraw is a script run on the server and, measured in
# Chromium (DevTools Performance.getMetrics), about 0.1 s of the page's renderer main thread however little changed:
# at 2 s an idle page cost its browser 0.08 s a second (10 open pages: 0.8 of a core), at 10 s about 0.02. A person's
# own run is followed by its run view at its own rate (pages/live_view.poll_s); this is the team's overview.
QUEUE_REFRESH_S = 10.0


@st.fragment(run_every=QUEUE_REFRESH_S)
def _queue() -> None:
    """The team's queue, refreshed every QUEUE_REFRESH_S while the page is open (a run started elsewhere shows up here
    too; any full redraw of the page, such as a Run, redraws it at once). Its timer is also the run view's watchdog."""
    watchdog()  # a live run view on this page that stopped ticking: the page is redrawn
    render_log.write({"event": "queue_tick", "user": current_user(), "t": time.time()})  # this page's timers alive (bench)
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
                    page_params: tuple[str, ...] = (), about: str = "", folded: dict[str, tuple[str, ...]] | None = None) -> None:
    """Settings form -> job -> live progress -> checks, the page's own charts, downloads. `page_params` are the
    page's own URL parameters (a chosen view), kept in the URL when a run replaces the settings there. `about` is the
    intro's detail, in a closed expander; `folded` the settings the form folds away under headings (form.settings_form)."""
    exp = experiments.get(name)
    name = exp.name  # a page or a link may still use an old name
    page_experiment.set(name)
    if intro:
        st.markdown(intro)
    if about:
        with st.expander("How it works"):
            st.markdown(about)
    run_id = url_run_id()
    shown = store().get(run_id) if run_id else None
    values = settings_form(exp, shown.config if shown and experiment_of(shown) == name else None, folded)
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


def chosen_view(views: dict[str, str], key: str, param: str | None = None) -> str:
    """A page of several views, one experiment each (view -> experiment): the view chosen, opening on the one the linked
    run (?run=) belongs to, else the one the URL's `param` names by its experiment (?view=plan.search: a link to a
    view, kept in the URL as the view changes), else the first; a linked run of another view leaves the URL."""
    shown = store().get(st.query_params["run"]) if "run" in st.query_params else None
    asked = st.query_params.get(param) if param else None
    default = next((view for view, name in views.items() if shown and experiment_of(shown) == name), None) or \
        next((view for view, name in views.items() if name == asked), next(iter(views)))
    view = st.segmented_control("view", list(views), default=default, key=key) or default
    if shown and experiment_of(shown) != views[view]:
        del st.query_params["run"]
    if param:
        st.query_params[param] = views[view]
    return view


def experiment_views(views: dict[str, tuple[str, Callable, str]], key: str) -> None:
    """A page of several views, each one experiment's page (label -> (experiment, its render, its intro)), the view
    chosen as chosen_view does."""
    name, render, intro = views[chosen_view({label: name for label, (name, _, _) in views.items()}, key)]
    experiment_page(name, render, intro=intro)


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
