"""Data parallel & ZeRO: parameter servers, DDP, ZeRO-1/2/3 and FSDP2 on the tiny LLaMA; memory per rank and bytes moved,
measured. Runs stored on the retired Linear+tanh MLP still open and draw."""

import altair as alt
import pandas as pd
import streamlit as st

from pages import mesh_views, timeline, ui

st.title("Data parallel & ZeRO")

STRATEGIES = {"Parameter server": "parallel.dp_ps", "DDP (ours, beside torch DDP)": "parallel.ddp", "ZeRO-1/2/3 (ours)": "parallel.zero", "FSDP2 (PyTorch)": "parallel.fsdp"}
SPMD = ("parallel.ddp", "parallel.zero", "parallel.fsdp")  # the strategies with a memory-per-rank table to compare
BASE = ("world_size", "hidden", "layers", "batch", "steps", "lr", "seed", "model")
MODEL_NAMES = {"mlp": "the retired Linear+tanh MLP, a stored run (loss: mean squared error)",
               "tiny_llama": "the tiny LLaMA, through the mesh's loop (loss: cross entropy)"}


def memory_chart(rows: pd.DataFrame, x: str, title: str) -> alt.Chart:
    bars = alt.Chart(rows).mark_bar().encode(
        x=alt.X(f"{x}:N", title=None), y=alt.Y("measured_bytes:Q", title="bytes held (measured)", stack="zero"),
        color=alt.Color("category:N"), tooltip=[x, "category", alt.Tooltip("measured_bytes:Q", format=","),
                                                alt.Tooltip("formula_bytes:Q", format=",", title="formula")])
    return bars.properties(height=260, title=title)


def pooled(rows: pd.DataFrame) -> pd.DataFrame:
    """Categories the host pool holds (CPU offload) named as such, so a stacked bar tells the pools apart."""
    if "pool" in rows:
        rows = rows.assign(category=[f"host · {c}" if p == "host" else c for p, c in zip(rows["pool"], rows["category"])])
    return rows


def offload_section(result: dict) -> None:
    """Bytes moved host <-> device per step, measured beside the formula, and the memory of each pool."""
    moved = pd.DataFrame(result["tables"]["moved"])
    st.subheader("CPU offload: bytes moved host ↔ device per step")
    st.caption("No accelerator here: device and host are both this CPU's memory, kept as two accounting pools; "
               "the bytes are those of the copies made between them.")
    long = moved.melt(id_vars=["rank", "direction"], value_vars=["measured_bytes_per_step", "formula_bytes_per_step"],
                      var_name="source", value_name="bytes")
    long["source"] = long["source"].map({"measured_bytes_per_step": "measured", "formula_bytes_per_step": "formula"})
    long["rank"] = long["rank"].map(lambda r: f"rank {r}")
    st.altair_chart(alt.Chart(long).mark_bar().encode(
        x=alt.X("source:N", title=None), xOffset="direction:N", y=alt.Y("bytes:Q", title="bytes per step per rank"),
        color=alt.Color("direction:N"), column=alt.Column("rank:N", title=None),
        tooltip=["rank", "direction", "source", alt.Tooltip("bytes:Q", format=",")]).properties(
        height=220, width=140, title="Moved per step: measured and formula"))
    with st.expander("The formula"):
        st.markdown("ZeRO-Offload (Ren et al., 2021) keeps the master weights, Adam's m and v and the Adam step on the "
                    "host: each step a rank sends its ψ/n gradient shard down (2 bytes/param in fp16, 4 in fp32, 8 here "
                    "in float64) and receives its updated ψ/n parameter shard in the compute dtype. FSDP2's "
                    "CPUOffloadPolicy copies every padded parameter shard up before the step's all-gather (once a step: "
                    "the mesh unshards each stage once, reshard_after_forward=False) and each parameter's local gradient "
                    "rows down once. (The retired MLP's stored FSDP2 runs gathered twice a step: forward and backward.)")


def render_ps(result: dict, rec) -> None:
    llama = rec.config.get("model") == "tiny_llama"  # (runs stored before it trained the MLP: a held-out squared error)
    left, right = st.columns(2)
    left.altair_chart(alt.Chart(pd.DataFrame(result["tables"]["eval"])).mark_line(point=True).encode(
        x=alt.X("update:Q", title="server update", axis=alt.Axis(tickMinStep=1, format="d")),
        y=alt.Y("loss:Q", title="loss (cross entropy, nats)" if llama else "held-out loss (squared error)",
                scale=alt.Scale(zero=False)), tooltip=["update", alt.Tooltip("loss:Q", format=".4f")]
    ).properties(height=260, title="Loss on the global batch, per update" if llama
                 else "Loss as the server applies updates"), width="stretch")
    stale = pd.DataFrame(result["tables"]["staleness"])
    if not stale.empty:
        right.altair_chart(alt.Chart(stale).mark_bar().encode(
            x=alt.X("update:O", title="update"), y=alt.Y("staleness:Q", title="staleness (updates)"), color="worker:N",
            tooltip=["update", "worker", "staleness"]).properties(height=260, title="Staleness of each applied gradient"), width="stretch")
    ui.table(pd.DataFrame(result["tables"]["volume"]))
    timeline.run_timeline(rec, title="Per-rank timeline: the server's receive, update, send")


def render(result: dict, rec) -> None:
    if rec.experiment == "parallel.dp_ps":  # the parameter server's own result (the other three share one schema)
        render_ps(result, rec)
        return
    memory = pd.DataFrame(result["tables"]["memory"])
    memory["rank"] = memory["rank"].map(lambda r: f"rank {r}")
    model = result["metrics"]["model"]  # each model's result its own shape (dp_model.result_schema)
    offloaded = "moved" in result["tables"] and bool(result["tables"]["moved"])  # (tiny_llama: only with offload)
    if offloaded:  # one bar per rank and pool
        memory["rank"] = memory["rank"] + " · " + memory["pool"]
    st.caption(f"Model: {MODEL_NAMES[model]}.")
    left, right = st.columns(2)
    left.altair_chart(memory_chart(memory, "rank", f"Memory per rank{' and pool' if offloaded else ''}: "
                                                   f"{result['metrics']['strategy']}"), width="stretch")
    loss = pd.DataFrame(result["tables"]["loss"])
    right.altair_chart(alt.Chart(loss).mark_line(point=True).encode(
        x=alt.X("step:Q", title="step"), y=alt.Y("loss:Q", title="loss (cross entropy, nats)" if model == "tiny_llama" else "loss (mean squared error)",
                                   scale=alt.Scale(zero=False)),
        color=alt.Color("run:N"), strokeDash="run:N").properties(height=260, title="Loss against the one-process reference"), width="stretch")
    ui.table(memory)
    volume = pd.DataFrame(result["tables"]["volume"])
    if not volume.empty:
        st.subheader("Bytes sent per rank" + ("" if model == "tiny_llama" else " per step"))
        ui.table(volume)
    if offloaded:
        offload_section(result)
    if model == "tiny_llama":  # the mesh's split of the last step: DDP's overlap shows as less exposed dp time
        mesh_views.step_split(result)
    else:
        timeline.run_timeline(rec, title="Per-rank timeline: compute and communication")

    st.subheader("Compare strategies on these settings")
    base = {k: rec.config.get(k, "mlp") if k == "model" else rec.config[k] for k in BASE}  # (runs before the model setting: mlp)
    runs = [("parallel.ddp", {}), ("parallel.zero", {"stage": 1}), ("parallel.zero", {"stage": 2}),
            ("parallel.zero", {"stage": 3}), ("parallel.fsdp", {}), ("parallel.zero", {"stage": 2, "offload": True}),
            ("parallel.fsdp", {"offload": True})]
    if st.button("Run DDP, ZeRO-1, ZeRO-2, ZeRO-3, FSDP2, and ZeRO-2 and FSDP2 with CPU offload on these settings" +
                 ("" if base["model"] == "tiny_llama" else " (on the tiny LLaMA: the MLP is retired)")):
        for name, extra in runs:
            ui.runner().submit(name, {**base, "model": "tiny_llama", **extra})
        st.info("Queued; the comparison fills in as they finish (reload).")
    rows = []
    for name in SPMD:
        for other in ui.runs_of(name, statuses=("succeeded",), limit=200):
            if all(other.config.get(k, "mlp" if k == "model" else None) == v for k, v in base.items()):
                res = other.result()
                label = res["metrics"]["strategy"]
                if any(r["run"] == label for r in rows):
                    continue
                rows += [dict(r, run=label) for r in res["tables"]["memory"] if r["rank"] == 0]
    if rows:
        st.altair_chart(memory_chart(pooled(pd.DataFrame(rows)), "run", "Rank 0's memory, strategy by strategy (host pool labelled)"),
                        width="stretch")


choice = st.radio("strategy", list(STRATEGIES), horizontal=True,
                  index=list(STRATEGIES.values()).index(st.query_params.get("strategy", "parallel.ddp"))
                  if st.query_params.get("strategy") in STRATEGIES.values() else 0)
st.query_params["strategy"] = STRATEGIES[choice]
ui.experiment_page(STRATEGIES[choice], render, page_params=("strategy",),
                   intro="Every strategy trains the tiny LLaMA of the other parallel pages (DDP, ZeRO and FSDP2 through the "
                         "mesh's loop; the parameter server by push and pull over P2P), checked against one process training "
                         "the whole batch.")
