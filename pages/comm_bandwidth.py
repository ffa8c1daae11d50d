"""Collective bandwidth: gloo's built-in collectives over a size sweep, algbw and busbw per op."""

import altair as alt
import pandas as pd
import streamlit as st

from pages import timeline, ui

st.title("Collective bandwidth")


def slowest_rank_chart(counts: pd.DataFrame, table: pd.DataFrame, world: int) -> None:
    """Which rank set t for each call (the run's count per rank, every rank drawn), and by how much it trailed the
    fastest."""
    left, right = st.columns(2)
    left.altair_chart(alt.Chart(counts).mark_bar().encode(
        x=alt.X("rank:O", scale=alt.Scale(domain=list(range(world))), title="rank", axis=alt.Axis(labelAngle=0)),
        y=alt.Y("calls:Q", title="sizes it was slowest at"), color=alt.Color("op:N", title="collective"),
        tooltip=["rank", "op", "calls"],
    ).properties(height=260, title="Which rank set t (the slowest rank's mean)"), width="stretch")
    right.altair_chart(alt.Chart(table).mark_line(point=True).encode(
        x=alt.X("size_bytes:Q", scale=alt.Scale(type="log", base=2), title="message size S (bytes, log₂)"),
        y=alt.Y("spread_pct:Q", title="spread (% of t)"), color=alt.Color("op:N", title="collective"),
        tooltip=["op", alt.Tooltip("size_bytes:Q", format=","), alt.Tooltip("spread_pct:Q", format=".1f", title="% of t"),
                 alt.Tooltip("rank_spread_us:Q", format=",.1f", title="µs")],
    ).properties(height=260, title="Fastest rank ahead of the slowest"), width="stretch")
    st.caption("A collective ends when its last rank is done, so the ranks' times differ by how each was scheduled "
               "and by its part in the algorithm. A rank that is the slowest at most sizes points at a slow link or a "
               "busy core; a slowest rank that changes from size to size is scheduling noise.")


def render(result: dict, rec) -> None:
    table = pd.DataFrame(result["tables"]["bandwidth"])
    world = result["metrics"]["world_size"]
    factors = ", ".join(f"{r['op']} {r['bus_factor']:.3g}" for r in result["tables"]["bus_factors"])
    st.markdown(
        f"**{world} ranks on gloo.** algbw = S / t; busbw = algbw × factor, as nccl-tests defines them (all-reduce "
        f"2(n−1)/n, all-gather / reduce-scatter / all-to-all (n−1)/n, broadcast 1; here {factors}). "
        "t is the slowest rank's mean."
    )
    long = table.melt(id_vars=["op", "size_bytes", "time_us"], value_vars=["busbw_GBps", "algbw_GBps"],
                      var_name="measure", value_name="GBps")
    long["measure"] = long["measure"].str.replace("_GBps", "")
    x = alt.X("size_bytes:Q", scale=alt.Scale(type="log", base=2), title="message size S (bytes, log₂)")
    y = alt.Y("GBps:Q", scale=alt.Scale(type="log"), title="bandwidth (GB/s, log)")
    tooltip = ["op", "measure", alt.Tooltip("size_bytes:Q", format=",", title="S (bytes)"),
               alt.Tooltip("GBps:Q", format=".4f", title="GB/s"), alt.Tooltip("time_us:Q", format=",.1f", title="t (µs)")]
    # Lines carry the legends (a dash legend drawn as strokes, not as the points' dots); points only mark the sizes.
    lines = alt.Chart(long).mark_line().encode(
        x=x, y=y, color=alt.Color("op:N", title="collective"),
        strokeDash=alt.StrokeDash("measure:N", title="measure", sort=["busbw", "algbw"],
                                  legend=alt.Legend(symbolType="stroke", symbolStrokeWidth=2, symbolSize=400)),
        tooltip=tooltip)
    points = alt.Chart(long).mark_point(filled=True, size=25).encode(x=x, y=y, color="op:N", tooltip=tooltip)
    st.altair_chart((lines + points).properties(height=380, title="Bandwidth against message size").interactive(), width="stretch")
    if result["tables"]["slowest"]:
        slowest_rank_chart(pd.DataFrame(result["tables"]["slowest"]), table, world)
    else:  # a run of schema version 1
        st.caption("This run did not count its slowest ranks (stored before runs did): run it again to see them.")
    with st.expander("Table"):
        ui.table(table)
    timeline.run_timeline(rec, title="Per-rank timeline of the sweep (each bar one timed call)")


ui.experiment_page(
    "comm.bandwidth", render,
    intro="Each run spawns `world_size` gloo processes on this machine and times every collective over "
          "doubling message sizes. Every result is also compared element-wise with its closed-form value.",
)
