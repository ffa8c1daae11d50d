"""Mixed precision: fp16 compute, fp32 master weights, loss scaling (none, static, dynamic) and GradScaler."""
import math

import altair as alt
import pandas as pd
import streamlit as st

from pages import ui

st.title("Mixed precision and loss scaling")

FP16_LIMITS = pd.DataFrame({"log2_magnitude": [-24, -14, 15.999], "limit": ["smallest subnormal 2⁻²⁴", "smallest normal 2⁻¹⁴", "max 65504"]})


def render(result: dict, rec) -> None:
    t, m, cfg = result["tables"], result["metrics"], rec.config
    summary = pd.DataFrame(t["summary"]).drop(columns=["activation_underflow", "param_underflow"])  # the counts: in the shares
    ui.table(summary, column_config={
        "skipped_steps": st.column_config.NumberColumn("skipped", help="optimizer steps skipped for an overflow"),
        "activation_underflow_share": st.column_config.NumberColumn("logit grads → 0", format="percent",
                                                                    help="share of the logit-gradient elements flushed to zero"),
        "param_underflow_share": st.column_config.NumberColumn("param grads → 0", format="percent",
                                                               help="share of the parameter-gradient elements flushed to zero"),
        "final_scale": st.column_config.NumberColumn("final scale", format="%.0f"),
        "max_grad_relative_error": st.column_config.NumberColumn("max ‖g16 − g32‖/‖g32‖", format="%.3g")})
    st.caption(f"Underflow counted every {cfg['count_every']} steps against an fp32 backward of the same weights; "
               f"{m['underflow_no_scaling']:,} gradient elements were flushed to zero without scaling.")

    curves = pd.DataFrame(t["curves"])
    left, right = st.columns(2)
    left.altair_chart(alt.Chart(curves).mark_line().encode(
        x=alt.X("step:Q", title="optimizer step"), y=alt.Y("loss:Q", title="training loss (nats/token)", scale=alt.Scale(zero=False)),
        color=alt.Color("mode:N", title=None), strokeDash="mode:N",
        tooltip=["mode", "step", alt.Tooltip("loss:Q", format=".4f"), "skipped"]).properties(height=300), width="stretch")
    dyn = curves[curves["mode"].isin(["fp16 dynamic scaling", "fp16 GradScaler"])]
    powers = [2.0 ** k for k in range(int(math.log2(dyn["scale"].min())), int(math.log2(dyn["scale"].max())) + 1)]
    line = alt.Chart(dyn).mark_line(point=True).encode(
        x=alt.X("step:Q", title="optimizer step"), y=alt.Y("scale:Q", title="loss scale S", scale=alt.Scale(type="log", base=2),
                axis=alt.Axis(values=powers, labelExpr="'2^' + round(log(datum.value) / LN2)")),
        color=alt.Color("mode:N", title=None), strokeDash="mode:N", tooltip=["mode", "step", "scale", "skipped"])
    skips = alt.Chart(dyn[dyn["skipped"] & (dyn["mode"] == "fp16 dynamic scaling")]).mark_point(shape="cross", size=160, color="red").encode(
        x="step:Q", y="scale:Q", tooltip=["step", "scale"])
    right.altair_chart((line + skips).properties(height=300), width="stretch")
    right.caption(f"Red crosses: overflow (inf in the fp16 gradients), step skipped, S halved. After {cfg['growth_interval']} "
                  "clean steps S doubles. Ours and torch.amp.GradScaler's lie on top of each other.")

    st.subheader("Where the gradients sit in FP16's range")
    hist = pd.DataFrame(t["gradient_histogram"])
    bars = alt.Chart(hist).mark_bar(opacity=0.7).encode(
        x=alt.X("log2_magnitude:Q", title="log₂ |gradient| (fp32 backward, final weights, loss weighted)", bin=alt.Bin(step=1)),
        y=alt.Y("share:Q", title="share of elements", stack=None), color=alt.Color("gradient:N", title=None),
        tooltip=["gradient", "log2_magnitude", "elements", alt.Tooltip("share:Q", format=".4f")])
    rules = alt.Chart(FP16_LIMITS).mark_rule(strokeDash=[4, 4]).encode(x="log2_magnitude:Q", tooltip=["limit"])
    scaled = alt.Chart(pd.DataFrame({"log2_magnitude": [m["static_scale_keeps_from_log2"]]})).mark_rule(color="green").encode(x="log2_magnitude:Q")
    st.altair_chart((bars + rules + scaled).properties(height=280), width="stretch")
    st.caption(f"{m['share_below_fp16_subnormal']:.1%} of the nonzero elements lie below 2⁻²⁴ and become 0 in FP16. "
               f"Green: with the static scale 2^{cfg['static_scale_log2']} everything right of this line survives.")


ui.experiment_page("numerics.mixed_precision", render,
                   intro="The same tiny LLaMA, batches and initial weights, five ways: fp32; fp16 compute with fp32 master "
                         "weights and no loss scaling, a static scale, dynamic scaling as GradScaler does it, and "
                         "torch.amp.GradScaler itself.")
