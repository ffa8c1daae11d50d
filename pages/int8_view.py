"""Drawing numerics.int8: the full view (number formats page) and the INT8 KV cache's short view (KV-cache page),
from stored runs only."""
from __future__ import annotations

import altair as alt
import pandas as pd
import streamlit as st

from pages import ui, units

EXPERIMENT = "numerics.int8"


def render(result: dict, rec) -> None:
    m, t, cfg = result["metrics"], result["tables"], rec.config
    models = pd.DataFrame(t["models"])
    cols = st.columns(4)
    cols[0].metric("weights, INT8", units.si(m["weight_bytes.int8"], "B"), f"{-m['weight_saving_pct']:.0f} % from fp32",
                   delta_color="inverse", help=f"fp32 {m['weight_bytes.fp32']:,} B; INT8 integers plus one fp32 scale per output channel")
    cols[1].metric("held-out loss, fp32", f"{m['held_out_loss.fp32']:.4f} nats", help=f"entropy-rate floor {m['entropy_rate_nats']:.4f}")
    cols[2].metric("W8A8 loss", f"{m['held_out_loss.w8a8']:.4f} nats", f"{m['w8a8_loss_change_nats']:+.4f}",
                   delta_color="inverse")
    cols[3].metric("INT8 KV cache", f"{m['kv_bytes_per_token.int8']} B/token", f"{m['kv_bytes_change_pct']:.0f} % from fp32",
                   delta_color="inverse", help=f"fp32: {m['kv_bytes_per_token.fp32']} B per token, all layers")

    st.subheader("Weights and held-out loss: fp32, weight-only INT8 (W8), INT8 × INT8 → INT32 (W8A8)")
    left, right = st.columns(2)
    left.altair_chart(alt.Chart(models).mark_bar().encode(
        x=alt.X("weight_bytes:Q", title="weight bytes as stored (B)"), y=alt.Y("model:N", title=None, sort=None),
        tooltip=["model", alt.Tooltip("weight_bytes:Q", format=",")]).properties(height=150))
    right.altair_chart((alt.Chart(models).mark_point(filled=True, size=80).encode(
        x=alt.X("held_out_loss:Q", title="held-out loss (nats/token)", scale=alt.Scale(zero=False)), y=alt.Y("model:N", title=None, sort=None),
        tooltip=["model", alt.Tooltip("held_out_loss:Q", format=".5f"), alt.Tooltip("loss_increase:Q", format="+.5f"),
                 alt.Tooltip("stderr:Q", format=".4f")])
        + alt.Chart(models).mark_rule().encode(x="loss_low:Q", x2="loss_high:Q", y=alt.Y("model:N", sort=None))).properties(height=150))
    ui.table(models.drop(columns=["loss_low", "loss_high"]), column_config={
        "held_out_loss": st.column_config.NumberColumn("held-out loss", format="%.5f"),
        "loss_increase": st.column_config.NumberColumn("vs fp32 (nats)", format="%+.5f"),
        "max_rel_logit_error": st.column_config.NumberColumn("max logit error (rel.)", format="%.2e"),
        "greedy_agreement": st.column_config.NumberColumn("argmax agrees", format="percent")})
    head = "kept in fp32 (seed 002: the last layer in higher precision)" if cfg["keep_head"] else "quantised too"
    st.caption(f"The tiny LLaMA trained {cfg['steps']} steps on the Markov corpus; the embedding and norms stay fp32, the head is {head}. "
               "Error bars: one standard error of the held-out mean.")

    st.subheader("The INT32 accumulation, against exact integers")
    st.markdown(f"A 64 × {m['gemm_k']:,} × 256 GEMM of INT8 operands through torch's INT32 GEMM equals numpy's int64 product in "
                f"every element; its largest sum is **{m['largest_abs_sum']:,}**, past 2²⁴ = 16,777,216, so float32 accumulation "
                f"would get **{m['fp32_accumulation_wrong_elements']:,}** of 16,384 elements wrong. INT32 cannot overflow "
                "below k ≈ 2³¹ / 127² ≈ 133,000.")
    with st.expander("The scheme"):
        st.markdown("Weights per output channel j: s_j = max|W_j·| / 127, q = round(W / s_j) in −127..127. Activations per token t "
                    "likewise (W8A8). Y_tj = s_t · s_j · Σ_i qx_ti · qw_ji, the sum in INT32. W8 widens the INT8 weights to float "
                    "before the matmul: it saves the memory (and, in decoding, the bandwidth), not the arithmetic.")
    st.subheader("An INT8 KV cache: greedy generation against the fp32 cache")
    kv_table(t["kv_cache"])


def kv_table(rows: list[dict]) -> None:
    kv = pd.DataFrame(rows)
    ui.table(kv, column_config={
        "bytes_per_token": st.column_config.NumberColumn("bytes per token (tensors)", format="%d"),
        "formula": st.column_config.NumberColumn("formula", format="%d"),
        "max_rel_logit_error": st.column_config.NumberColumn("max logit error (rel.)", format="%.2e"),
        "greedy_agreement": st.column_config.NumberColumn("greedy tokens agree", format="percent"),
        "kl_nats": st.column_config.NumberColumn("KL to fp32 (nats)", format="%.2e")})


def kv_short() -> None:
    """The INT8 KV cache from the latest numerics.int8 run, for the KV-cache page."""
    st.subheader("An INT8 KV cache")
    found = ui.latest_run(EXPERIMENT, "the [Number formats page](number_formats) (view \"INT8 quantisation\")",
                          "its INT8 cache's bytes and error appear")
    if found is None:
        return
    result, rec = found
    rows = result["tables"]["kv_cache"]
    st.altair_chart(alt.Chart(pd.DataFrame(rows)).mark_bar().encode(
        x=alt.X("bytes_per_token:Q", title="cache bytes per token, all layers (B)"),
        y=alt.Y("cache:N", title=None, axis=alt.Axis(labelLimit=260)),
        tooltip=["cache", "bytes_per_token", alt.Tooltip("kl_nats:Q", format=".2e", title="KL to fp32 (nats)")]).properties(height=120))
    kv_table(rows)
    st.caption(f"K and V stored as INT8 with one fp32 scale per token and head, dequantised as attention reads them; greedy "
               f"generation against the fp32 cache, from {ui.run_link(rec)}.")
