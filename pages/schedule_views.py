"""The mesh page's plan under every schedule it can run with, side by side: replayed step time, bubble (replayed,
modelled, closed form) and peak activations per rank."""
import altair as alt
import pandas as pd
import streamlit as st

from pages import ui


def schedules(result: dict) -> None:
    """This plan under every schedule the mesh can run with it: replayed step time, bubble, peak activations per rank."""
    rows = pd.DataFrame(result["tables"]["schedules"])
    ran, refused = rows[rows["refused"] == ""].copy(), rows[rows["refused"] != ""]
    st.subheader("This plan under every schedule")
    per = pd.DataFrame(result["tables"]["schedule_means"])  # the bubble's mean over ranks per schedule (mesh.schedule_means)
    bubbles = per.melt(id_vars=["schedule", "step_replayed_ms"], var_name="source", value_name="bubble",
                       value_vars=["bubble_replayed", "bubble_makespan_model", "bubble_formula"])
    bubbles["source"] = bubbles["source"].map({"bubble_replayed": "replayed (measured costs)",
                                               "bubble_makespan_model": "makespan model",
                                               "bubble_formula": "closed form (equal stages)"})
    order = list(per["schedule"])
    left, right = st.columns(2)
    names = alt.Axis(labelOverlap=False)
    height = alt.Step(10)  # per bar: a discrete axis takes its height from steps, not a number
    left.altair_chart(alt.Chart(bubbles).mark_bar().encode(
        y=alt.Y("schedule:N", sort=order, title=None, axis=names), yOffset="source:N",
        x=alt.X("bubble:Q", title="bubble (mean idle share over ranks)", axis=alt.Axis(format="%")),
        color=alt.Color("source:N", title=None, legend=alt.Legend(orient="bottom", columns=1)),
        tooltip=["schedule", "source", alt.Tooltip("bubble:Q", format=".1%"),
                 alt.Tooltip("step_replayed_ms:Q", format=".2f", title="replayed step (ms)")]).properties(
        height=height, title="Bubble per schedule"), width="stretch")
    ran["rank"] = ran["rank"].astype(int)
    right.altair_chart(alt.Chart(ran).mark_bar().encode(
        y=alt.Y("schedule:N", sort=order, title=None, axis=names), yOffset="rank:N",
        x=alt.X("activations_peak_bytes:Q", title="peak activations held (B)"), color=alt.Color("rank:N", title="rank", legend=alt.Legend(orient="bottom")),
        tooltip=["schedule", "rank", alt.Tooltip("activations_peak_bytes:Q", format=",", title="peak activations (B)"),
                 alt.Tooltip("bubble_replayed:Q", format=".1%", title="replayed bubble")]).properties(
        height=height, title="Peak activations per rank"), width="stretch")
    st.altair_chart(alt.Chart(per).mark_bar().encode(
        x=alt.X("step_replayed_ms:Q", title="replayed step time (ms, one core per rank, measured CPU costs)"),
        y=alt.Y("schedule:N", sort=order, title=None, axis=names),
        tooltip=["schedule", alt.Tooltip("step_replayed_ms:Q", format=".2f", title="replayed step (ms)")]).properties(
        height=alt.Step(22), title="Replayed step time"), width="stretch")
    if len(refused):
        st.caption("Not run with this plan: " + "; ".join(f"{r.schedule} ({r.refused})" for r in refused.itertuples()))
    with st.expander("Per schedule and rank"):
        ui.table(ran.drop(columns=["refused"]))
