"""Shared page pieces: the settings form, launching a run, live progress, results, downloads, timelines.

Pages draw; everything they show comes from the run store. Nothing here computes a result.
Links are data, never markup: a run id from a URL is used only if it has the id format, and text a user
can influence (settings, error messages) is escaped before Markdown sees it.
"""
from __future__ import annotations

import contextvars
import getpass
import hashlib
import hmac
import json
import os
import re
import secrets
import time
from typing import Callable

import altair as alt
import pandas as pd
import streamlit as st
import streamlit.components.v1 as components

from backend import experiments
from backend.config import Config, ConfigError
from backend.device import describe
from backend.jobs import JobRunner, NotAllowed, log_tail
from backend.store import ACTIVE, FINAL, RunRecord, RunStore, data_dir
from backend.trace import KINDS
from pages.navigation_guard import route_through_app

route_through_app()  # pages import this module first, so a page run alone reroutes through app.py

STATUS_ICON = {"queued": "⏳", "running": "⚙️", "succeeded": "✅", "failed": "❌", "cancelled": "🚫"}
RUN_ID = re.compile(r"[0-9a-f]{12}")
# What lets Markdown make a link, an image, HTML, code, emphasis or maths out of text; and bare URLs (autolinks).
_MARKUP = re.compile(r"([\\`*\[\]<>!$])")
_AUTOLINK = re.compile(r"(?i)(\w):(?=//)|\b(www)\.")
# The experiment of the page being drawn (per script run: Streamlit runs each in its own thread).
_page_experiment: contextvars.ContextVar[str | None] = contextvars.ContextVar("page_experiment", default=None)


def escape(text: str) -> str:
    """Text shown as itself inside Markdown: whatever could become a link, an image, HTML, code or maths is
    backslash-escaped (so is the colon of "http://" and the dot of "www."); plain words and punctuation stay."""
    text = _MARKUP.sub(r"\\\1", str(text))
    return _AUTOLINK.sub(lambda m: f"{m.group(1)}\\:" if m.group(1) else f"{m.group(2)}\\.", text)


def url_run_id(key: str = "run") -> str | None:
    """A run id from the URL, if it has the id format (12 hex digits); anything else is reported, not used."""
    value = st.query_params.get(key)
    if value is None:
        return None
    if not RUN_ID.fullmatch(value):
        if re.fullmatch(r"[A-Za-z0-9_-]{1,64}", value):  # nothing Markdown acts on inside a code span
            st.warning(f"No run `{value}` in this server's store (a run id is 12 hex digits).")
        else:
            st.warning(f"The link's `{key}` is not a run id (12 hex digits), so it was ignored.")
        return None
    return value


def page_of(experiment: str) -> str:
    """The URL path of the page that draws an experiment's runs (the Runs page if no topic page does)."""
    from pages.catalog import SECTIONS

    return next((t.url_path for topics in SECTIONS.values() for t in topics if experiment in t.experiments), "runs")


# --- sign-in, as Jupyter does it ----------------------------------------------------------------------
LOOPBACK = ("localhost", "127.0.0.1", "::1")
COOKIE = "explorer_auth"


def _oidc() -> bool:
    """Whether Streamlit's own sign-in (st.login) is configured: an [auth] section in secrets.toml."""
    try:
        return "auth" in st.secrets
    except Exception:  # no secrets file at all
        return False


def exposed() -> bool:
    """Whether the server listens beyond this machine (Streamlit's default, no address, is every interface)."""
    return (st.get_option("server.address") or "0.0.0.0") not in LOOPBACK


@st.cache_resource
def server_token() -> str:
    """EXPLORER_TOKEN, else a token generated once per data folder (kept there, readable by its owner only)
    and printed on the server's terminal."""
    if os.environ.get("EXPLORER_TOKEN"):
        return os.environ["EXPLORER_TOKEN"]
    path = data_dir() / "server_token"
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, secrets.token_urlsafe(32).encode())
        os.close(fd)
    except FileExistsError:
        pass
    token = path.read_text().strip()
    port = st.get_option("server.port")
    print(f"LLM Systems Explorer needs its token: open http://<this host>:{port}/?token={token}  (kept in {path})",
          flush=True)
    return token


def sign_in() -> bool:
    """The gate app.py runs first. Bound to loopback only: open. With st.login configured (OIDC): signed-in
    users. Otherwise the server's token, given once as ?token=, after which a cookie (a keyed digest of the
    token, never the token) lets the browser back in."""
    if _oidc():
        if st.user.is_logged_in:
            return True
        st.title("Sign in")
        st.button("Sign in", type="primary", on_click=st.login)
        return False
    if not exposed():
        return True
    token = server_token()
    proof = hmac.new(token.encode(), b"explorer-session", hashlib.sha256).hexdigest()
    if st.session_state.get("signed_in") or hmac.compare_digest(st.context.cookies.get(COOKIE, ""), proof):
        return True
    given = st.query_params.get("token")
    if given is None:
        with st.form("sign-in"):
            st.title("Sign in")
            st.write("This server is shared: open the link with its token that was printed where it was started, "
                     "or paste the token here.")
            typed = st.text_input("Token", type="password")
            submitted = st.form_submit_button("Sign in", type="primary")
        if not submitted:
            return False
        given = typed
    if not hmac.compare_digest(given.encode(), token.encode()):
        st.error("That token is not this server's.")
        return False
    st.session_state["signed_in"] = True
    if "token" in st.query_params:
        del st.query_params["token"]  # out of the address bar and the history
    components.html(f"<script>document.cookie = '{COOKIE}={proof}; path=/; max-age=2592000; SameSite=Strict';</script>",
                    height=0)
    return True


def current_user() -> str:
    """Who is launching runs: the signed-in email with st.login; the token holder; on loopback, this machine's user."""
    if _oidc() and st.user.is_logged_in:
        return st.user.get("email") or st.user.get("name") or "signed-in user"
    return "token holder" if exposed() else getpass.getuser()


def is_admin() -> bool:
    """With st.login, the emails in EXPLORER_ADMINS; otherwise whoever holds the server's token (as in Jupyter,
    the token is the server's own key) or sits at the machine."""
    if _oidc():
        admins = {a.strip() for a in os.environ.get("EXPLORER_ADMINS", "").split(",") if a.strip()}
        return current_user() in admins
    return True


@st.cache_resource
def runner() -> JobRunner:
    """One job runner per server process, shared by every browser session (the team's queue)."""
    return JobRunner()


def store() -> RunStore:
    return runner().store


def sidebar() -> None:
    info = describe()
    with st.sidebar:
        st.caption("Device")
        st.markdown(f"**{info['name']}** · torch {info['torch']}  \nTriton {info['triton']} · {info['triton_mode']}")
        _queue()


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


# --- settings -------------------------------------------------------------------------------------
def _url_settings(exp: experiments.Experiment) -> tuple[dict, ConfigError | None]:
    """Settings carried by the URL, validated on the server like any other input."""
    names = {f.name for f in exp.config_cls.fields()}
    raw = {k: st.query_params[k] for k in st.query_params if k in names}
    try:
        return {k: v for k, v in exp.make_config(raw).to_dict().items() if k in raw}, None
    except ConfigError as err:
        return {}, err


def settings_form(exp: experiments.Experiment, shown: dict | None = None) -> dict | None:
    """A form built from the Config's fields, filled from the URL's settings, else the shown run's, else defaults;
    returns raw values when submitted, else None."""
    from_url, url_error = _url_settings(exp)
    if url_error:
        st.error(f"The link's settings were not used. {escape(url_error)}")
    defaults = {**exp.config_cls().to_dict(), **(shown or {})}
    with st.form(f"settings-{exp.name}"):
        cols = st.columns(3)
        values = {}
        for i, f in enumerate(exp.config_cls.fields()):
            meta, t = f.metadata, exp.config_cls.field_type(f)
            initial = from_url.get(f.name, defaults[f.name])
            label, helptext = f.name, f"{meta.get('help', '')} (allowed: {exp.config_cls.allowed(f)})"
            key = f"{exp.name}.{f.name}"
            with cols[i % 3]:
                if meta.get("choices"):
                    choices = list(meta["choices"])
                    values[f.name] = st.selectbox(label, choices, index=choices.index(initial), help=helptext, key=key)
                elif t is bool:
                    values[f.name] = st.checkbox(label, value=initial, help=helptext, key=key)
                elif t is int:
                    values[f.name] = st.number_input(label, value=initial, step=1, help=helptext, key=key)
                elif t is float:
                    values[f.name] = st.number_input(label, value=float(initial), step=float_step(initial, meta), format="%g",
                                                     help=helptext, key=key)
                else:
                    values[f.name] = st.text_input(label, value=initial, help=helptext, key=key)
        submitted = st.form_submit_button("Run", type="primary")
    return values if submitted else None


def float_step(value: float, meta: dict) -> float:
    """A step one decade below the value's leading digit (0.003 steps by 0.001), so a small value is shown and
    nudged at its own scale, never rounded to 0.00."""
    import math

    scale = abs(value) or abs(meta.get("max") or 1.0)
    return 10.0 ** math.floor(math.log10(scale)) if scale > 0 else 0.01


# --- one experiment's page ---------------------------------------------------------------------------
def experiment_page(name: str, render: Callable[[dict, RunRecord], None], intro: str = "",
                    page_params: tuple[str, ...] = ()) -> None:
    """Settings form -> job -> live progress -> checks, the page's own charts, downloads. `page_params` are the
    page's own URL parameters (a chosen view), kept in the URL when a run replaces the settings there."""
    exp = experiments.get(name)
    _page_experiment.set(name)
    if intro:
        st.markdown(intro)
    run_id = url_run_id()
    shown = store().get(run_id) if run_id else None
    values = settings_form(exp, shown.config if shown and shown.experiment == name else None)
    if values is not None:
        try:
            run_id = runner().submit(name, values, owner=current_user())
        except ConfigError as err:
            st.error(escape(str(err)))
            return
        kept = {k: st.query_params[k] for k in page_params if k in st.query_params}
        st.query_params.from_dict({**kept, **{k: str(v) for k, v in values.items()}, "run": run_id})
    if run_id:
        show_run(run_id, render)
    else:
        st.info("Choose settings and press **Run**; the charts below are drawn from that run.")
        latest = store().list(experiment=name, statuses=("succeeded",), limit=1)
        if latest:
            st.caption(f"Or open the latest run of {name}: [{latest[0].id}](?run={latest[0].id})")


def show_run(run_id: str, render: Callable[[dict, RunRecord], None] | None = None) -> None:
    """A run's status, checks, the page's own charts (render) and downloads. On a topic page, a run of another
    experiment is named and linked to its own page instead of being drawn with charts made for this one."""
    if not RUN_ID.fullmatch(run_id):
        st.warning("That is not a run id (12 hex digits).")
        return
    rec = store().get(run_id)
    if rec is None:
        st.warning(f"No run `{run_id}` in this server's store.")
        return
    expected = _page_experiment.get()
    if render and expected and rec.experiment != expected:
        st.warning(f"Run `{rec.id}` is a run of {escape(rec.experiment)}, not of {escape(expected)}: "
                   f"[open it on its page]({page_of(rec.experiment)}?run={rec.id}).")
        return
    if rec.status in ACTIVE:
        _live_status(run_id)  # draws its own header, so "queued" turns "running" as it happens
        return
    st.subheader(f"{STATUS_ICON[rec.status]} Run `{rec.id}` · {escape(rec.experiment)} · {rec.status}")
    if rec.status != "succeeded":
        st.error(escape(rec.error or rec.status))
        log = log_tail(store(), rec.id, lines=200)
        if log:
            with st.expander("Log: every rank's traceback and, after a time limit, its stack"):
                st.code(log, language=None)
        return
    result = rec.result()
    if result is None:
        st.error(f"Run {rec.id} succeeded but its result file is missing ({rec.result_path}).")
        return
    _checks(result)
    if render:
        render(result, rec)
    _downloads(rec)


@st.fragment(run_every=1.0)
def _live_status(run_id: str) -> None:
    rec = store().get(run_id)
    if rec.status in FINAL:
        st.rerun()
    st.subheader(f"{STATUS_ICON[rec.status]} Run `{rec.id}` · {escape(rec.experiment)} · {rec.status}")
    if rec.status == "queued":
        waiting = [r for r in store().list(statuses=("queued",)) if r.created < rec.created]
        running = store().list(statuses=("running",))
        st.info(f"Queued behind {len(running)} running and {len(waiting)} queued run(s); "
                f"at most {runner().max_jobs} run at a time on this server.")
    else:
        elapsed = time.time() - (rec.started or time.time())
        st.progress(rec.progress, text=f"{rec.progress:.0%} · {rec.progress_msg or 'starting ranks'} · {elapsed:.0f} s (timeout {rec.timeout_s:g} s)")
    if st.button("Cancel run", key=f"cancel-{run_id}"):
        try:
            runner().cancel(run_id, by=current_user(), admin=is_admin())
        except NotAllowed as err:
            st.error(str(err))


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
        st.dataframe(pd.DataFrame(checks)[["passed", "name", "error", "tolerance", "reference", "detail"]],
                     hide_index=True, width="stretch")


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


def rate(gbps: float) -> str:
    """A bandwidth with a unit that keeps three significant digits visible."""
    return f"{gbps:.3g} GB/s" if gbps >= 0.1 else f"{gbps * 1e3:.3g} MB/s"


# --- charts ---------------------------------------------------------------------------------------
def run_timeline(rec: RunRecord, title: str) -> None:
    """The run's trace as a timeline, when it has one."""
    trace = rec.trace_bytes()
    if trace:
        timeline_chart(json.loads(trace), title=title)


KIND_COLORS = alt.Scale(domain=list(KINDS), range=["#1f6fd1", "#e4572e", "#76b041", "#8e44ad", "#7f8c8d",
                                                   "#f2a541", "#f7d08a", "#17a2b8", "#2c3e50", "#bdc3c7"])


def timeline_chart(trace: dict, max_events: int = 5000, title: str = "") -> None:
    """A per-rank, per-lane Gantt of a Chrome trace's complete events."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    if not events:
        st.info("This run recorded no trace events.")
        return
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "thread_name"}
    shown = events[:max_events]
    if len(events) > max_events:
        st.caption(f"Showing the first {max_events} of {len(events)} events; download the trace for all of them.")
    df = pd.DataFrame({
        "lane": [f"rank {e['pid']} · {names.get((e['pid'], e['tid']), e['tid'])}" for e in shown],
        "row": [e["pid"] * 1000 + e["tid"] for e in shown],
        "start_ms": [e["ts"] / 1e3 for e in shown],
        "end_ms": [(e["ts"] + e["dur"]) / 1e3 for e in shown],
        "dur_us": [e["dur"] for e in shown],
        "name": [e["name"] for e in shown],
        "kind": [e.get("args", {}).get("kind", "compute") for e in shown],
        "args": [json.dumps(e.get("args", {})) for e in shown],
    })
    chart = alt.Chart(df, **({"title": title} if title else {})).mark_bar().encode(
        x=alt.X("start_ms:Q", title="time since ranks aligned (ms)"),
        x2="end_ms:Q",
        y=alt.Y("lane:N", title=None, sort=alt.EncodingSortField("row", op="min")),
        color=alt.Color("kind:N", title="kind", scale=KIND_COLORS, legend=alt.Legend(orient="top", columns=5)),
        tooltip=["lane", "name", "kind", alt.Tooltip("start_ms:Q", format=".3f", title="start (ms)"),
                 alt.Tooltip("dur_us:Q", format=".1f", title="duration (µs)"), "args"],
    ).properties(height=alt.Step(22)).interactive(bind_y=False)
    st.altair_chart(chart, width="stretch")
