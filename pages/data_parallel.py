"""Data parallel & ZeRO: DDP, ZeRO-1/2/3 and FSDP2 on one workload; memory per rank and bytes moved, measured."""

import altair as alt
import pandas as pd
import streamlit as st

from pages import timeline, ui

st.title("Data parallel & ZeRO")

STRATEGIES = {"Parameter server": "parallel.dp_ps", "DDP (ours, beside torch DDP)": "parallel.ddp", "ZeRO-1/2/3 (ours)": "parallel.zero", "FSDP2 (PyTorch)": "parallel.fsdp"}
SPMD = ("parallel.ddp", "parallel.zero", "parallel.fsdp")  # the strategies with a memory-per-rank table to compare
BASE = ("world_size", "hidden", "layers", "batch", "steps", "lr", "seed")


def memory_chart(rows: pd.DataFrame, x: str, title: str) -> alt.Chart:
    bars = alt.Chart(rows).mark_bar().encode(
        x=alt.X(f"{x}:N", title=None), y=alt.Y("measured_bytes:Q", title="bytes held (measured)", stack="zero"),
        color=alt.Color("category:N"), tooltip=[x, "category", alt.Tooltip("measured_bytes:Q", format=","),
                                                alt.Tooltip("formula_bytes:Q", format=",", title="formula")])
    return bars.properties(height=260, title=title)


def render_ps(result: dict, rec) -> None:
    left, right = st.columns(2)
    left.altair_chart(alt.Chart(pd.DataFrame(result["tables"]["eval"])).mark_line(point=True).encode(
        x=alt.X("update:Q", title="server update"), y=alt.Y("loss:Q", title="held-out loss", scale=alt.Scale(zero=False))
    ).properties(height=260, title="Loss as the server applies updates"), width="stretch")
    stale = pd.DataFrame(result["tables"]["staleness"])
    if not stale.empty:
        right.altair_chart(alt.Chart(stale).mark_bar().encode(
            x=alt.X("update:O", title="update"), y=alt.Y("staleness:Q", title="staleness (updates)"), color="worker:N",
            tooltip=["update", "worker", "staleness"]).properties(height=260, title="Staleness of each applied gradient"), width="stretch")
    ui.table(pd.DataFrame(result["tables"]["volume"]))
    timeline.run_timeline(rec, title="Per-rank timeline: the server's receive, update, send")


def render(result: dict, rec) -> None:
    if "staleness" in result["tables"]:
        render_ps(result, rec)
        return
    memory = pd.DataFrame(result["tables"]["memory"])
    memory["rank"] = memory["rank"].map(lambda r: f"rank {r}")
    left, right = st.columns(2)
    left.altair_chart(memory_chart(memory, "rank", f"Memory per rank: {result['metrics']['strategy']}"), width="stretch")
    loss = pd.DataFrame(result["tables"]["loss"])
    right.altair_chart(alt.Chart(loss).mark_line(point=True).encode(
        x=alt.X("step:Q", title="step"), y=alt.Y("loss:Q", title="loss (mean squared error)", scale=alt.Scale(zero=False)),
        color=alt.Color("run:N"), strokeDash="run:N").properties(height=260, title="Loss against the one-process reference"), width="stretch")
    ui.table(memory)
    volume = pd.DataFrame(result["tables"]["volume"])
    if not volume.empty:
        st.subheader("Bytes sent per rank per step")
        ui.table(volume)
    timeline.run_timeline(rec, title="Per-rank timeline: compute and communication")

    st.subheader("Compare strategies on these settings")
    base = {k: rec.config[k] for k in BASE}
    if st.button("Run DDP, ZeRO-1, ZeRO-2, ZeRO-3 and FSDP2 on these settings"):
        for name, extra in (("parallel.ddp", {}), ("parallel.zero", {"stage": 1}), ("parallel.zero", {"stage": 2}),
                            ("parallel.zero", {"stage": 3}), ("parallel.fsdp", {})):
            ui.runner().submit(name, {**base, **extra})
        st.info("Queued; the comparison fills in as they finish (reload).")
    rows = []
    for name in SPMD:
        for other in ui.store().list(experiment=name, statuses=("succeeded",), limit=200):
            if all(other.config.get(k) == v for k, v in base.items()):
                res = other.result()
                label = res["metrics"]["strategy"]
                if any(r["run"] == label for r in rows):
                    continue
                rows += [dict(r, run=label) for r in res["tables"]["memory"] if r["rank"] == 0]
    if rows:
        st.altair_chart(memory_chart(pd.DataFrame(rows), "run", "Rank 0's memory, strategy by strategy"), width="stretch")


choice = st.radio("strategy", list(STRATEGIES), horizontal=True,
                  index=list(STRATEGIES.values()).index(st.query_params.get("strategy", "parallel.ddp"))
                  if st.query_params.get("strategy") in STRATEGIES.values() else 0)
st.query_params["strategy"] = STRATEGIES[choice]
ui.experiment_page(STRATEGIES[choice], render, page_params=("strategy",),
                   intro="Every strategy trains the same float64 MLP with the same Adam, checked step by step against one "
                         "process training the whole batch.")
