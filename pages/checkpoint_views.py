"""Checkpoint views shared by the Checkpoints page and the Compose parallelism page: a run's timeline (steps, saves, the kill,
the restart) and the resharding map (which saved rank's bytes each new rank read, from DCP's load plan)."""
import altair as alt
import pandas as pd
import streamlit as st

from pages import ui


def timeline_chart(events: pd.DataFrame) -> alt.Chart:
    events = events.assign(attempt=events["attempt"].fillna(0).map(lambda a: f"attempt {int(a)}"),
                           what=events["event"].map({"step": "step done", "save": "checkpoint saved", "kill": "SIGKILL",
                                                     "start": "start / resume"}))
    if "seconds" not in events:
        events = events.assign(seconds=None)
    return alt.Chart(events).mark_point(filled=True, size=90).encode(
        x=alt.X("t_s:Q", title="wall time since the run's first step (s)"),
        y=alt.Y("what:N", title=None, sort=["start / resume", "step done", "checkpoint saved", "SIGKILL"]),
        color=alt.Color("attempt:N"), shape=alt.Shape("what:N", legend=None),
        tooltip=["what", "attempt", "step", alt.Tooltip("t_s:Q", format=".3f", title="t (s)"),
                 alt.Tooltip("seconds:Q", format=".3f", title="save (s)")]).properties(height=200)


def reshard_map_chart(reads: pd.DataFrame) -> alt.Chart:
    """Which saved rank's bytes each new rank reads, on the checkpoint's tensors laid end to end."""
    reads = reads.assign(to_byte=reads["from byte"] + reads["bytes"], **{"new": reads["new rank"].map(lambda r: f"new rank {r}")})
    return alt.Chart(reads).mark_bar(height=22, stroke="white", strokeWidth=0.5).encode(
        x=alt.X("from byte:Q", title="byte offset in the checkpoint's tensors, keys by name (B)"), x2="to_byte:Q",
        y=alt.Y("new:N", title=None), color=alt.Color("saved rank:N", title="read from saved rank"),
        tooltip=["new rank", "saved rank", "file", "key", alt.Tooltip("from byte:Q", format=",", title="from byte"),
                 alt.Tooltip("bytes:Q", format=",", title="bytes read (B)")]).properties(height=70 + 30 * reads["new rank"].nunique())


def reshard_section(m: dict, t: dict) -> None:
    """The resharding map of a run continued on another plan, and the bytes per (new rank, saved rank)."""
    st.subheader(f"Resharding: {m['reshard_plan']}, from {m['reshard_from']}")
    st.altair_chart(reshard_map_chart(pd.DataFrame(t["reshard_map"])))
    st.caption("Each new rank loads the saved pieces that overlap what it holds; DCP plans the reads from the "
               "offsets saved with each piece.")
    with st.expander("Bytes each new rank read from each saved rank"):
        ui.table(pd.DataFrame(t["reshard_bytes"]))


def mesh_checkpoints(result: dict) -> None:
    """The mesh run's checkpoints: the kill and restart on the timeline, the files, the continuation on another mesh."""
    m, t = result["metrics"], result["tables"]
    st.subheader("Checkpoints: the kill, the restart and the steps redone")
    cols = st.columns(4)
    cols[0].metric("attempts", m["attempts"], help="1 + the restarts after the killed rank")
    cols[1].metric("steps redone", m.get("steps_redone", 0), help="whole steps done after the last checkpoint, lost with "
                                                                  "the kill (the step it interrupted is run again too)")
    cols[2].metric("checkpoint (tensor bytes)", f"{m['checkpoint_tensor_bytes']:,} B",
                   help=f"{m['checkpoint_file_bytes']:,} B on disk with DCP's framing and .metadata")
    cols[3].metric("save", f"{m['save_s_mean']:.3f} s" if m.get("save_s_mean") is not None else "none",
                   help="mean of the last attempt's saves (a contended 2-core machine)")
    st.altair_chart(timeline_chart(pd.DataFrame(t["checkpoint_timeline"])))
    if t.get("checkpoint_bytes_per_rank"):
        st.altair_chart(mesh_bytes_chart(pd.DataFrame(t["checkpoint_bytes_per_rank"]),
                                         pd.DataFrame(t["checkpoint_share_per_rank"])).properties(
            height=240, title="The last checkpoint's tensor bytes per rank (tick: the rank's share of the model)"))
    with_save, without = m.get("step_s_with_save"), m.get("step_s_without_save")
    if with_save is not None or without is not None:
        fmt = lambda x: "not measured" if x is None else f"{x:.3f} s"  # noqa: E731
        st.caption(f"{m['checkpoint_save']} save: a step after a save took {fmt(with_save)}, one without "
                   f"{fmt(without)} (medians, rank 0's timeline, a contended 2-core machine).")
    if t.get("reshard_map"):
        reshard_section(m, t)
    with st.expander("The last checkpoint's files"):
        st.markdown("Each file holds the pieces of the model's tensors its rank wrote, at their global offsets (a "
                    "piece several ranks hold is written once).")
        ui.table(pd.DataFrame(t["checkpoint_files"]))


def mesh_bytes_chart(rows: pd.DataFrame, share: pd.DataFrame) -> alt.Chart:
    """Each rank's file by what it holds (weights, Adam m and v, the rest), a tick at the share the settings give it
    (`share`: the result's per-rank totals)."""
    bars = alt.Chart(rows).mark_bar().encode(
        x=alt.X("rank:O", title="rank that wrote the file", axis=alt.Axis(labelAngle=0)),
        y=alt.Y("written_bytes:Q", title="tensor bytes (B)"),
        color=alt.Color("category:N", title=None),
        tooltip=["rank", "category", alt.Tooltip("written_bytes:Q", format=",", title="written (B)"),
                 alt.Tooltip("expected_bytes:Q", format=",", title="its share, from the settings (B)"),
                 alt.Tooltip("held_bytes:Q", format=",", title="held before deduplication (B)")])
    ticks = alt.Chart(share).mark_tick(color="black", thickness=2, size=30).encode(
        x="rank:O", y="expected_bytes:Q",
        tooltip=["rank", alt.Tooltip("expected_bytes:Q", format=",", title="its share, from the settings (B)")])
    return bars + ticks


MESH_RESHARD = {"steps": 4, "checkpoint_every": 2, "kill_rank": 1, "kill_step": 3, "reshard_tp": 1, "reshard_pp": 4}


def mesh_reshard_from_store(runs: list) -> None:
    """The newest stored Compose parallelism run whose checkpoint was continued on another mesh: its resharding map, linked;
    or a link that starts one (tp 2 x pp 2 killed, restarted, then continued on tp 1 x pp 4)."""
    st.subheader("A tp × pp mesh's checkpoint on another mesh")
    run = next((r for r in runs if r.config.get("reshard_tp")), None)
    start = "&".join(f"{k}={v}" for k, v in MESH_RESHARD.items())
    if run is None or not (run.result() or {}).get("tables", {}).get("reshard_map"):
        st.caption(f"No Compose parallelism run here has continued a checkpoint on another mesh yet: [run tp 2 x pp 2, killed "
                   f"and resumed, then continued on tp 1 x pp 4](mesh_parallel?{start}).")
        return
    result = run.result()
    st.caption(f"From Compose parallelism run [{run.id}](mesh_parallel?run={run.id}): its checks compare the continued run "
               f"with one float64 process.")
    reshard_section(result["metrics"], result["tables"])
