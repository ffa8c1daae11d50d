"""Speculative sampling: a draft proposes gamma tokens, the target checks them in one call."""
import altair as alt
import pandas as pd
import streamlit as st

from pages import decode_view, ui

st.title("Speculative sampling")


def render(result: dict, rec) -> None:
    m, t, cfg = result["metrics"], result["tables"], rec.config
    cols = st.columns(4)
    cols[0].metric("acceptance rate α", f"{m['alpha']:.3f}")
    cols[1].metric(f"tokens per target call (γ={cfg['gamma']})", f"{m['tokens_per_target_call']:.2f}",
                   help=f"formula (1-α^(γ+1))/(1-α) = {m['formula_tokens_per_call']:.2f}")
    cols[2].metric("wall-time speedup, measured", f"{m['measured_speedup']:.2f}×")
    cols[3].metric("speedup predicted", f"{m['predicted_speedup']:.2f}×",
                   help=f"draft call {m['draft_call_ms']:.2f} ms, target call {m['target_call_ms']:.2f} ms on this CPU")

    st.subheader("Tokens per target call against gamma: measured, and the formula with the measured α")
    sweep = pd.DataFrame(t["gamma_sweep"])
    long = sweep.melt(id_vars=["gamma", "alpha"], value_vars=["tokens_per_target_call", "formula"], var_name="source", value_name="tokens")
    long["source"] = long["source"].map({"tokens_per_target_call": "measured", "formula": "(1-α^(γ+1))/(1-α)"})
    st.altair_chart(alt.Chart(long).mark_line(point=True).encode(
        x=alt.X("gamma:O", title="draft tokens per round γ"), y=alt.Y("tokens:Q", title="tokens emitted per target call", scale=alt.Scale(zero=False)),
        color=alt.Color("source:N", title=None), strokeDash="source:N",
        tooltip=["gamma", "source", alt.Tooltip("tokens:Q", format=".3f"), alt.Tooltip("alpha:Q", format=".3f")])
        .properties(height=280), width="stretch")

    st.subheader("Wall time for one sequence")
    st.altair_chart(alt.Chart(pd.DataFrame(t["timing"])).mark_bar().encode(
        x=alt.X("ms:Q", title="milliseconds for the sequence (median)"), y=alt.Y("decoder:N", title=None),
        yOffset="source:N", color=alt.Color("source:N", title=None),
        tooltip=["decoder", "source", alt.Tooltip("ms:Q", format=".1f")]).properties(height=140), width="stretch")

    st.subheader("Is the output distributed as the target's samples?")
    ui.table(pd.DataFrame(t["distribution_tests"]),
                 column_config={"p_value": st.column_config.NumberColumn("p-value", format="%.3g")})
    joint = pd.DataFrame(t["joint"])
    rule = st.radio("rule", list(joint["rule"].unique()), horizontal=True, key=f"rule-{rec.id}")
    shown = joint[joint["rule"] == rule]
    top = shown.nlargest(30, "expected").melt(id_vars=["x1", "x2"], value_vars=["observed", "expected"], var_name="source", value_name="probability")
    top["pair"] = top["x1"].astype(str) + "→" + top["x2"].astype(str)
    st.altair_chart(alt.Chart(top).mark_bar().encode(
        x=alt.X("pair:N", title="first two generated tokens (x1→x2), the 30 most likely", sort="-y"),
        y=alt.Y("probability:Q", title="probability"), xOffset="source:N", color=alt.Color("source:N", title=None),
        tooltip=["pair", "source", alt.Tooltip("probability:Q", format=".4f")]).properties(height=280), width="stretch")
    st.caption(f"Pearson's chi-square over {cfg['test_samples']} sequences, cells expected below 5 pooled; the test rejects "
               "at p < 0.001. Expected: the target's exact p(x1)·p(x2|x1) from its own logits.")
    decode_view.short("verify")


ui.experiment_page("decoding.speculative", render,
                   intro="A draft (16 wide, 1 layer) and a target (64 wide, 2 layers) tiny LLaMA, both trained here on one "
                         "Markov-chain corpus. The draft proposes γ tokens, the target scores them all in one call, each is "
                         "kept with probability min(1, p/q), a rejection is replaced from norm(max(0, p − q)).")
