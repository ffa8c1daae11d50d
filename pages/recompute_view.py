"""Recomputation's price on the pipeline page: the extra forward FLOPs and CPU time against the same run without it,
and the activation memory it saved, each beside its model."""
import altair as alt
import pandas as pd
import streamlit as st

from pages import ui


def recompute_price(result: dict) -> None:
    """What recomputation cost (FLOPs counted, CPU time measured) and saved (peak activation bytes), each against the
    same run without it on the same ranks, with the models beside."""
    m, rows = result["metrics"], pd.DataFrame(result["tables"]["recompute"])
    st.subheader("Recomputation's price")
    cols = st.columns(5)
    cols[0].metric("extra FLOPs (counted)", f"+{100 * m['recompute_flops_overhead']:.1f} %",
                   help="forwards executed × FlopCounterMode's count per micro-batch; textbook 3 → 4 units: +33 %")
    cols[1].metric("extra CPU time (measured)", f"+{100 * m['recompute_time_overhead']:.1f} %",
                   help=f"against the same run without recomputation; its F/(F+B) predicts +{100 * m['recompute_time_model']:.1f} %")
    cols[2].metric("recompute ÷ forward time", f"{m['recompute_to_forward_time']:.2f}",
                   help="median CPU time of a recomputation over that of the same micro-batch's forward without it; model: 1")
    cols[3].metric("peak activations saved", f"{m['activation_peak_saved_bytes'] / 1024:,.0f} KiB",
                   help="the largest saving on one rank, measured on the storages autograd saved")
    peaks = pd.concat([
        rows.assign(run="without recompute", measured=rows["peak_without_bytes"], model=rows["peak_without_model_bytes"]),
        rows.assign(run="with recompute", measured=rows["peak_activation_bytes"], model=rows["peak_model_bytes"])])
    peaks["rank"] = peaks["rank"].map(lambda r: f"rank {r}")
    base = alt.Chart(peaks).encode(x=alt.X("run:N", title=None), y=alt.Y("measured:Q", title="peak activation bytes per rank"))
    tooltip = ["rank", "run", alt.Tooltip("measured:Q", format=",", title="measured (bytes)"),
               alt.Tooltip("model:Q", format=",", title="model (bytes)")]
    memory = (base.mark_bar().encode(color=alt.Color("run:N", legend=None), tooltip=tooltip)
              + base.mark_tick(color="black", thickness=2, size=30).encode(y="model:Q", tooltip=tooltip)).properties(
        width=110, height=220).facet(column=alt.Column("rank:N", title=None)).properties(
        title="Peak activations held for backward: measured bars, model ticks")
    times = pd.concat([rows.assign(run="without recompute", cpu_ms=rows["compute_cpu_without_ms"]),
                       rows.assign(run="with recompute", cpu_ms=rows["compute_cpu_ms"])])
    times["rank"] = times["rank"].map(lambda r: f"rank {r}")
    time_chart = alt.Chart(times).mark_bar().encode(
        x=alt.X("run:N", title=None), y=alt.Y("cpu_ms:Q", title="compute CPU time per rank (ms)"), color=alt.Color("run:N", legend=None),
        column=alt.Column("rank:N", title=None),
        tooltip=["rank", "run", alt.Tooltip("cpu_ms:Q", format=".1f", title="CPU (ms)"),
                 alt.Tooltip("recompute_cpu_ms:Q", format=".1f", title="of which recomputation (ms)")]).properties(
        width=110, height=220, title="Compute CPU time, with and without recomputation")
    st.altair_chart(memory, width="content")
    st.altair_chart(time_chart, width="content")
    with st.expander("The models and the per-rank figures"):
        st.markdown("Per micro-batch of b samples on a stage of L Linear(h, h)+tanh layers: forward 2·b·h²·L FLOPs; held for "
                    "backward the input and every tanh output, A = (L+1)·b·h·8 bytes (the last stage +b·h·8 for the loss), "
                    "with recomputation only the input, A_in = b·h·8. A rank holding k micro-batches peaks at k·A without "
                    "recomputation and k·A_in + (A − A_in) with it. Forward + backward ≈ 3 units, with recomputation 4 (+33 %, "
                    "seed 003).")
        ui.table(rows)
