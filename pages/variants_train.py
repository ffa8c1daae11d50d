"""Attention variants in training: the same corpus and budget for MHA, MQA, GQA and MLA."""
import altair as alt
import pandas as pd
import streamlit as st

from pages import ui

st.title("Attention variants: training")


def render(result: dict, rec) -> None:
    m = result["metrics"]
    rows = pd.DataFrame(result["tables"]["variants"])
    st.markdown(f"Corpus entropy rate (the floor): **{m['entropy_rate_nats']:.3f} nats**; a uniform guess: "
                f"{m['uniform_loss_nats']:.3f} nats.")
    curves = pd.DataFrame(result["tables"]["curves"])
    label = f"entropy-rate floor, {m['entropy_rate_nats']:.3f} nats"
    floor = alt.Chart(pd.DataFrame({"y": [m["entropy_rate_nats"]], "line": [label]})).mark_rule(color="#555").encode(
        y="y:Q", strokeDash=alt.StrokeDash("line:N", title=None, scale=alt.Scale(range=[[4, 4]]),
                                           legend=alt.Legend(symbolType="stroke", symbolStrokeWidth=2, orient="bottom", labelLimit=400)),
        tooltip=[alt.Tooltip("line:N", title="reference")])
    st.altair_chart((alt.Chart(curves).mark_line().encode(
        x=alt.X("step:Q", title="optimizer step"), y=alt.Y("loss:Q", title="training loss (nats/token)", scale=alt.Scale(zero=False)),
        color="variant:N", tooltip=["variant", "step", alt.Tooltip("loss:Q", format=".3f")]) + floor
    ).properties(height=320), width="stretch")
    st.caption("Dashed: no model can go below the corpus's entropy rate on average (one batch's loss can); the gap "
               "to it is what a variant has still to learn. The held-out losses below, with their standard errors, "
               "say whether two variants differ by more than the noise.")
    ui.table(rows)


ui.experiment_page("attention.variants_train", render,
                   intro="Each variant starts from the same seed and sees the same batches of a Markov-chain corpus.")
