"""Checkpoints and failures: sharded DCP checkpoints, a rank killed by SIGKILL, the ranks restarted from the last
checkpoint, and the checkpoint interval against the failure rate."""
import altair as alt
import pandas as pd
import streamlit as st

from pages import checkpoint_views, ui

st.title("Checkpoints and failures")


CATEGORIES = ["weights", "Adam m, v", "Adam step", "step and losses", "random state"]


def bytes_per_rank_chart(per_rank: pd.DataFrame) -> alt.Chart:
    """Stacked tensor bytes per rank by what they hold, a tick at what the settings say the rank alone holds."""
    long = per_rank.melt(id_vars=["rank"], value_vars=CATEGORIES, var_name="holds", value_name="bytes")
    bars = alt.Chart(long).mark_bar().encode(
        x=alt.X("rank:O", title="rank that wrote the file"), y=alt.Y("bytes:Q", title="tensor bytes (B)"),
        color=alt.Color("holds:N", sort=CATEGORIES, title=None), order=alt.Order("holds:N"),
        tooltip=["rank", "holds", alt.Tooltip("bytes:Q", format=",", title="bytes (B)")])
    ticks = alt.Chart(per_rank).mark_tick(color="black", thickness=2, size=30).encode(
        x="rank:O", y="expected sharded bytes:Q",
        tooltip=["rank", alt.Tooltip("expected sharded bytes:Q", format=",", title="its own shards, from the settings (B)"),
                 alt.Tooltip("replicated, written here:Q", format=",", title="replicated tensors written here (B)")])
    return bars + ticks


def bench_expander(m, t) -> None:
    """bench/checkpoint.py's figures as the run read them from its JSON (nothing where the bench had not been run)."""
    if "bench" not in t:
        return
    with st.expander("Measured by bench/checkpoint.py: the mesh's save, load and step times"):
        st.markdown(f"Three 4-rank plans of the Compose parallelism run, saving every other step with dcp.save and dcp.async_save "
                    f"(async: the step pays the staging), on {m['bench.machine']} at load {m['bench.load']:.1f} "
                    f"({m['bench.when']}); each step of a run is a repeat. Blocking: what the step waits for (sync: the "
                    f"whole save); top rank: the largest rank's file.")
        ui.table(pd.DataFrame(t["bench"]))


def interval_chart(m, t) -> alt.Chart:
    """Wall time above failure-free against the checkpoint interval, Young's interval and the best one as rules."""
    line = alt.Chart(pd.DataFrame(t["interval"])).mark_line(point=True).encode(
        x=alt.X("interval_steps:Q", title="checkpoint interval (steps)", scale=alt.Scale(type="log")),
        y=alt.Y("overhead_pct:Q", title="wall time above failure-free (%)", scale=alt.Scale(type="log")),
        tooltip=["interval_steps", alt.Tooltip("overhead_pct:Q", format=".2f", title="above failure-free (%)"),
                 alt.Tooltip("lost_work_s_per_failure:Q", format=".3f", title="work lost per failure (s)")])
    young = alt.Chart(pd.DataFrame([{"interval_steps": m["young_interval_steps"], "label": "Young √(2·C·M)"},
                                    {"interval_steps": m["best_interval_steps"], "label": "best interval"}])).mark_rule(
        strokeDash=[4, 3]).encode(x="interval_steps:Q", color=alt.Color("label:N", title=None),
                                  tooltip=["label", "interval_steps"])
    return (line + young).properties(height=260)


def interval_section(m, t, mtbf_s: float) -> None:
    """The interval trade-off from the run's measured step, save and load times (when it measured them)."""
    if "interval" not in t:
        return
    st.subheader(f"How often to save: the interval against failures every {mtbf_s:g} s (MTBF)")
    st.altair_chart(interval_chart(m, t))
    with st.expander("How the trade-off is computed"):
        st.markdown("The measured step time T, save time C and load time R (restart) give the expected wall time per "
                    "useful step with a save every k steps, failures arriving at rate 1/MTBF: (M + R)(e^((kT + C)/M) - 1)/k. "
                    "A Monte Carlo run of simulated failures checks the formula; Young's first-order interval "
                    "sqrt(2 C M) is drawn beside the best one. Times are from this machine (a shared 2-core VM).")
        ui.table(pd.DataFrame(t.get("monte_carlo", [])))


def render(result: dict, rec) -> None:
    m, t = result["metrics"], result["tables"]
    if m["model"] == "mlp":
        return render_mlp(result, rec)
    if m.get("parent_run"):
        st.caption(f"Resumed from failed run [{m['parent_run']}](?run={m['parent_run']}).")
    checkpoint_views.mesh_checkpoints(result)
    interval_section(m, t, rec.config["mtbf_s"])
    st.caption(f"The tiny LLaMA (d_model {rec.config['hidden']}, {rec.config['layers']} blocks) trained by the mesh's loop "
               f"with every rank data parallel ({m['strategy']}); DCP's .metadata file adds {m['dcp_metadata_bytes']:,} B.")
    bench_expander(m, t)


def render_mlp(result: dict, rec) -> None:
    """A run stored before version 2: the Linear+tanh MLP's own training loop and its tables."""
    m, t = result["metrics"], result["tables"]
    st.caption("A run of the older Linear+tanh MLP (before this page trained the tiny LLaMA on the mesh).")
    cols = st.columns(4)
    cols[0].metric("attempts", m["attempts"], help="1 + the restarts after the killed rank")
    cols[1].metric("steps redone", m.get("steps_redone", 0), help="steps after the last checkpoint, lost with the kill")
    cols[2].metric("checkpoint (tensor bytes)", f"{m['checkpoint_tensor_bytes']:,} B",
                   help=f"{m['checkpoint_file_bytes']:,} B on disk with torch.save's framing; DCP's .metadata "
                        f"file adds {m['dcp_metadata_bytes']:,} B")
    cols[3].metric("save", f"{m['save_s_mean']:.3f} s", help=f"mean of the run's saves; the resume's load took {m['load_s'] or 0:.3f} s")

    if m.get("parent_run"):
        st.caption(f"Resumed from failed run [{m['parent_run']}](?run={m['parent_run']}).")
    st.subheader("The run: the kill, the restart and the steps redone")
    st.altair_chart(checkpoint_views.timeline_chart(pd.DataFrame(t["timeline"])))

    left, right = st.columns(2)
    left.altair_chart(bytes_per_rank_chart(pd.DataFrame(t["bytes_per_rank"])).properties(
        height=260, title="The last checkpoint's tensor bytes per rank"))
    if "interval" in t:
        right.altair_chart(interval_chart(m, t).properties(title=f"Interval vs failures (MTBF {rec.config['mtbf_s']:g} s)"))
    if "reshard_map" in t:
        checkpoint_views.reshard_section(m, t)
    with st.expander("The checkpoint's files"):
        st.markdown(f"Tensor bytes come from DCP's metadata; the files on disk add torch.save's framing, and DCP's "
                    f"own `.metadata` file (the keys, shapes and each shard's offsets) is {m['dcp_metadata_bytes']:,} B.")
        ui.table(pd.DataFrame(t["files"]))
    bench_expander(m, t)


ui.experiment_page("parallel.checkpoint", render,
                   intro="A data-parallel run of the tiny LLaMA saves sharded checkpoints; one rank is killed by SIGKILL mid-step, every "
                         "rank restarts from the last checkpoint and the result is checked bit for bit.",
                   folded={"Model and training": ("hidden", "layers", "batch", "steps", "lr", "seed")})
ui.resume_button("parallel.checkpoint")
checkpoint_views.mesh_reshard_from_store(ui.runs_of("parallel.mesh", statuses=("succeeded",), limit=50))
