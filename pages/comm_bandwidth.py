"""Collective bandwidth: gloo's built-in collectives over a size sweep, algbw and busbw per op."""

import altair as alt
import pandas as pd
import streamlit as st

from pages import timeline, ui

st.title("Collective bandwidth")


def render(result: dict, rec) -> None:
    table = pd.DataFrame(result["tables"]["bandwidth"])
    world = result["metrics"]["world_size"]
    st.markdown(
        f"**{world} ranks on gloo.** algbw = S / t; busbw = algbw × factor "
        f"(all-reduce 2(n−1)/n = {2 * (world - 1) / world:.3g}, all-gather / reduce-scatter / all-to-all "
        f"(n−1)/n = {(world - 1) / world:.3g}, broadcast 1), as nccl-tests defines them. t is the slowest rank's mean."
    )
    long = table.melt(id_vars=["op", "size_bytes", "time_us"], value_vars=["busbw_GBps", "algbw_GBps"],
                      var_name="measure", value_name="GBps")
    long["measure"] = long["measure"].str.replace("_GBps", "")
    chart = alt.Chart(long).mark_line(point=True).encode(
        x=alt.X("size_bytes:Q", scale=alt.Scale(type="log", base=2), title="message size S (bytes, log₂)"),
        y=alt.Y("GBps:Q", scale=alt.Scale(type="log"), title="bandwidth (GB/s, log)"),
        color=alt.Color("op:N", title="collective"),
        strokeDash=alt.StrokeDash("measure:N", title="measure"),
        tooltip=["op", "measure", alt.Tooltip("size_bytes:Q", format=",", title="S (bytes)"),
                 alt.Tooltip("GBps:Q", format=".4f", title="GB/s"), alt.Tooltip("time_us:Q", format=",.1f", title="t (µs)")],
    ).properties(height=380, title="Bandwidth against message size").interactive()
    st.altair_chart(chart, width="stretch")
    per_rank = pd.DataFrame(result["tables"]["per_rank"])
    spread = alt.Chart(per_rank).mark_point().encode(
        x=alt.X("size_bytes:Q", scale=alt.Scale(type="log", base=2), title="message size S (bytes, log₂)"),
        y=alt.Y("time_us:Q", scale=alt.Scale(type="log"), title="mean time per call (µs, log)"),
        color=alt.Color("rank:N"), shape=alt.Shape("op:N"),
        tooltip=["op", "rank", "size_bytes", alt.Tooltip("time_us:Q", format=",.1f")],
    ).properties(height=260, title="Per-rank time per call (the slowest rank sets t)")
    st.altair_chart(spread, width="stretch")
    with st.expander("Table"):
        st.dataframe(table, hide_index=True, width="stretch")
    timeline.run_timeline(rec, title="Per-rank timeline of the sweep (each bar one timed call)")


ui.experiment_page(
    "comm.bandwidth", render,
    intro="Each run spawns `world_size` gloo processes on this machine and times every collective over "
          "doubling message sizes. Every result is also compared element-wise with its closed-form value.",
)
