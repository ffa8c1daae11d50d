"""A queued or running run's live view: its header, queue place or progress and Cancel, redrawn by its own fragment
timer at the rate its state needs; and the watchdog that redraws a page whose view lost its timer. pages/run_view.py
draws a run through it until the run ends."""
from __future__ import annotations

import math
import time

import streamlit as st
from streamlit.proto.ForwardMsg_pb2 import ForwardMsg
from streamlit.runtime.scriptrunner import get_script_run_ctx

from backend.jobs import NotAllowed, QueuePlace
from backend.store import FINAL, RunRecord
from pages import render_log
from pages.markup import escape
from pages.server import STATUS_ICON, experiment_of, runner, store
from pages.sign_in import current_user, is_admin


def header(rec: RunRecord) -> None:
    st.subheader(f"{STATUS_ICON[rec.status]} Run `{rec.id}` · {escape(experiment_of(rec))} · {rec.status}")


# How often a run view asks the store (each time the browser's timer fires: a message, a script run, a redraw). A
# running run's end is noticed within FAST_POLL_S; the next to start asks every NEXT_POLL_S (its start, then at the fast
# rate); one with others queued ahead changes only when one of those ends and asks every SLOW_POLL_S. Ten people
# waiting on one job slot then ask 4 + 2 + 8 = 14 times a second, not 20 (every view at 0.5 s), and each end is drawn
# sooner.
FAST_POLL_S, NEXT_POLL_S, SLOW_POLL_S = 0.25, 0.5, 1.0
# A running run's tick also waits on the server for its end, up to END_WAIT_S (a store read every END_READ_S), so the
# end is noticed within about END_READ_S rather than up to FAST_POLL_S later, with no more ticks from the browser.
END_WAIT_S, END_READ_S = 0.2, 0.02


def poll_s(rec: RunRecord, place: QueuePlace | None) -> float:
    """The run view's refresh period for a run in this state (place: the queued run's place, None otherwise)."""
    if rec.status != "queued" or place is None:
        return FAST_POLL_S
    return NEXT_POLL_S if place.ahead == 0 else SLOW_POLL_S


def live_status(run_id: str) -> None:
    """A queued or running run's view, redrawn every poll_s; a tick that finds the period changed sets the new one
    itself (_set_period), without redrawing the page."""
    rec = store().get(run_id)
    period = poll_s(rec, runner().place(run_id) if rec.status == "queued" else None)
    st.session_state.setdefault(PERIOD_KEY, {})[run_id] = period
    st.fragment(_live_view, run_every=period)(run_id)


# The period each live view's timer runs at now (session state: run id -> seconds), so a tick knows when it changes.
PERIOD_KEY = "run-view-period"


def _set_period(run_id: str, period: float) -> None:
    """In a tick of the view's own timer: the browser's timer for this fragment set to `period`, by the message that
    registering the fragment sends (the browser replaces a fragment's timer when its interval changes). A full redraw
    of the page did this before, twice per run (queued -> next -> running): one more script run on the server and, in
    Chromium, about 0.06 s more CPU over the 5 s after a move (bench/render_profile.py's queue_move)."""
    ctx = get_script_run_ctx()
    if ctx is None or len(ctx.fragment_ids_this_run or ()) != 1:  # not a timer's run of this one fragment
        return
    msg = ForwardMsg()
    msg.auto_rerun.interval = period
    msg.auto_rerun.fragment_id = ctx.fragment_ids_this_run[0]
    ctx.enqueue(msg)
    st.session_state.setdefault(PERIOD_KEY, {})[run_id] = period


def _url_names(run_id: str) -> bool:
    """Whether the URL this script run's request carried names the run (the page's ?run=, the pipeline's ?compare=).
    A fragment's run takes its URL from the browser's request, and st.rerun() redraws the whole page at it; a timer's
    request sent before the browser saw the URL a Run put there (or held on the server behind that Run's script run)
    names the previous run, or none, and a redraw at it would draw that run over the one just started."""
    return run_id in st.query_params.to_dict().values()


def _end_within(rec: RunRecord, wait_s: float) -> RunRecord:
    """The running run's record once it ends, or after wait_s, whichever comes first; only in a timer's run of this
    view (a full run of the page draws at once)."""
    ctx = get_script_run_ctx()
    if rec.status != "running" or ctx is None or not ctx.fragment_ids_this_run:
        return rec
    end = time.monotonic() + wait_s
    while rec.status == "running" and time.monotonic() < end:
        time.sleep(END_READ_S)
        rec = store().get(rec.id)
    return rec


def _live_view(run_id: str) -> None:
    now = time.time()
    render_log.write({"event": "tick", "run": run_id, "t": now})  # when the browser's timer asked (bench)
    rec = _end_within(store().get(run_id), END_WAIT_S)
    st.session_state.setdefault(LIVE_KEY, {})[run_id] = now  # alive, for the watchdog
    place = runner().place(run_id) if rec.status == "queued" else None
    # ended: the page draws its result, redrawn by a request whose URL names this run; a stale one waits for the next
    # tick, which carries the page's URL
    if rec.status in FINAL and _url_names(run_id):
        render_log.write({"event": "final_seen", "run": run_id, "t": time.time(), "user": current_user()})
        st.rerun()
    period = poll_s(rec, place)
    if rec.status not in FINAL and period != st.session_state.get(PERIOD_KEY, {}).get(run_id):
        _set_period(run_id, period)  # nearer the front, or started
    header(rec)
    if rec.status in FINAL:  # ended, seen by a stale request: the next tick redraws the page with its result
        return
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


# The watchdog (called by the sidebar's queue fragment, its own timer): a live view whose last tick is older than
# STALE_S has lost its timer, and the page is redrawn, which sets a new one or draws the result. Ways a view's timer
# stops before its run ends (Streamlit 1.67; tests/test_run_view.py): the browser clears every timer when a full run
# starts, so a full run that stops before the view (an exception, st.stop) leaves none; the server drops a timer's
# request for a fragment id its fragment storage no longer holds, and the browser's timer keeps firing into nothing:
# with runner.fastReruns a Run click starts a new script runner while the page's previous full run finishes, and
# that run's storage.clear() keeps only its own fragments, removing the run view the new one registered; and a full
# run's last messages (the view's timer among them) are ignored when a timer's request, arriving as that run's runner
# stops, starts a new runner before the loop forwarded them (AppSession ignores a non-current runner's events).
LIVE_KEY = "run-view-live"  # session state: run id -> when its live view last ticked (time.time())
STALE_S = 5.0  # five of the slowest polls (SLOW_POLL_S) missed; the sidebar asks every QUEUE_REFRESH_S


def watchdog() -> None:
    """In a fragment run (a timer other than the view's): redraw the page if a live view of a run the URL names
    stopped ticking; its entry is dropped first, so a page that cannot draw the view is redrawn once, not forever."""
    ctx = get_script_run_ctx()
    if ctx is None or not ctx.fragment_ids_this_run:  # a full run draws the view itself
        return
    live = st.session_state.get(LIVE_KEY, {})
    now = time.time()
    stale = [run_id for run_id, t in live.items() if now - t > STALE_S and _url_names(run_id)]
    if not stale:
        return
    for run_id in stale:
        render_log.write({"event": "watchdog", "run": run_id, "t": now, "late_s": now - live.pop(run_id),
                          "user": current_user()})
    st.rerun()
