"""3D parallel: the tiny LLaMA trained on a pp x dp x cp x tp mesh of gloo ranks."""
import altair as alt
import networkx as nx
import pandas as pd
import streamlit as st

from backend.experiments.parallel.mesh import PRESETS
from backend.graph.dot import to_dot
from pages import timeline, ui

st.title("3D parallel")
DIM_COLORS = {"tp": "#1f6fd1", "dp": "#76b041", "pp": "#e4572e", "cp": "#9b59b6"}


def mesh_graph(ranks: list[dict], groups: list[dict]) -> str:
    g = nx.DiGraph()
    for r in ranks:
        g.add_node(r["rank"], label=f"rank {r['rank']}\npp {r['pp']} · dp {r['dp']} · cp {r['cp']} · tp {r['tp']}\n{r['layers']} blocks")
    for grp in groups:
        members = grp["ranks"]
        for a, b in zip(members, members[1:]):
            g.add_edge(a, b, label=grp["dimension"], color=DIM_COLORS[grp["dimension"]])
    return to_dot(g, rankdir="LR")


def render(result: dict, rec) -> None:
    m, t = result["metrics"], result["tables"]
    cols = st.columns(5)
    cols[0].metric("pipeline stages pp", m["pp"])
    cols[1].metric("data-parallel dp", m["dp"])
    cols[2].metric("context-parallel cp", m["cp"])
    cols[3].metric("tensor-parallel tp", m["tp"])
    cols[4].metric("final loss", f"{m['final_loss']:.4f}")
    st.caption("Edges join the ranks of each process group: tp (blue) all-reduce activations inside a layer, pp (red) "
               "send activations and gradients between stages, cp (purple) pass keys and values round a ring inside "
               "each attention and sum gradients, dp (green) all-reduce gradients.")
    st.graphviz_chart(mesh_graph(t["ranks"], t["groups"]))
    left, right = st.columns(2)
    loss = pd.DataFrame(t["loss"])
    left.altair_chart(alt.Chart(loss).mark_line(point=True).encode(
        x=alt.X("step:Q", title="step"), y=alt.Y("loss:Q", title="cross entropy (nats / token)", scale=alt.Scale(zero=False)),
        color="run:N", strokeDash="run:N", tooltip=["run", "step", alt.Tooltip("loss:Q", format=".6f")]).properties(
        height=260, title="Loss against one process on the whole batch"), width="stretch")
    memory = pd.DataFrame(t["memory"])
    right.altair_chart(alt.Chart(memory).mark_bar().encode(
        x=alt.X("rank:O", title="rank"), y=alt.Y("measured_bytes:Q", title="bytes held (measured, B)"), color="category:N",
        tooltip=["rank", "category", alt.Tooltip("measured_bytes:Q", format=","), alt.Tooltip("formula_bytes:Q", format=",", title="formula (B)")]
    ).properties(height=260, title="Memory per rank"), width="stretch")
    st.dataframe(pd.DataFrame(t["ranks"]), hide_index=True, width="stretch")
    timeline.run_timeline(rec, title="One run across all ranks: forwards and backwards per micro-batch, stage sends, TP and DP collectives, CP ring messages")


for name, preset in PRESETS.items():
    if st.button(f"Preset: {name}"):
        st.query_params.from_dict({k: str(v) for k, v in preset.items()})
        st.rerun()
ui.experiment_page(
    "parallel.mesh", render,
    intro="Ranks laid out on a pp x dp x cp x tp mesh (tensor parallel innermost). Each rank holds one pipeline stage's "
          "tensor-parallel shard and trains on its data-parallel slice of the batch and, with cp > 1, its zigzag share "
          "of every sequence's positions (ring attention, as on the Context parallel page); GPipe micro-batches flow "
          "stage to stage. Losses and every final weight are checked against one process training on the whole batch.")
