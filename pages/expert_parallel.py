"""Expert parallel: an MoE layer's experts on different gloo ranks; routing, drops and the all-to-all, measured."""
import altair as alt
import pandas as pd
import streamlit as st

from pages import timeline, ui

st.title("Expert parallel")


def render(result: dict, rec) -> None:
    m, t = result["metrics"], result["tables"]
    cols = st.columns(3)
    cols[0].metric("assignments dropped", f"{m['dropped assignments']} of {m['assignments']}",
                   help="(token, expert) pairs over an expert's capacity ceil(cf·T·k/E) on their rank")
    cols[1].metric("drop rate", f"{100 * m['drop rate']:.1f} %")
    cols[2].metric("load imbalance", f"{m['max / mean rows per rank']:.2f}", help="rows computed: busiest rank ÷ mean")

    st.subheader("Routing: tokens per expert, from each rank")
    experts = pd.DataFrame(t["experts"])
    long = experts.melt(id_vars=["source rank", "expert", "on rank", "capacity"], value_vars=["kept", "dropped"],
                        var_name="fate", value_name="assignments")
    bars = alt.Chart().mark_bar().encode(
        x=alt.X("expert:O", title="expert"), y=alt.Y("assignments:Q", title="(token, expert) assignments"),
        color=alt.Color("fate:N", scale=alt.Scale(domain=["kept", "dropped"], range=["#1f6fd1", "#e4572e"])),
        tooltip=["source rank", "expert", "on rank", "fate", "assignments", "capacity"])
    rule = alt.Chart().mark_tick(color="black", thickness=2).encode(x="expert:O", y="capacity:Q", tooltip=["capacity"])
    st.altair_chart(alt.layer(bars, rule, data=long).properties(height=220, width=260).facet(
        column=alt.Column("source rank:N", title="tokens of rank")))
    st.caption("Black ticks: the capacity per expert per rank. First choices are served before second choices, then "
               "tokens in order; the rest are dropped.")

    left, right = st.columns(2)
    a2a = pd.DataFrame(t["all_to_all"])
    base = alt.Chart(a2a).encode(x=alt.X("to rank:O", title="to rank (expert's home)"), y=alt.Y("from rank:O", title="from rank (token's home)"))
    left.altair_chart((base.mark_rect().encode(color=alt.Color("rows:Q", title="rows"),
                                               tooltip=["from rank", "to rank", "rows", alt.Tooltip("bytes:Q", format=",", title="bytes (B)")])
                       + base.mark_text(color="white").encode(text="rows:Q")).properties(height=240, title="Dispatch all-to-all: rows sent"),
                      width="stretch")
    load = pd.DataFrame(t["load"])
    right.altair_chart(alt.Chart(load).mark_bar().encode(
        x=alt.X("rank:O", title="rank"), y=alt.Y("rows computed:Q", title="rows its experts computed"), color="expert:N",
        tooltip=["rank", "expert", "rows computed"]).properties(height=240, title="Work per rank"), width="stretch")
    ui.table(experts)
    timeline.run_timeline(rec, title="Per-rank timeline: routing, all-to-alls, experts")


ui.experiment_page(
    "parallel.ep", render,
    intro="Each rank holds the router and shared expert whole, E/n routed experts, and a slice of the tokens (Switch "
          "Transformers' expert and data parallelism). Tokens go to their experts' ranks and back by all-to-alls of "
          "uneven sizes; the output and every gradient are checked against the same MoE in one process.")
