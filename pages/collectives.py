"""Collectives: any primitive, built from send/recv in several algorithms, replayed step by step from the live trace."""

import altair as alt
import pandas as pd
import streamlit as st

from pages import timeline, ui, units

st.title("Collectives, step by step")

RING_FORMULAS = r"""
**Ring all-reduce (seed 000).** Scatter-reduce, steps $i = 0..n-2$: rank $j$ sends chunk $(j-i)\bmod n$ to rank $j+1$
and adds chunk $(j-i-1)\bmod n$ from rank $j-1$; rank $j$ then holds the reduced chunk $(j+1)\bmod n$.
All-gather, steps $i = 0..n-2$: rank $j$ sends chunk $(j+1-i)\bmod n$ and receives chunk $(j-i)\bmod n$.
Volume per rank $2\frac{n-1}{n}\psi$, independent of $n$.
"""


def render(result: dict, rec) -> None:
    m, tables, cfg = result["metrics"], result["tables"], rec.config
    n = m["world_size"]
    cols = st.columns(4)
    cols[0].metric("time per call", f"{m['time_us']:,.0f} µs", help="slowest rank's median over the timed calls")
    cols[1].metric("busbw", units.rate(m["busbw_GBps"]), help="nccl-tests bus bandwidth")
    cols[2].metric("gloo built-in busbw", units.rate(m["builtin_busbw_GBps"]), help="same inputs, same run")
    cols[3].metric("ratio to built-in", f"{m['busbw_ratio_vs_builtin']:.2f}×")
    if cfg["op"] == "all_reduce" and cfg["algo"] == "ring":
        st.markdown(RING_FORMULAS)

    holdings = pd.DataFrame(tables["holdings"])
    if not holdings.empty:
        st.subheader("Who holds what, after each step")
        last = int(holdings["step"].max())
        step = st.slider("after step (−1 = the inputs)", -1, last, last, key=f"step-{rec.id}")
        now = holdings[holdings["step"] == step]
        heat = alt.Chart(now).mark_rect(stroke="white").encode(
            x=alt.X("block:O", title="chunk (block of the buffer)"),
            y=alt.Y("rank:O", title="rank"),
            color=alt.Color("holds:Q", title="contributions", scale=alt.Scale(domain=[0, n], scheme="blues")),
            tooltip=["rank", "block", "holds", "contributors"],
        )
        text = alt.Chart(now).mark_text(fontSize=11).encode(x="block:O", y="rank:O", text="contributors:N",
                                                             color=alt.condition(alt.datum.holds > n / 2, alt.value("white"), alt.value("black")))
        st.altair_chart((heat + text).properties(height=40 * n + 40), width="stretch")
        moves = pd.DataFrame(tables["steps"])
        if step >= 0 and not moves.empty:
            at_step = moves[moves["step"] == step][["phase", "src", "dst", "blocks", "numel", "bytes", "kind"]]
            st.caption(f"Transfers in step {step} ({len(at_step)}), as the ranks logged them")
            ui.table(at_step)

    st.subheader("Bytes per rank: measured against the model")
    volume = pd.DataFrame(tables["volume"])
    ui.table(volume,
                 column_config={c: st.column_config.NumberColumn(c, format="%d B") for c in volume.columns if "bytes" in c})
    if cfg["algo"] == "builtin":
        st.caption("gloo's built-in moves bytes inside gloo, where they are not counted; choose another algorithm to see them.")

    st.subheader("Bandwidth, this algorithm against gloo's built-in (same run)")
    bw = pd.DataFrame(tables["bandwidth"]).melt(id_vars=["algorithm", "time_us"], value_vars=["algbw_GBps", "busbw_GBps"],
                                                 var_name="measure", value_name="GBps")
    st.altair_chart(alt.Chart(bw).mark_bar().encode(
        x=alt.X("GBps:Q", title="bandwidth (GB/s)"), y=alt.Y("algorithm:N", title=None),
        color=alt.Color("measure:N"), yOffset="measure:N",
        tooltip=["algorithm", "measure", alt.Tooltip("GBps:Q", format=".4f"), alt.Tooltip("time_us:Q", format=",.0f", title="µs")],
    ).properties(height=140), width="stretch")
    timeline.run_timeline(rec, title="Measured timeline of the checked call: each comm bar is one step")


ui.experiment_page(
    "comm.collectives", render,
    intro="Pick a collective and how to build it from point-to-point sends. The ranks run it once traced "
          "(every transfer logged), check the output against a single-process reference and against gloo's "
          "own collective, then time it beside gloo's built-in.",
)
