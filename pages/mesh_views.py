"""Views of the mesh page's run beyond its frame: recompute's price (FLOPs, CPU time, activations saved, against the same
plan without it)."""
import altair as alt
import pandas as pd
import streamlit as st

from pages import ui


def recompute_price(result: dict) -> None:
    """Full or selective recompute against one step of the same plan without it, per rank."""
    m, rows = result["metrics"], pd.DataFrame(result["tables"]["recompute"])
    st.subheader(f"Recompute's price ({m['recompute']})")
    cols = st.columns(4)
    cols[0].metric("extra FLOPs (counted)", f"+{100 * m['recompute_flops_overhead']:.1f} %",
                   help=f"one step with recompute against one without, counted per op by torch's FLOP formulas; the model "
                        f"predicts +{100 * m['recompute_flops_model']:.1f} % (full: F/(F+B); selective: QKᵀ and P·V again)")
    cols[1].metric("extra compute CPU time", f"+{100 * m['recompute_time_overhead']:.1f} %",
                   help="CPU time of the F/B/I/W actions, all ranks, one step each (a contended 2-core machine: noisy)")
    cols[2].metric("peak activations saved", f"{m['activation_peak_saved_bytes'] / 1024:,.1f} KiB",
                   help="the largest saving on one rank: its peak of activations alive, measured, without minus with")
    if "backward_to_forward_flops" in m:
        cols[3].metric("backward ÷ forward FLOPs", f"{m['backward_to_forward_flops']:.2f}",
                       help="counted; at 2 (a GEMM's backward is two GEMMs) full recompute adds a third")
    peaks = pd.concat([rows.assign(run="without recompute", bytes=rows["activations_peak_without_bytes"],
                                   cpu_ms=rows["compute_cpu_without_ms"], flops=rows["forward_flops"] + rows["backward_flops"]),
                       rows.assign(run="with recompute", bytes=rows["activations_peak_bytes"], cpu_ms=rows["compute_cpu_ms"],
                                   flops=rows["forward_flops"] + rows["backward_flops"] + rows["extra_flops"])])
    tooltip = ["rank", "run", alt.Tooltip("bytes:Q", format=",", title="peak activations (B)"),
               alt.Tooltip("flops:Q", format=",", title="FLOPs per step"), alt.Tooltip("cpu_ms:Q", format=".2f", title="compute CPU (ms)")]
    left, right = st.columns(2)
    left.altair_chart(alt.Chart(peaks).mark_bar().encode(
        x=alt.X("rank:O", title="rank"), xOffset="run:N", y=alt.Y("bytes:Q", title="peak activations held (B)"),
        color=alt.Color("run:N", title=None), tooltip=tooltip).properties(height=240, title="Activations at each rank's peak"),
        width="stretch")
    right.altair_chart(alt.Chart(peaks).mark_bar().encode(
        x=alt.X("rank:O", title="rank"), xOffset="run:N", y=alt.Y("flops:Q", title="FLOPs per step (counted)"),
        color=alt.Color("run:N", title=None), tooltip=tooltip).properties(height=240, title="Compute per rank and step"),
        width="stretch")
    with st.expander("The models and the per-rank figures"):
        st.markdown("Full recompute keeps each stage's input from F to B (or I) and runs the stage's forward again: one more "
                    "forward per (stage, micro-batch), F/(F+B) more FLOPs, a third at F:B = 1:2 (seed 003). Selective "
                    "(Korthikanti et al. 2022) keeps q, k and v and recomputes only softmax(QKᵀ/√d)·V in the backward: "
                    "4·b·(a/tp)·s²·d FLOPs per layer per micro-batch, dropping the a·s²·b scores from what each block holds.")
        ui.table(rows)
