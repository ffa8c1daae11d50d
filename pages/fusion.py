"""Autograd & fusion: forward and backward graphs with their fused kernels, the passes' log and why-not reasons,
the generated Triton source, kernels and bytes measured before and after, and the memory plan over time."""

import altair as alt
import pandas as pd
import streamlit as st

from pages import graph_view, timeline, ui, units

st.title("Autograd & fusion")


def render(result: dict, rec) -> None:
    """The headline figures, then four tabs: graphs, kernels and their source, the passes, the memory plan."""
    m, t = result["metrics"], result["tables"]
    _figures(m)
    graphs, kernels, passes, memory = st.tabs(["Graphs", "Kernels and source", "Passes and why-not", "Memory plan"])
    with graphs:
        _graphs(t)
    with kernels:
        _kernels(t, rec)
    with passes:
        _passes(t)
    with memory:
        _memory(m, t)


def _figures(m: dict) -> None:
    """Kernels launched and generated, Inductor's counts, bytes touched, what the backward keeps, the arena."""
    cols = st.columns(4)
    cols[0].metric("kernels launched", f"{m['kernels_unfused']} → {m['kernels_fused']}",
                   help="one kernel per op (no passes) → the fused program; both ran. Library calls (matmuls) included.")
    cols[1].metric("Triton kernels, fwd + bwd", f"{m['generated_forward']} + {m['generated_backward']}",
                   help=f"generated: {m['generated_forward']} forward, {m['generated_backward']} backward; "
                        f"plus {m['extern_kernels']} library calls")
    if "inductor_forward_kernels" in m:
        cols[2].metric("Inductor kernels, fwd + bwd", f"{m['inductor_forward_kernels']} + {m['inductor_backward_kernels']}",
                       help=f"measured: {m['inductor_backend']}, plus {m['inductor_extern_calls']} library calls")
    else:
        cols[2].metric("Inductor kernels, fwd + bwd", "not run", help="tick 'inductor' in the settings to compile and count them")
    units.before_after(cols[3], "bytes the kernels touched", m["bytes_unfused"], m["bytes_fused"], "B",
                    help=f"distinct bytes each generated kernel read or wrote, counted by the kernels: "
                         f"{m['bytes_unfused']:,} B one kernel per op → {m['bytes_fused']:,} B fused. Graph inputs and "
                         f"outputs once: {m['ideal_unique_bytes']:,} B; library calls (modelled): {m['extern_modelled_bytes']:,} B")
    cols = st.columns(4)
    if "saved_bytes_naive" in m:
        units.before_after(cols[0], "kept for the backward", m["saved_bytes_naive"], m["saved_bytes_min_cut"], "B",
                        help=f"forward values the backward reads: every one it uses ({m['saved_bytes_naive']:,} B) → "
                             f"the min cut ({m['saved_bytes_min_cut']:,} B; the rest is recomputed)")
    cols[1].metric("memory arena", units.si(m["arena_bytes"], "B"), help=f"{m['arena_bytes']:,} B: intermediate buffers at their planned offsets")
    cols[2].metric("lower bound", units.si(m["lower_bound_bytes"], "B"), help=f"{m['lower_bound_bytes']:,} B: most bytes live at any one step")
    cols[3].metric("without reuse", units.si(m["no_reuse_bytes"], "B"), help=f"{m['no_reuse_bytes']:,} B: every intermediate buffer in its own memory")


def _graphs(t: dict) -> None:
    st.caption("Blue pointwise, red reduction, green library call, grey view; dashed boxes are fused kernels; "
               "dashed nodes are values read from the other phase (what the forward saved).")
    for d in t["graph_dot"]:  # one under the other, each full width: a backward graph has dozens of nodes
        st.markdown(f"**{d['phase'].capitalize()}**")
        graph_view.graph(d["dot"])
    if t["saved"]:  # empty without the backward
        st.caption("Saved between forward and backward after the min cut")
        ui.table(pd.DataFrame(t["saved"]))


def _kernels(t: dict, rec) -> None:
    table = pd.DataFrame(t["kernels"])
    ui.table(table, column_config={
        "requested_bytes": st.column_config.NumberColumn("requested (B)", help="every load and store, counted"),
        "unique_bytes": st.column_config.NumberColumn("touched (B)", help="distinct bytes: what DRAM sees if caches hold reuse"),
        "ideal_bytes": st.column_config.NumberColumn("ideal (B)", help="the group's inputs and outputs, each once"),
        "unique_over_ideal": st.column_config.NumberColumn("touched / ideal", format="%.2f")})
    sources = {s["kernel"]: s for s in t["sources"]}
    if sources:
        pick = st.selectbox("Generated Triton source", list(sources), key="fusion-source")
        st.caption(f"Template: {sources[pick]['template']}")
        st.code(sources[pick]["source"], language="python")
        st.download_button("Download all generated kernels (.py)", "\n\n".join(s["source"] for s in t["sources"]),
                           file_name=f"{rec.id}-kernels.py")
    timeline.run_timeline(rec, title="The fused program's launches, in order (wall time on this machine)")


def _passes(t: dict) -> None:
    """One table under the other, full width: both hold sentences."""
    st.subheader("What the passes did")
    ui.table(pd.DataFrame(t["log"]))
    st.subheader("Why these did not fuse")
    why = pd.DataFrame(t["why_not"])
    if why.empty:
        st.info("Every candidate pair fused.")
    else:
        ui.table(why)


def _memory(m: dict, t: dict) -> None:
    """Live intermediate bytes per step, and each buffer as a box of its lifetime across and its bytes up."""
    live = pd.DataFrame(t["memory_over_time"])
    plan = pd.DataFrame(t["memory_plan"])
    if plan.empty:
        st.info("No intermediate buffers: every value stays inside a kernel or is a graph output.")
        return
    steps = len(live)
    integer_axis = alt.Axis(tickMinStep=1, format="d")
    chart = alt.Chart(live).mark_bar(opacity=0.7).encode(
        x=alt.X("step:O", title="schedule step (kernels in launch order; hover for the kernel)"),
        y=alt.Y("live_bytes:Q", title="live intermediate bytes (B)"),
        tooltip=["step", "kernel", alt.Tooltip("live_bytes:Q", title="live bytes (B)", format=",")])
    st.altair_chart(chart.properties(height=200), width="stretch")
    plan["end"] = plan["last_step"] + 1
    plan["top"] = plan["offset"] + plan["bytes"]
    boxes = alt.Chart(plan).mark_rect(stroke="white", opacity=0.85).encode(
        x=alt.X("first_step:Q", title="schedule step (a box spans the steps its buffer is live)", axis=integer_axis,
                scale=alt.Scale(domain=[0, steps])), x2="end:Q",
        y=alt.Y("offset:Q", title="arena offset (B)"), y2="top:Q",
        color=alt.Color("buffer:N", legend=None),
        tooltip=["buffer", alt.Tooltip("bytes:Q", title="bytes (B)", format=","), alt.Tooltip("offset:Q", title="offset (B)"),
                 "first_step", "last_step", "written_by"])
    st.caption(f"Each buffer is a box: its lifetime across, its bytes up. Boxes never overlap: the arena is "
               f"{m['arena_bytes']:,} B against a lower bound of {m['lower_bound_bytes']:,} B.")
    st.altair_chart(boxes.properties(height=260), width="stretch")


ui.experiment_page("graph.fusion", render,
                   intro="The function and its backward are traced to aten ops (make_fx, LayerNorm/GELU/softmax decomposed, the "
                         "incoming gradient an input); dead code, common subexpressions and constants go; a min cut picks what "
                         "the backward recomputes; ops are fused into kernels and each kernel is generated as Triton source, "
                         "run, and checked against eager PyTorch.")
