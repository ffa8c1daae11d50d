"""KV cache: MHA, MQA, GQA, MLA — cache bytes per token measured from live generation, beside the formulas."""
import altair as alt
import pandas as pd
import streamlit as st

from pages import decode_view, int8_view, ui

st.title("KV cache: MHA, MQA, GQA, MLA")


def render(result: dict, rec) -> None:
    cfg, tables = rec.config, result["tables"]
    cache = pd.DataFrame(tables["cache"])
    st.subheader("Cache bytes per token per layer: measured from the cache tensors, and the formula")
    long = cache.melt(id_vars=["variant"], value_vars=["bytes_per_token_per_layer", "formula_bytes"], var_name="source", value_name="bytes")
    long["source"] = long["source"].map({"bytes_per_token_per_layer": "measured", "formula_bytes": "formula"})
    st.altair_chart(alt.Chart(long).mark_bar().encode(
        x=alt.X("bytes:Q", title="bytes per token per layer (fp32)"), y=alt.Y("variant:N", title=None),
        yOffset="source:N", color=alt.Color("source:N", title=None),
        tooltip=["variant", "source", alt.Tooltip("bytes:Q", format=",.0f")],
    ).properties(height=60 * len(cache)), width="stretch")
    ui.table(cache, column_config={
        "saving_vs_mha_pct": st.column_config.NumberColumn("saving vs MHA", format="%.1f %%"),
        "bytes_per_token_per_layer": st.column_config.NumberColumn("measured (B)", format="%.0f"),
        "formula_bytes": st.column_config.NumberColumn("formula (B)", format="%.0f")})
    fit = pd.DataFrame(tables["fit"])
    if not fit.empty:  # empty in a run of schema version 1
        gpu_live = st.selectbox("GPU memory for this shape's cache", list(fit["gpu"].unique()), index=1, key=f"gpu-live-{rec.id}")
        ui.table(fit[fit["gpu"] == gpu_live][["variant", "tokens"]].rename(columns={"tokens": "tokens that fit (all layers, fp32)"}))
    st.caption(f"Shape: n_h={cfg['n_heads']}, n_g={cfg['n_kv_heads']}, d_h={cfg['d_head']}, d_c={cfg['d_c']}, "
               f"d_h^R={cfg['d_rope']}, l={cfg['n_layers']}. Formulas: MHA 2·n_h·d_h, GQA 2·n_g·d_h, MQA 2·d_h, "
               "MLA d_c + d_h^R (absorbed), n_h·(2·d_h + d_h^R) (naive), per layer.")

    ds = result["metrics"]["deepseek_v3_scaled_measured_elements"]
    st.info(f"DeepSeek-V3 by formula: MLA caches 512 + 64 = **576** elements per layer per token against **32,768** "
            f"for MHA with 128 heads of 128 (1.76 %). Measured live on a model with the same 128 heads and every width ÷16: "
            f"**{ds['mla']:.0f}** against **{ds['mha']:.0f}** ({result['metrics']['deepseek_v3_scaled_mla_over_mha_pct']:.2f} %).")

    speed = pd.DataFrame(tables["decode_speed"])
    if not speed.empty:
        st.subheader("Decoding as the context grows")
        left, right = st.columns(2)
        m = result["metrics"]
        low, top = m["decode_speed.axis_low_ms"], m["decode_speed.axis_high_ms"]
        points = alt.Chart(speed).mark_circle(size=14, opacity=0.35, clip=True).encode(
            x=alt.X("context:Q", title="context (tokens)"),
            y=alt.Y("ms_per_token:Q", title="time per generated token (ms)", scale=alt.Scale(domain=[low, top])),
            color="variant:N", tooltip=["variant", "context", alt.Tooltip("ms_per_token:Q", format=".3f", title="ms")])
        lines = alt.Chart(speed).mark_line().encode(x="context:Q", y="median_ms:Q", color="variant:N")
        left.caption("Time per generated token: each step (dots) and the rolling median of 9 (lines)")
        left.altair_chart((points + lines).properties(height=260), width="stretch")
        if m["decode_speed.off_chart_steps"]:
            left.caption(f"{m['decode_speed.off_chart_steps']} step(s) above {top:.2f} ms are off the chart "
                         f"(slowest {m['decode_speed.slowest_ms']:.1f} ms): the OS paused the process, not the cache.")
        right.caption("Cache bytes each new token reads: they grow with the context, by the variant's bytes per token")
        right.altair_chart(alt.Chart(speed).mark_line().encode(
            x=alt.X("context:Q", title="context (tokens)"), y=alt.Y("cache_bytes_read:Q", title="cache bytes read per token (B)"),
            color="variant:N", tooltip=["variant", "context", alt.Tooltip("cache_bytes_read:Q", format=",")]).properties(height=260), width="stretch")

    st.subheader("MLA dataflow for one token (cached tensors in orange)")
    dots = {row["form"]: row["dot"] for row in tables["mla_dataflow"]}
    if dots:
        mode = st.radio("form", list(dots), horizontal=True, key=f"mla-mode-{rec.id}")
        st.graphviz_chart(dots[mode])
    else:
        st.caption("This run did not draw the dataflow (stored before runs did): run it again to see it.")

    rope = pd.DataFrame(tables["mla_rope"])
    if not rope.empty:
        mla_rope(rope, result["metrics"])

    st.subheader("Published models, by formula (bf16 cache)")
    presets = pd.DataFrame(tables["presets"]).rename(columns={"tokens_that_fit": "tokens that fit"})
    gpu = st.selectbox("GPU memory for the cache", list(presets["gpu"].unique()), index=min(1, presets["gpu"].nunique() - 1))
    presets = presets[presets["gpu"] == gpu].drop(columns="gpu")
    ui.table(presets)
    st.caption("Formula, not a measurement: cache only (weights and activations need memory too), all layers, one sequence's tokens.")
    int8_view.kv_short()
    decode_view.short("kv")


def mla_rope(rope: pd.DataFrame, m: dict) -> None:
    st.subheader("MLA: why RoPE breaks absorption, and decoupled RoPE")
    left, right = st.columns(2)
    left.metric("RoPE on the compressed keys", f"{100 * m['mla_rope.compressed_relative_error']:.0f} % error",
                help="absorbed against naive scores, largest error relative to the largest score, float64")
    right.metric("decoupled RoPE", f"{m['mla_rope.decoupled_relative_error']:.1e} error", help="the same comparison")
    rope = rope.assign(relative_error=rope["relative_error"].clip(lower=1e-17))
    st.altair_chart(alt.Chart(rope).mark_line(point=True).encode(
        x=alt.X("query_position:Q", title="query position m (tokens)"),
        y=alt.Y("relative_error:Q", title="relative error (floor 1e-17)", scale=alt.Scale(type="log")),
        color=alt.Color("path:N", title="RoPE on"), tooltip=["path", "query_position", alt.Tooltip("max_abs_error:Q", format=".2e")],
    ).properties(height=240), width="stretch")
    st.caption("Relative error: the largest |absorbed − naive| score over the keys up to m, ÷ the largest score. Rotating the cached latents, (R_m c_Q)ᵀ W_merge (R_n c_KV), is not (R_m W^UQ c_Q)ᵀ (R_n W^UK c_KV): matrices do "
               "not commute, so the two agree only at position 0. Decoupled RoPE rotates a separate k^R and leaves c_KV plain.")
    with st.expander("The algebra"):
        st.markdown("Naive with RoPE on the keys: c_Qᵀ W^UQᵀ R_(n−m) W^UK c_KV, whose middle depends on n − m, so no single "
                    "W_merge = W^UQᵀ W^UK can be precomputed. Decoupled: q = [W^UQ c_Q; R_m W^QR c_Q], k = [W^UK c_KV; R_n W^KR h]; "
                    "the absorbed form caches (c_KV, k^R) and scores c_Qᵀ W_merge c_KV + q^R·k^R, the same sum in another order.")


ui.experiment_page(
    "attention.kv_cache", render,
    intro="Generates greedily with a real KV cache for each attention variant of a tiny LLaMA-style decoder "
          "(RMSNorm, SwiGLU, RoPE) and reads the cache's size off its tensors.",
)
