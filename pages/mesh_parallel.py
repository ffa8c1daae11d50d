"""Compose parallelism: the tiny LLaMA (dense or MoE) trained on a pp x dp x cp x ep x tp mesh of gloo ranks, every
strategy a transform of the one model, any pipeline schedule, any dp strategy."""
import altair as alt
import pandas as pd
import streamlit as st

from pages import checkpoint_views, mesh_views, schedule_views, timeline, ui

st.title("Compose parallelism")
DIMS = ("tp", "dp", "pp", "cp", "ep")  # the order a rank's mesh coordinates are read in


def render(result: dict, rec) -> None:
    m, t = result["metrics"], result["tables"]
    cols = st.columns(7)
    cols[0].metric("pipeline pp", m["pp"], help="pipeline ranks")
    cols[6].metric("schedule", m["schedule"], help="the pipeline schedule over pp, run by the Pipeline page's executor")
    cols[1].metric("data dp", m["dp"], help="data-parallel ranks")
    cols[2].metric("context cp", m["cp"], help="context-parallel ranks (ring attention)")
    cols[3].metric("expert ep", m["ep"], help=f"expert-parallel ranks; {m['experts']} routed experts per "
                                                     "block (0: dense feed-forwards)")
    cols[4].metric("tensor tp", f"{m['tp']} + SP" if m["sp"] else m["tp"],
                   help="tensor-parallel ranks (+ SP: norms on sequence shards, Megatron's sequence parallel)")
    cols[5].metric("final loss", f"{m['final_loss']:.4f}", help="cross entropy, nats per token")
    st.caption("Edges join the ranks of each process group: tp (blue) all-reduce activations inside a layer, pp (red) "
               "send activations and gradients between stages, cp (purple) pass keys and values round a ring inside "
               "each attention and sum gradients, ep (gold) send each token to its experts' rank and back (all-to-all), "
               "dp (green) all-reduce gradients.")
    if t["graph_dot"]:
        st.graphviz_chart(t["graph_dot"][0]["dot"])
    else:
        st.caption("This run did not draw the mesh's process groups (stored before runs did): run it again to see them.")
    left, right = st.columns(2)
    loss = pd.DataFrame(t["loss"])
    left.altair_chart(alt.Chart(loss).mark_line(point=True).encode(
        x=alt.X("step:Q", title="step", axis=alt.Axis(tickMinStep=1, format="d")), y=alt.Y("loss:Q", title="cross entropy (nats / token)", scale=alt.Scale(zero=False)),
        color="run:N", strokeDash="run:N", tooltip=["run", "step", alt.Tooltip("loss:Q", format=".6f")]).properties(
        height=260, title="Loss against one process on the whole batch"), width="stretch")
    memory = pd.DataFrame(t["memory"])
    right.altair_chart(alt.Chart(memory).mark_bar().encode(
        x=alt.X("rank:O", title="rank"), y=alt.Y("measured_bytes:Q", title="bytes held (measured, B)"), color="category:N",
        tooltip=["rank", "category", alt.Tooltip("measured_bytes:Q", format=","), alt.Tooltip("formula_bytes:Q", format=",", title="formula (B)")]
    ).properties(height=260, title=f"Memory per rank ({m['precision']})"), width="stretch")
    if m["precision"] != "fp64":
        st.caption(f"{m['precision']}: weights and messages in the compute dtype, gradients summed in the reduce dtype; "
                      "Adam steps the master copy. Loss and weights are checked against one process in the same recipe and in float64.")
    if t["pipeline"]:
        pipe = pd.DataFrame(t["pipeline"]).rename(columns={"bubble_replayed": "replayed", "bubble_makespan_model": "makespan model"})
        pipe = pipe.melt(id_vars=["rank", "pp", "busy_ms"], value_vars=["replayed", "makespan model"], var_name="source",
                         value_name="idle")
        st.altair_chart(alt.Chart(pipe).mark_bar().encode(
            x=alt.X("rank:O", title="rank"), xOffset="source:N", y=alt.Y("idle:Q", title="idle share of the step (bubble)",
                                                                         axis=alt.Axis(format="%")),
            color=alt.Color("source:N", title=None),
            tooltip=["rank", "pp", "source", alt.Tooltip("idle:Q", format=".1%"), alt.Tooltip("busy_ms:Q", format=".2f", title="busy (ms)")]
        ).properties(height=240, title=f"Bubble per rank in the last step: replayed ({m['step_replayed_ms']:.1f} ms) and modelled"),
            width="stretch")
        st.caption("Replayed: each rank on a core of its own, every F/B/I/W at its least CPU time over the steps trained "
                   "(its tp, cp and ep collectives inside). Modelled: backend/parallel/pp/makespan.py walking the schedule at "
                   "the mean stage costs; their distance is reported (bench/mesh_bubble.py measures it over many runs).")
    if t["step_split"]:
        mesh_views.step_split(result)
    if t["comm_replay"]:
        mesh_views.comm_replay(result)
    if t["schedules"]:
        schedule_views.schedules(result)
    if t["recompute"]:
        mesh_views.recompute_price(result)
    if t.get("checkpoint_timeline"):
        checkpoint_views.mesh_checkpoints(result)
    ranks = pd.DataFrame(t["ranks"])
    dims = [d for d in DIMS if d in ranks]
    ranks.insert(1, "mesh coordinates", ranks[dims].apply(lambda r: " ".join(f"{d}{r[d]}" for d in dims), axis=1))
    sent = [c for c in ranks if c.endswith(" bytes sent")]
    st.markdown("**Bytes each rank sent, by process group** (measured)")
    ui.table(ranks.drop(columns=dims), column_config={
        c: st.column_config.NumberColumn(c.removesuffix(" bytes sent").replace("gradients", "grads") + " (B)", format="localized")
        for c in sent})
    if t["experts"]:
        experts = pd.DataFrame(t["experts_per_rank"])
        st.altair_chart(alt.Chart(experts).mark_bar().encode(
            x=alt.X("rank:O", title="rank"), y=alt.Y("rows computed:Q", title="token assignments computed (whole run)"),
            color="expert:N", tooltip=["rank", "expert", "rows computed"]).properties(
            height=220, title="MoE: which rank computes which expert, and how many tokens reached it"), width="stretch")
    timeline.run_timeline(rec, title="One run across all ranks: forwards and backwards per micro-batch, stage sends, TP and DP collectives, CP ring messages")


ui.preset_buttons("parallel.mesh")
ui.experiment_page(
    "parallel.mesh", render,
    intro="The tiny LLaMA trained on a pp x dp x cp x ep x tp mesh of ranks, each strategy a transform of the one model; "
          "every loss and final weight is checked against one process training on the whole batch.",
    about="Tensor parallel is innermost: each rank holds one pipeline stage's tensor-parallel shard and trains on its "
          "data-parallel slice of the batch and, with cp > 1, its zigzag share of every sequence's positions (ring "
          "attention, as on the Context parallel page). Micro-batches flow stage to stage in the chosen schedule's "
          "order, run by the Pipeline page's executor (interleaved and V-shaped schedules give each rank two or more "
          "stages). With experts > 0 every feed-forward is an MoE layer whose experts are split over the ep ranks (as "
          "on the Expert parallel page, dropless).",
    folded={
        "Model, data and training": ("batch", "seq", "layers", "d_model", "n_heads", "n_kv_heads", "d_head", "d_ff",
                                     "vocab", "steps", "lr", "seed"),
        "DDP, offload and loss scaling": ("bucket_kb", "overlap", "comm_delay_ms", "offload", "init_loss_scale"),
        "Checkpoints and failures": ("checkpoint_every", "checkpoint_save", "kill_rank", "kill_step", "reshard_tp",
                                     "reshard_pp", "reshard_cp", "reshard_ep", "reshard_strategy"),
    })
