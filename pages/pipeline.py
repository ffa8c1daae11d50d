"""Pipeline parallel: live Gantt charts of a schedule on gloo ranks, the bubble measured against the model."""
import altair as alt
import pandas as pd
import streamlit as st

from backend.config import ConfigError
from backend.parallel.pp.schedules import SCHEDULES
from pages import ui

st.title("Pipeline parallel")

KIND_COLORS = alt.Scale(domain=["F", "B", "I", "W", "recv"], range=["#1f6fd1", "#e4572e", "#f2a541", "#76b041", "#c9ced6"])


def gantt(result: dict, title: str) -> alt.Chart:
    df = pd.DataFrame(result["tables"]["gantt"])
    df["row"] = df["rank"].map(lambda r: f"rank {r}")
    df["label"] = df.apply(lambda e: f"{e['mb']}" if e["lane"] == "compute" else "", axis=1)
    df["kind"] = df.apply(lambda e: e["kind"] if e["lane"] == "compute" else "recv", axis=1)
    base = alt.Chart(df).encode(y=alt.Y("row:N", title=None, sort="ascending"))
    bars = base.mark_bar(height=alt.RelativeBandSize(0.8)).encode(
        x=alt.X("start_ms:Q", title="time since the ranks aligned (ms)"), x2="end_ms:Q",
        color=alt.Color("kind:N", scale=KIND_COLORS, title="action"),
        opacity=alt.condition(alt.datum.kind == "recv", alt.value(0.5), alt.value(1.0)),
        tooltip=["row", "kind", "mb", "stage", alt.Tooltip("start_ms:Q", format=".1f"), alt.Tooltip("end_ms:Q", format=".1f")])
    labels = base.transform_filter(alt.datum.label != "").mark_text(color="white", fontSize=9).encode(
        x=alt.X("mid:Q"), text="label:N").transform_calculate(mid="(datum.start_ms + datum.end_ms) / 2")
    return (bars + labels).properties(title=title, height=alt.Step(28))


def render(result: dict, rec) -> None:
    m = result["metrics"]
    cols = st.columns(4)
    cols[0].metric("bubble, measured", f"{100 * m['bubble_measured']:.1f} %", help="1 − busy ÷ makespan, mean over ranks")
    cols[1].metric("bubble, model", f"{100 * m['bubble_model']:.1f} %", help=SCHEDULES[m["schedule"]].bubble_formula)
    cols[2].metric("makespan", f"{m['makespan_ms']:,.0f} ms")
    cols[3].metric("mean action", f"{m['mean_action_ms']:.1f} ms")
    for note in result.get("notes", []):
        st.warning(note)
    st.altair_chart(gantt(result, f"{m['schedule']}: p={m['p']}, m={m['m']}" + (f", v={m['v']}" if m["v"] > 1 else "")), width="stretch")
    stages = pd.DataFrame(result["tables"]["stages"])
    left, right = st.columns(2)
    left.dataframe(stages, hide_index=True, width="stretch", column_config={
        "bubble": st.column_config.NumberColumn("bubble", format="%.3f"), "bubble_model": st.column_config.NumberColumn("model", format="%.3f")})
    live = pd.DataFrame(result["tables"]["live"])
    right.altair_chart(alt.Chart(live).mark_line(interpolate="step-after").encode(
        x=alt.X("t_ms:Q", title="time (ms)"), y=alt.Y("live:Q", title="live activations (micro-batches)"),
        color=alt.Color("rank:N")).properties(height=220, title="Activations held, per rank"), width="stretch")
    versions = pd.DataFrame(result["tables"]["versions"])
    if not versions.empty:
        st.caption("PipeDream: the weight version each micro-batch's forward and backward used on each stage")
        st.dataframe(versions, hide_index=True, width="stretch")

    st.subheader("Side by side")
    other = st.selectbox("compare with schedule", [s for s in SCHEDULES if s != rec.config["schedule"]], key=f"cmp-{rec.id}")
    compare_id = st.query_params.get("compare")
    if st.button(f"Run {other} on the same settings"):
        plan = SCHEDULES[other]
        settings = dict(rec.config, schedule=other)
        settings["virtual_stages"] = settings["virtual_stages"] if plan.interleaved else 1
        settings["recompute"] = settings["recompute"] and plan.supports_recompute
        settings["vertical_sync"] = settings["vertical_sync"] and plan.asynchronous
        try:
            compare_id = ui.runner().submit("pipeline.run", settings)
            st.query_params["compare"] = compare_id
        except ConfigError as err:
            st.error(str(err))
    if compare_id:
        ui.show_run(compare_id, lambda res, r: st.altair_chart(gantt(res, f"{r.config['schedule']} (run {r.id})"), width="stretch"))


ui.experiment_page(
    "pipeline.run", render,
    intro="Each rank is a process holding pipeline stages of a Linear+tanh model; it runs its schedule's actions and "
          "sends activations and gradients to its neighbours. Every box below is one measured action.",
)
