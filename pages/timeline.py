"""One timeline for every run's trace: a per-rank, per-lane Gantt of the Chrome trace's complete events, coloured
by what each event is (backend/trace.py's kind_of), its name and arguments in the tooltip."""
from __future__ import annotations

import json

import altair as alt
import pandas as pd
import streamlit as st

from backend.store import RunRecord
from backend.trace import KINDS

KIND_COLORS = dict(zip(KINDS, ["#1f6fd1", "#e4572e", "#76b041", "#8e44ad", "#7f8c8d",
                               "#f2a541", "#f7d08a", "#17a2b8", "#2c3e50", "#bdc3c7"]))


def kind_scale(kinds) -> alt.Scale:
    """The kinds present, each in its own colour on every page; the legend lists only what the chart shows."""
    present = [k for k in KIND_COLORS if k in set(kinds)] + sorted(set(kinds) - set(KIND_COLORS))
    return alt.Scale(domain=present, range=[KIND_COLORS.get(k, "#999999") for k in present])


def run_timeline(rec: RunRecord, title: str) -> None:
    """The run's trace as a timeline, when it has one."""
    trace = rec.trace_bytes()
    if trace:
        timeline_chart(json.loads(trace), title=title)


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
        x=alt.X("start_ms:Q", title="time since ranks aligned (ms)", scale=alt.Scale(zero=False, nice=False)),  # from the first event
        x2="end_ms:Q",
        y=alt.Y("lane:N", title=None, sort=alt.EncodingSortField("row", op="min")),
        color=alt.Color("kind:N", title="kind", scale=kind_scale(df["kind"]), legend=alt.Legend(orient="top", columns=5)),
        tooltip=["lane", "name", "kind", alt.Tooltip("start_ms:Q", format=".3f", title="start (ms)"),
                 alt.Tooltip("dur_us:Q", format=".1f", title="duration (µs)"), "args"],
    ).properties(height=alt.Step(22)).interactive(bind_y=False)
    st.altair_chart(chart, width="stretch")
