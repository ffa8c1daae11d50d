"""Context parallel: ring attention on gloo ranks, the K/V blocks' journey and the log-sum-exp merge."""
import altair as alt
import pandas as pd
import streamlit as st

from pages import timeline, ui

st.title("Context parallel: ring attention")


def render(result: dict, rec) -> None:
    m, t = result["metrics"], result["tables"]
    cols = st.columns(3)
    cols[0].metric("unmasked scores, busiest ÷ mean", f"{m['unmasked scores, max / mean over ranks']:.2f}",
                   help="1.00: every rank attends to as many (query, key) pairs as the others")
    cols[1].metric("forward compute, slowest ÷ mean", f"{m['forward compute ms, max / mean over ranks']:.2f}")
    cols[2].metric("one K/V block", f"{m['K/V block bytes']:,} B")

    layout = pd.DataFrame(t["layout"])
    st.altair_chart(alt.Chart(layout).mark_tick(thickness=3).encode(
        x=alt.X("position:Q", title="token position in the sequence"), y=alt.Y("rank:O", title="rank"), color="rank:N",
        tooltip=["rank", "position"]).properties(height=alt.Step(28), title="Which tokens each rank holds"), width="stretch")

    steps = pd.DataFrame(t["steps"])
    steps["what"] = steps.apply(lambda s: f"block of rank {s['block_of_rank']}" + ("" if s["computed"] else " (masked: skipped)"), axis=1)
    left, right = st.columns(2)
    base = alt.Chart(steps).encode(x=alt.X("step:O", title="ring step"), y=alt.Y("rank:O", title="rank"))
    left.altair_chart((base.mark_rect().encode(color=alt.Color("block_of_rank:N", title="K/V block of rank"),
                                               opacity=alt.condition(alt.datum.computed, alt.value(1.0), alt.value(0.3)),
                                               tooltip=["rank", "step", "what"])
                       + base.mark_text().encode(text="block_of_rank:N")).properties(height=200, title="The K/V block each rank holds at each step"),
                      width="stretch")
    right.altair_chart(alt.Chart(steps.dropna(subset=["running_lse_last_query"])).mark_line(point=True).encode(
        x=alt.X("step:O", title="ring step"), y=alt.Y("running_lse_last_query:Q", title="running log-sum-exp", scale=alt.Scale(zero=False)),
        color="rank:N", tooltip=["rank", "step", "what", alt.Tooltip("running_lse_last_query:Q", format=".4f")]).properties(
        height=200, title="log-sum-exp of each rank's last query, merged block by block"), width="stretch")
    st.caption("Each step's partial output merges into the running one by L = log(e^L + e^L_i), "
               "O = e^(L_old − L)·O + e^(L_i − L)·O_i: FlashAttention's online softmax, across ranks instead of tiles.")

    ring = pd.DataFrame(t["ring"])
    st.altair_chart(alt.Chart(ring.melt(id_vars=["rank", "what"], value_vars=["hidden_us", "blocked_us"], var_name="time", value_name="us")).mark_bar().encode(
        y=alt.Y("what:N", title=None), x=alt.X("us:Q", title="time in flight (µs)"), color=alt.Color("time:N", title=None),
        row=alt.Row("rank:N"), tooltip=["rank", "what", "time", alt.Tooltip("us:Q", format=".0f")]).properties(height=alt.Step(14), width=500))
    st.caption("hidden: the transfer ran while the rank computed on the previous block; blocked: the rank waited for it.")
    ui.table(pd.DataFrame(t["work"]))
    timeline.run_timeline(rec, title="Per-rank timeline: attention compute beside the K/V transfers in flight")


ui.experiment_page(
    "parallel.cp", render,
    intro="Each rank holds a chunk of the sequence. K/V blocks travel round the ring, the next one in flight while the "
          "current one is attended to, and the partial results merge by their log-sum-exp. Output and dQ, dK, dV are "
          "checked against torch's scaled_dot_product_attention on the whole sequence.")
