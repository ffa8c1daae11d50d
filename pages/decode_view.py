"""Drawing hardware.decode: the full view (GPU memory hierarchy page) and the short views the serving, KV-cache and
speculative pages show from the latest run of it. Pages draw only; every figure comes from a stored run."""
from __future__ import annotations

import altair as alt
import pandas as pd
import streamlit as st

from pages import ui, units

EXPERIMENT = "hardware.decode"


def step_chart(steps: pd.DataFrame, height: int = 280) -> alt.Chart:
    """Measured decode-step time per batch size beside the roofline's prediction and its two terms."""
    fields = {"measured_s": "measured (thread CPU time)", "predicted_s": "predicted: fixed cost + max of the two",
              "memory_s": "bytes ÷ copy bandwidth", "compute_s": "FLOPs ÷ matmul rate",
              "overhead_s": "fixed cost (the step at width 64)"}
    long = steps.melt(id_vars=["batch", "error_pct"], value_vars=[f for f in fields if f in steps], var_name="series",
                      value_name="seconds")
    long["series"] = long["series"].map(fields)
    return alt.Chart(long).mark_line(point=True).encode(
        x=alt.X("batch:Q", scale=alt.Scale(type="log", base=2), title="batch size (sequences per step)"),
        y=alt.Y("seconds:Q", scale=alt.Scale(type="log"), title="one decode step (s)"),
        color=alt.Color("series:N", title=None), strokeDash=alt.StrokeDash("series:N", title=None),
        tooltip=["series", "batch", alt.Tooltip("seconds:Q", format=".4f"),
                 alt.Tooltip("error_pct:Q", format="+.0f", title="measured vs predicted (%)")]).properties(height=height)


def render(result: dict, rec) -> None:
    """The full view: this CPU measured against the roofline, and the published models on a GPU preset's roofline."""
    m, t, cfg = result["metrics"], result["tables"], rec.config
    steps = pd.DataFrame(t["cpu_steps"])
    first = steps.iloc[0]
    cols = st.columns(4)
    cols[0].metric("weights read per step", units.si(m["weight_MB"] * 1e6, "B"), help=f"{m['params']:,} parameters, fp32")
    cols[1].metric(f"batch {first['batch']}: measured", f"{1e3 * first['measured_s']:.1f} ms",
                   f"{first['error_pct']:+.0f} % vs predicted", delta_color="off",
                   help=f"predicted {1e3 * first['predicted_s']:.1f} ms = fixed cost + max(bytes ÷ bandwidth, FLOPs ÷ matmul rate)")
    cols[2].metric("this CPU: copy bandwidth", units.rate(m["cpu_bandwidth_GBps"]), help="the hardware.roofline probe, measured in this run")
    cols[3].metric("this CPU: ridge point", f"{m['ridge_point_flops_per_byte']:.1f} FLOP/B",
                   help=f"matmul {m['cpu_matmul_GFLOPs']:.0f} GFLOP/s ÷ bandwidth; {cfg['gpu']}: {m['gpu_ridge_flops_per_byte']:.0f} FLOP/B (fp16)")

    st.subheader("A decode step of the tiny LLaMA on this CPU, by batch size")
    st.altair_chart(step_chart(steps).interactive())
    st.caption(f"d_model {cfg['d_model']}, {cfg['n_layers']} layers, {cfg['context']} tokens in each cache, fp32, one thread. "
               "While the bytes term is the larger, adding sequences costs little: the weights are read once for all of them.")
    with st.expander("How it is timed, and where the error comes from"):
        st.markdown("Each step and both probes are timed by the thread's CPU time (one thread), best of a few, so time other "
                    "processes hold the core is left out; stalls on memory are counted. The bandwidth is a 256 MiB copy's "
                    "(read + write), which one core's small matrix-vector products need not reach. Each step also pays "
                    "PyTorch's dispatch of about 30 operators per layer, which no roofline term holds: the prediction adds "
                    "it as measured on the same step at width 64 (negligible bytes and FLOPs). "
                    "On a shared machine other processes also take memory bandwidth, so the error moves from run to run.")
    ui.table(steps[["batch", "measured_s", "wall_s", "predicted_s", "error_pct", "overhead_s", "bound", "weight_bytes", "kv_bytes", "flops",
                        "intensity", "tokens_per_s"]], column_config={
        "measured_s": st.column_config.NumberColumn("measured CPU (s)", format="%.4f"),
        "wall_s": st.column_config.NumberColumn("wall (s)", format="%.4f"),
        "predicted_s": st.column_config.NumberColumn("predicted (s)", format="%.4f"),
        "overhead_s": st.column_config.NumberColumn("fixed cost (s)", format="%.4f"),
        "error_pct": st.column_config.NumberColumn("error", format="%+.0f %%"),
        "weight_bytes": st.column_config.NumberColumn("weight bytes", format="%.3e"),
        "kv_bytes": st.column_config.NumberColumn("KV bytes", format="%.3e"),
        "flops": st.column_config.NumberColumn("FLOPs", format="%.3e"),
        "intensity": st.column_config.NumberColumn("FLOP/byte", format="%.2f"),
        "tokens_per_s": st.column_config.NumberColumn("tokens/s", format="%.0f")})

    st.subheader(f"Decode and prefill on the {cfg['gpu']} roofline (model, fp16)")
    place = pd.DataFrame(t["gpu_placement"])
    lines = pd.DataFrame(t["roof_lines"])
    line = alt.Chart(lines[lines["device"] == t["roof"][0]["device"]]).mark_line(color="gray", strokeDash=[5, 3]).encode(
        x=alt.X("intensity:Q", scale=alt.Scale(type="log"), title="arithmetic intensity (FLOP/byte)"),
        y=alt.Y("attainable_flops_per_s:Q", scale=alt.Scale(type="log"), title="attainable FLOP/s", axis=alt.Axis(format="~s")),
        tooltip=[alt.Tooltip("attainable_flops_per_s:Q", format=".3s", title="roof (FLOP/s)")])
    place["point"] = place.apply(lambda r: f"batch {r['batch']}" if r["phase"] == "decode" else "prefill", axis=1)
    points = alt.Chart(place).mark_point(filled=True, size=90).encode(
        x="intensity:Q", y="attainable_flops_per_s:Q", color=alt.Color("model:N"), shape=alt.Shape("point:N", title=None),
        tooltip=["model", "phase", "batch", alt.Tooltip("intensity:Q", format=".1f"), alt.Tooltip("attainable_flops_per_s:Q", format=".3s"),
                 alt.Tooltip("step_ms:Q", format=".2f", title="step (ms)"), alt.Tooltip("tokens_per_s:Q", format=",.0f"), "bound",
                 alt.Tooltip("resident_GB:Q", format=".1f", title="weights + cache (GB)"), "fits"])
    st.altair_chart((line + points).properties(height=360).interactive())
    st.caption(f"Each model's decode step at {cfg['gpu_context']} cached tokens and batch 1, 8, 64, 256, and a prefill of "
               f"{cfg['prompt']} tokens; time = max(FLOPs ÷ peak, bytes ÷ bandwidth) from the datasheet (a model, not measured). "
               "Batching raises the intensity only while the weights dominate the bytes: each sequence brings its own cache, "
               "so a model with a large cache per token (Llama 2 7B's MHA) stalls far left of the ridge.")
    ui.table(place[["model", "phase", "batch", "intensity", "step_ms", "tokens_per_s", "bound", "weight_bytes", "kv_bytes",
                        "resident_GB", "fits"]], column_config={
        "intensity": st.column_config.NumberColumn("FLOP/byte", format="%.1f"),
        "step_ms": st.column_config.NumberColumn("step (ms)", format="%.2f"),
        "tokens_per_s": st.column_config.NumberColumn("tokens/s", format="%.0f"),
        "weight_bytes": st.column_config.NumberColumn("weight bytes", format="%.3e"),
        "kv_bytes": st.column_config.NumberColumn("KV bytes", format="%.3e"),
        "resident_GB": st.column_config.NumberColumn("weights + cache (GB)", format="%.1f"),
        "fits": st.column_config.CheckboxColumn(f"fits in one {cfg['gpu']}")})
    with st.expander("The counts"):
        st.markdown("bytes = W·e (every projection and the head, B embedding rows, the norms) + B·(c + 1)·2·L·n_kv·d_h·e "
                    "(each cache read, the new token's K and V written); FLOPs = B·(2·W_mm + 4·L·n_h·d_h·(c + 1)). "
                    "Activations and element-wise work are left out. In the run, the FLOPs equal torch's FlopCounterMode "
                    "on the real step, the bytes equal the parameter and cache tensors' sizes, and each model's parameter "
                    "count equals its published total.")


def short(focus: str) -> None:
    """A small figure from the latest hardware.decode run, for the serving ("batching"), KV-cache ("kv") and speculative
    ("verify") pages; a note with a link where no run exists yet."""
    st.subheader("Why: decoding is memory-bound")
    found = ui.latest_run(EXPERIMENT, "the [GPU memory hierarchy page](memory_hierarchy) (view \"Decoding is memory-bound\")",
                          "a figure from it appears")
    if found is None:
        return
    result, rec = found
    steps = pd.DataFrame(result["tables"]["cpu_steps"])
    place = pd.DataFrame(result["tables"]["gpu_placement"])
    if focus == "kv":
        decode = place[place["phase"] == "decode"]
        st.altair_chart(alt.Chart(decode).mark_line(point=True).encode(
            x=alt.X("batch:Q", scale=alt.Scale(type="log", base=2), title="batch size"),
            y=alt.Y("kv_share:Q", title="KV cache share of bytes", axis=alt.Axis(format="%")),
            color="model:N", tooltip=["model", "batch", alt.Tooltip("kv_share:Q", format=".1%", title="KV share of bytes"),
                                      alt.Tooltip("bytes:Q", format=".3s", title="bytes per step")]).properties(height=240))
        st.caption(f"A decode step reads every weight once and every sequence's cache ({rec.config['gpu_context']} tokens, fp16): "
                   f"as the batch grows the cache becomes most of the bytes, which is what MQA, GQA, MLA and INT8 caches shrink. "
                   f"From {ui.run_link(rec)}.")
        return
    if focus == "verify":
        verify = pd.DataFrame(result["tables"]["verify_cost"])
        st.altair_chart(alt.Chart(verify).mark_bar().encode(
            x=alt.X("tokens_scored:O", title="tokens one target call scores (γ + 1)"),
            y=alt.Y("measured_s:Q", title="time of the call (s), measured"),
            tooltip=["tokens_scored", alt.Tooltip("measured_s:Q", format=".4f"), alt.Tooltip("cost_vs_one:Q", format=".2f", title="× one token")]
        ).properties(height=220))
        last = verify.iloc[-1]
        st.caption(f"One sequence of the {units.si(result['metrics']['weight_MB'] * 1e6, 'B')} tiny LLaMA with {rec.config['context']} "
                   f"cached tokens: scoring {last['tokens_scored']} tokens in one call took {last['cost_vs_one']:.2f}× the time of "
                   f"scoring one (thread CPU time, {ui.run_link(rec)}). The weights are read once per call, so while decoding is "
                   "memory-bound the target checks γ draft tokens for about the price of one decode step, which is where the "
                   "speed-up above comes from.")
        return
    st.altair_chart(step_chart(steps, height=220))
    st.caption(f"One decode step reads every weight whatever the batch, so tokens/s grows almost with the batch until the "
               f"FLOPs catch up: measured on this CPU in {ui.run_link(rec)}. Continuous batching keeps that batch full.")
