"""Paged attention: a serving run over the paged block manager, beside contiguous max-length reservations."""
import altair as alt
import pandas as pd
import streamlit as st

from pages import form, ui

st.title("Paged attention: the KV cache as pages")
st.page_link("pages/serving.py", label="Latency, throughput and a simulator: the Serving page runs the tiny LLaMA on these pages",
             icon=":material/speed:")
st.page_link("pages/paged_decode.py", label="The tiny decoder's real K/V in these pages, read by the Triton kernel: Paged attention, the kernel",
             icon=":material/view_module:")

STATE_COLORS = alt.Scale(domain=["used", "cached, free", "free"], range=["#1f6fd1", "#f2a541", "#e6e9ef"])


def render(result: dict, rec) -> None:
    m = result["metrics"]
    cols = st.columns(5)
    cols[0].metric("KV used, paged", f"{100 * m['utilization.paged']:.1f} %",
                   help="share of the KV memory holding tokens, with pages allocated as tokens arrive")
    cols[1].metric("KV used, contiguous", f"{100 * m['utilization.contiguous']:.1f} %",
                   help="share of the same KV memory holding tokens, with each sequence's maximum length reserved")
    cols[2].metric("most sequences", f"{m['max_running.paged']} vs {m['max_running.contiguous']}",
                   help="the most sequences running at once: paged vs contiguous, in the same memory")
    cols[3].metric("preemptions / swaps", f"{m['preemptions']} / {m['swaps']}")
    cols[4].metric("prefix hit rate", f"{100 * m['prefix_hit_rate']:.1f} %", help=f"{m['prefix_hit_tokens']:,} prompt tokens reused")

    waste = pd.DataFrame(result["tables"]["waste"])
    st.subheader("Where the KV memory goes")
    st.altair_chart(alt.Chart(waste).mark_bar().encode(
        x=alt.X("share:Q", title="share of KV memory held", axis=alt.Axis(format="%")), y=alt.Y("allocator:N", title=None),
        color=alt.Color("kind:N", title=None), tooltip=["allocator", "kind", alt.Tooltip("share:Q", format=".2%")],
    ).properties(height=120), width="stretch")

    series = pd.DataFrame(result["tables"]["series"])
    left, right = st.columns(2)
    left.altair_chart(alt.Chart(series).mark_line().encode(
        x=alt.X("step:Q", title="scheduler step"), y=alt.Y("running:Q", title="running sequences"), color="allocator:N",
        tooltip=["allocator", "step", "running", "waiting"]).properties(height=240, title="Concurrency"), width="stretch")
    right.altair_chart(alt.Chart(series.dropna(subset=["utilization"])).mark_line().encode(
        x=alt.X("step:Q", title="scheduler step"), y=alt.Y("utilization:Q", title="allocated slots holding tokens", axis=alt.Axis(format="%")),
        color="allocator:N").properties(height=240, title="Utilisation"), width="stretch")

    snaps = result["tables"]["snapshots"]
    if snaps:
        st.subheader("The pool and the page tables, through the run")
        idx = st.slider("snapshot", 0, len(snaps) - 1, len(snaps) // 2, key=f"snap-{rec.id}",
                        format="%d", help="snapshots spread evenly over the run; the caption gives the step")
        snap = snaps[idx]
        n = len(snap["ref"])
        width = 64
        pool = pd.DataFrame({"block": range(n), "ref": snap["ref"], "fill": snap["fill"], "state": snap["state"], "owner": snap["owner"]})
        pool["x"], pool["y"] = pool["block"] % width, pool["block"] // width
        st.caption(f"Step {snap['step']}: {snap['used']} used, {snap['cached_free']} cached but free, {snap['free']} free blocks")
        st.altair_chart(alt.Chart(pool).mark_rect().encode(
            x=alt.X("x:O", axis=None), y=alt.Y("y:O", axis=None), color=alt.Color("state:N", scale=STATE_COLORS, title="block"),
            opacity=alt.condition(alt.datum.ref > 1, alt.value(1.0), alt.value(0.85)),
            tooltip=["block", "state", "ref", "fill", "owner"]).properties(height=max(80, 9 * (n // width + 1))), width="stretch")
        tables = pd.DataFrame(snap["tables"])
        if not tables.empty:
            st.caption("Block tables of the first running sequences: logical block → physical block")
            st.altair_chart(alt.Chart(tables).mark_rect(stroke="white").encode(
                x=alt.X("logical:O", title="logical block"), y=alt.Y("seq:N", title="sequence"),
                color=alt.Color("physical:Q", title="physical block", scale=alt.Scale(scheme="viridis")),
                tooltip=["seq", "logical", "physical"]) + alt.Chart(tables).mark_text(fontSize=8, color="white").encode(
                x="logical:O", y="seq:N", text="physical:Q"), width="stretch")
    events = pd.DataFrame(result["tables"]["events"])
    if not events.empty:
        with st.expander(f"Events ({len(events)} shown): preemptions, swaps, copy-on-write"):
            ui.table(events)


form.trace_upload("kvcache.serve", "scheduler steps", ui.store().root)
ui.experiment_page(
    "kvcache.serve", render,
    intro="Continuous batching over a ShareGPT-like request trace (or your CSV), once with KV in fixed-size pages "
          "allocated as tokens arrive, once with contiguous reservations of the maximum length in the same memory.",
)
