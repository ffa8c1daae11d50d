"""Serving: the tiny LLaMA under continuous batching, measured, beside the simulator calibrated from it."""
from urllib.parse import urlencode

import altair as alt
import pandas as pd
import streamlit as st

from backend.serving.schema import BENCH_REQUESTS, BIG, COST_SUMMARY
from pages import decode_view, form, ui

st.title("Serving: a real engine and its simulator")

PHASES = alt.Scale(domain=["queued", "prefill", "decode", "preempted"], range=["#c9ced6", "#f2a541", "#1f6fd1", "#d1495b"])
FIGURES = {"ttft_p50": "median TTFT (s)", "ttft_p90": "p90 TTFT (s)", "tpot_p50": "median TPOT (s)",
           "tpot_p90": "p90 TPOT (s)", "throughput_tok_s": "throughput (tokens/s)"}
VIEWS = {"Engine: real runs, and the simulator beside them": "serving.engine", "Simulator at scale": "serving.simulate"}


def fidelity_table(m: dict, real: str, simulated: str) -> None:
    rows = [{"figure": label, real: m[f"{real}.{key}"], simulated: m[f"{simulated}.{key}"], "error": m[f"error.{key}"],
             "repeat": m[f"repeat.{key}"]} for key, label in FIGURES.items()]
    ui.table(pd.DataFrame(rows), column_config={
        "error": st.column_config.NumberColumn("simulated vs real", format="percent"),
        "repeat": st.column_config.NumberColumn("real vs real (a second run)", format="percent",
                                                help="the engine serving the same trace again: its own reproducibility")})
    st.caption("The verdict on these errors is the fidelity note above. Times are CPU time of the engine's thread; a busy "
               "shared machine still slows it through caches and memory bandwidth, which the last column shows.")


def latency_cdfs(latency: pd.DataFrame) -> None:
    cols = st.columns(3)
    for col, (field, title) in zip(cols, (("ttft", "time to first token (s)"), ("tpot", "time per output token (s)"),
                                          ("e2e", "end-to-end latency (s)"))):
        data = latency.dropna(subset=[field])
        col.altair_chart(alt.Chart(data).mark_line(interpolate="step-after").encode(
            x=alt.X(f"{field}:Q", title=title, scale=alt.Scale(type="log", nice=False)),  # niced, decades of nothing
            y=alt.Y(f"{field}_share:Q", title="share of requests", axis=alt.Axis(format="%")),
            color=alt.Color("source:N", title=None), order=alt.Order(f"{field}:Q"),
            tooltip=["source", alt.Tooltip(f"{field}:Q", format=".4f"), alt.Tooltip(f"{field}_share:Q", format=".0%", title="share")],
        ).properties(height=240), width="stretch")


def load_curve(load: pd.DataFrame, knee) -> None:
    knee_rule = alt.Chart(pd.DataFrame({"rate": [knee]})).mark_rule(strokeDash=[4, 4], color="#d1495b").encode(
        x="rate:Q", tooltip=[alt.Tooltip("rate:Q", title="knee (requests/s)", format=".2f")]) if knee else None
    left, right = st.columns(2)
    for col, fields, title in ((left, ["throughput_req_s"], "served requests/s"), (right, ["ttft_p50", "ttft_p90", "e2e_p90"], "latency (s)")):
        data = load.melt(id_vars=["rate", "source"], value_vars=fields, var_name="figure")
        chart = alt.Chart(data).mark_line(point=True).encode(
            x=alt.X("rate:Q", title="offered load (requests/s)", scale=alt.Scale(type="log")),
            y=alt.Y("value:Q", title=title, scale=alt.Scale(type="log")), color=alt.Color("figure:N", title=None),
            strokeDash=alt.StrokeDash("source:N", title=None), shape=alt.Shape("source:N", title=None),
            tooltip=["source", "figure", alt.Tooltip("rate:Q", format=".2f"), alt.Tooltip("value:Q", format=".4f")])
        col.altair_chart((chart + knee_rule if knee_rule else chart).properties(height=280), width="stretch")
    st.caption(f"The knee (dashed red): the first offered rate the simulated server serves less than 90% of"
               f"{f', at {knee:.2f} requests/s' if knee else ' (none in this sweep)'}. Real points are the engine itself.")


def cost_model(m: dict, rows: list, steps: pd.DataFrame, measured: str) -> None:
    st.markdown(m[COST_SUMMARY])
    ui.table(pd.DataFrame(rows), column_config={"coefficient_us": st.column_config.NumberColumn(
        "µs per unit", format="%.4g", help="microseconds each unit of the term adds to a step")})
    top = float(max(steps["time_ms"].max(), steps["predicted_ms"].max()))
    diagonal = alt.Chart(pd.DataFrame({"a": [0, top], "b": [0, top]})).mark_line(color="grey", strokeDash=[3, 3]).encode(x="a:Q", y="b:Q")
    st.altair_chart((alt.Chart(steps).mark_circle(size=18, opacity=0.5).encode(
        x=alt.X("predicted_ms:Q", title="cost model (ms)"), y=alt.Y("time_ms:Q", title=f"{measured} step time (ms)"),
        color=alt.Color("decode_tokens:Q", title="decode tokens"),
        tooltip=["step", "prefill_tokens", "decode_tokens", "kv_blocks", alt.Tooltip("time_ms:Q", format=".2f"),
                 alt.Tooltip("predicted_ms:Q", format=".2f")]) + diagonal).properties(height=260), width="stretch")


def render_engine(result: dict, rec) -> None:
    m, t = result["metrics"], result["tables"]
    cols = st.columns(4)
    cols[0].metric("requests served", f"{m['real.requests']:.0f}", help=f"{m['real.steps']:.0f} steps")
    cols[1].metric("throughput", f"{m['real.throughput_tok_s']:.0f} tok/s", f"{100 * m['error.throughput_tok_s']:+.1f}% simulated", delta_color="off")
    cols[2].metric("median TTFT", f"{1e3 * m['real.ttft_p50']:.1f} ms", f"{100 * m['error.ttft_p50']:+.1f}% simulated", delta_color="off")
    cols[3].metric("median TPOT", f"{1e3 * m['real.tpot_p50']:.1f} ms", f"{100 * m['error.tpot_p50']:+.1f}% simulated", delta_color="off")

    st.subheader("Every request, through time")
    gantt = pd.DataFrame(t["gantt"])
    st.altair_chart(alt.Chart(gantt).mark_bar(height=6).encode(
        x=alt.X("start:Q", title="time since the first arrival (s)"), x2="end:Q", y=alt.Y("request:O", title="request", axis=None),
        color=alt.Color("phase:N", scale=PHASES, title=None), tooltip=["request", "phase", alt.Tooltip("start:Q", format=".3f"),
                                                                         alt.Tooltip("end:Q", format=".3f")],
    ).properties(height=max(200, 8 * gantt["request"].nunique())), width="stretch")
    steps = pd.DataFrame(t["steps"])
    mix = steps.melt(id_vars=["start", "end", "step"], value_vars=["prefill_tokens", "decode_tokens"], var_name="tokens")
    mix["tokens"] = mix["tokens"].str.removesuffix("_tokens")
    st.altair_chart(alt.Chart(mix[mix["value"] > 0]).mark_bar().encode(  # stacked: prefill + decode = the step's tokens
        x=alt.X("start:Q", title="time since the first arrival (s)"), x2="end:Q",
        y=alt.Y("value:Q", title="tokens in the step", stack="zero"),
        color=alt.Color("tokens:N", title=None, scale=alt.Scale(domain=["prefill", "decode"], range=["#f2a541", "#1f6fd1"])), tooltip=["step", "tokens", "value", alt.Tooltip("start:Q", format=".3f"),
                                                          alt.Tooltip("end:Q", format=".3f")],
    ).properties(height=200, title="Batch composition: each step as wide as it took"), width="stretch")

    st.subheader("Latency: real and simulated, same trace")
    fidelity_table(m, "real", "simulated")
    latency_cdfs(pd.DataFrame(t["latency"]))
    gaps = pd.DataFrame(t["token_gaps"], columns=["request", "gap"])
    st.altair_chart(alt.Chart(gaps).transform_window(share="cume_dist()", sort=[{"field": "gap"}]).mark_line(
        interpolate="step-after").encode(
        x=alt.X("gap:Q", title="time between two output tokens of a request (s), the engine", scale=alt.Scale(type="log", nice=False)),
        y=alt.Y("share:Q", title="share of gaps", axis=alt.Axis(format="%")),
        tooltip=[alt.Tooltip("gap:Q", format=".4f"), alt.Tooltip("share:Q", format=".0%")]).properties(height=200), width="stretch")
    st.subheader("The cost model")
    cost_model(m, t["cost_model"], steps, "measured (held-out run)")
    st.subheader("Load curve")
    load_curve(pd.DataFrame(t["load"]), m["knee_rate"])
    decode_view.short("batching")


def render_simulate(result: dict, rec) -> None:
    m, t = result["metrics"], result["tables"]
    cols = st.columns(4)
    cols[0].metric("requests simulated", f"{m['scale.requests']:,.0f}", help=f"{m['scale.steps']:,.0f} steps")
    cols[1].metric("simulation time", f"{m['simulation_seconds']:.1f} s", f"{m['simulated_requests_per_second']:,.0f} requests/s", delta_color="off")
    cols[2].metric("p90 TTFT", f"{1e3 * m['scale.ttft_p90']:.1f} ms")
    cols[3].metric("median TPOT", f"{1e3 * m['scale.tpot_p50']:.1f} ms")
    st.subheader("Fidelity on a held-out trace, this run")
    fidelity_table(m, "real", "simulated")
    latency_cdfs(pd.DataFrame(t["latency"]))
    st.subheader("Load curve (simulated)")
    load_curve(pd.DataFrame(t["load"]), m["knee_rate"])
    st.subheader("Each knob, flipped once")
    knobs = pd.DataFrame(t["knobs"])
    ran = knobs.dropna(subset=["ttft_p90"]).assign(label=lambda d: d["knob"] + " " + d["setting"])
    chart_rows = ran.melt(id_vars=["label"], value_vars=["ttft_p90", "tpot_p50", "e2e_p90"], var_name="figure", value_name="seconds")
    st.altair_chart(alt.Chart(chart_rows).mark_point(filled=True, size=60).encode(  # a bar's length means nothing on a log axis
        x=alt.X("seconds:Q", title="seconds", scale=alt.Scale(type="log", nice=False)), y=alt.Y("label:N", title=None),
        color=alt.Color("figure:N", title=None), yOffset="figure:N",
        tooltip=["label", "figure", alt.Tooltip("seconds:Q", format=".4f")]).properties(height=360), width="stretch")
    st.caption("Each knob flipped on its own, the rest as set, on the same simulated trace; the first row is the settings as given.")
    ui.table(knobs)
    st.subheader("The cost model")
    cost_model(m, t["cost_model"], pd.DataFrame(t["steps"]), "simulated")


view = VIEWS[ui.chosen_view(VIEWS, key="serving-view", param="view")]
form.trace_upload(view, "milliseconds", ui.store().root)
big = BIG[view.removeprefix("serving.")]
ui.experiment_page(
    view, render_engine if view == "serving.engine" else render_simulate, page_params=("view",),
    intro="The tiny LLaMA serves requests arriving in real time, its KV in paged blocks, and a simulator fitted to the "
          "engine's own steps predicts a trace the fit never saw. The defaults take about 10 s; "
          f"[a bigger run]({'?' + urlencode({'view': view, **big})}) ({', '.join(f'{k} {v:,}' for k, v in big.items())}) "
          "takes a minute or two.",
    about="Each step is one forward of the model over the whole running batch (prefill chunks and decode tokens). The "
          "simulator runs the same scheduler on a cost model fitted to the engine's steps; the bigger run measures its "
          f"fidelity on more requests (bench/serving.py: {BENCH_REQUESTS} per held-out trace). The memory side of paging "
          "is on [Paged attention](paged_attention).",
    folded={"Calibration and sweeps": ("seed", "profile_requests", "held_out_requests", "sweep_requests",
                                       *(("real_rates",) if view == "serving.engine" else ()))},
)
