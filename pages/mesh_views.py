"""Views of the mesh page's run beyond its frame: recompute's price (FLOPs, CPU time, activations saved, against the same
plan without it) and where each rank's step goes (lanes per dimension, the split into compute, communication, idle).
The plan under every schedule side by side is in schedule_views.py."""
import altair as alt
import pandas as pd
import streamlit as st

from pages import ui


def recompute_price(result: dict) -> None:
    """Full or selective recompute against one step of the same plan without it, per rank."""
    m, rows = result["metrics"], pd.DataFrame(result["tables"]["recompute"])
    st.subheader(f"Recompute's price ({m['recompute']})")
    cols = st.columns(4)
    cols[0].metric("extra FLOPs (counted)", f"+{100 * m['recompute_flops_overhead']:.1f} %",
                   help=f"one step with recompute against one without, counted per op by torch's FLOP formulas; the model "
                        f"predicts +{100 * m['recompute_flops_model']:.1f} % (full: F/(F+B); selective: QKᵀ and P·V again)")
    cols[1].metric("extra compute CPU time", f"{100 * m['recompute_time_overhead']:+.1f} %",
                   help="CPU time of the F/B/I/W actions, all ranks, one step each (a contended 2-core machine: noisy)")
    cols[2].metric("peak activations saved", f"{m['activation_peak_saved_bytes'] / 1024:,.1f} KiB",
                   help="the largest saving on one rank: its peak of activations alive, measured, without minus with")
    if "backward_to_forward_flops" in m:
        cols[3].metric("backward ÷ forward FLOPs", f"{m['backward_to_forward_flops']:.2f}",
                       help="counted; at 2 (a GEMM's backward is two GEMMs) full recompute adds a third")
    peaks = pd.concat([rows.assign(run="without recompute", bytes=rows["activations_peak_without_bytes"],
                                   cpu_ms=rows["compute_cpu_without_ms"], flops=rows["step_flops_without"]),
                       rows.assign(run="with recompute", bytes=rows["activations_peak_bytes"], cpu_ms=rows["compute_cpu_ms"],
                                   flops=rows["step_flops_with"])])
    tooltip = ["rank", "run", alt.Tooltip("bytes:Q", format=",", title="peak activations (B)"),
               alt.Tooltip("flops:Q", format=",", title="FLOPs per step"), alt.Tooltip("cpu_ms:Q", format=".2f", title="compute CPU (ms)")]
    left, right = st.columns(2)
    left.altair_chart(alt.Chart(peaks).mark_bar().encode(
        x=alt.X("rank:O", title="rank"), xOffset="run:N", y=alt.Y("bytes:Q", title="peak activations held (B)"),
        color=alt.Color("run:N", title=None), tooltip=tooltip).properties(height=240, title="Activations at each rank's peak"),
        width="stretch")
    right.altair_chart(alt.Chart(peaks).mark_bar().encode(
        x=alt.X("rank:O", title="rank"), xOffset="run:N", y=alt.Y("flops:Q", title="FLOPs per step (counted)"),
        color=alt.Color("run:N", title=None), tooltip=tooltip).properties(height=240, title="Compute per rank and step"),
        width="stretch")
    with st.expander("The models and the per-rank figures"):
        st.markdown("Full recompute keeps each stage's input from F to B (or I) and runs the stage's forward again: one more "
                    "forward per (stage, micro-batch), F/(F+B) more FLOPs, a third at F:B = 1:2 (seed 003). Selective "
                    "(Korthikanti et al. 2022) keeps q, k and v and recomputes only softmax(QKᵀ/√d)·V in the backward: "
                    "4·b·(a/tp)·s²·d FLOPs per layer per micro-batch, dropping the a·s²·b scores from what each block holds.")
        ui.table(rows)


LANE_ORDER = ["compute", "tp", "cp", "ep", "dp", "pp"]
DIM_COLORS = {"tp": "#1f6fd1", "cp": "#9b59b6", "ep": "#d4a017", "dp": "#76b041", "pp": "#e4572e"}  # as the mesh graph's edges
ACTION_COLORS = {"F": "#3b3b3b", "B": "#7a7a7a", "I": "#a3a3a3", "W": "#c8c8c8"}


def _split_bars(split: pd.DataFrame, y_title: str, title: str) -> alt.Chart:
    """Per rank a stacked bar: compute, each dimension's exposed communication, idle (ms)."""
    parts = split.melt(id_vars=["rank"], value_vars=[f"{c}_ms" for c in ["compute", *LANE_ORDER[1:], "idle"]],
                       var_name="part", value_name="ms")
    parts["part"] = parts["part"].str.removesuffix("_ms").map(lambda c: c if c in ("compute", "idle") else f"{c} communication")
    parts = parts[parts["ms"] > 0]
    order = ["compute", *[f"{d} communication" for d in LANE_ORDER[1:]], "idle"]
    return alt.Chart(parts).mark_bar().encode(
        x=alt.X("rank:O", title="rank", axis=alt.Axis(labelAngle=0, labelOverlap=False)),
        y=alt.Y("ms:Q", title=y_title, stack="zero"),
        color=alt.Color("part:N", sort=order, title=None, scale=alt.Scale(
            domain=order, range=["#3b3b3b", *DIM_COLORS.values(), "#d0d4da"])), order=alt.Order("part:N"),
        tooltip=["rank", "part", alt.Tooltip("ms:Q", format=".2f", title="ms")]).properties(height=300, title=title)


def _lanes_chart(lanes: pd.DataFrame, x_title: str, title: str) -> alt.Chart:
    """One row per rank and lane (compute, then each dimension that talks), each event a bar from start to end (ms)."""
    lanes = lanes.copy()
    lanes["row"] = lanes["rank"].map(lambda r: f"rank {r}") + " · " + lanes["lane"]
    rows = [f"rank {r} · {lane}" for r in sorted(lanes["rank"].unique()) for lane in LANE_ORDER
            if f"rank {r} · {lane}" in set(lanes["row"])]
    kinds = [k for k in [*ACTION_COLORS, *DIM_COLORS, "other"] if k in set(lanes["kind"])]
    colors = {**ACTION_COLORS, **DIM_COLORS, "other": "#8c6d4f"}
    return alt.Chart(lanes).mark_bar().encode(
        x=alt.X("start_ms:Q", title=x_title), x2="end_ms:Q",
        y=alt.Y("row:N", sort=rows, title=None, axis=alt.Axis(labelOverlap=False)),
        color=alt.Color("kind:N", title="kind", scale=alt.Scale(domain=kinds, range=[colors[k] for k in kinds])),
        tooltip=["rank", "lane", "name", alt.Tooltip("start_ms:Q", format=".2f", title="start (ms)"),
                 alt.Tooltip("end_ms:Q", format=".2f", title="end (ms)")]).properties(height=alt.Step(20), title=title)


def step_split(result: dict) -> None:
    """Per rank, the last step on the wall clock by lane, and its split into compute, exposed communication per
    dimension and idle, beside the replayed bubble."""
    t = result["tables"]
    split = pd.DataFrame(t["step_split"])
    st.subheader("Where each rank's step goes")
    left, right = st.columns([2, 3])
    left.altair_chart(_split_bars(split, "last step's wall time (ms)", "The last step's split per rank"), width="stretch")
    right.altair_chart(_lanes_chart(pd.DataFrame(t["step_lanes"]), "time in the step (ms, wall clock)",
                                    "The last step per rank, one lane per dimension"), width="stretch")
    if t["step_replayed"]:
        replay = pd.DataFrame(t["step_replayed"])
        replay["row"] = replay["rank"].map(lambda r: f"rank {r}")
        replay["name"] = replay["kind"] + replay["mb"].astype(str) + " stage " + replay["stage"].astype(str)
        st.altair_chart(alt.Chart(replay).mark_bar(stroke="white", strokeWidth=0.5).encode(
            x=alt.X("start_ms:Q", title="time in the replayed step (ms, one core per rank, each action's measured CPU time)"),
            x2="end_ms:Q", y=alt.Y("row:N", title=None, sort="ascending"),
            color=alt.Color("kind:N", title="action", scale=alt.Scale(domain=list(ACTION_COLORS), range=list(ACTION_COLORS.values()))),
            tooltip=["rank", "name", alt.Tooltip("start_ms:Q", format=".2f", title="start (ms)"),
                     alt.Tooltip("end_ms:Q", format=".2f", title="end (ms)")]).properties(
            height=alt.Step(20), title="The same step replayed: the schedule's own bubble, without the contention"), width="stretch")
    st.caption("Wall clock on this shared CPU: ranks outnumber cores, so waiting for a descheduled peer shows as "
               "communication. The replay gives each rank a core and each action its CPU time (tp, cp and ep collectives "
               "inside it); its bubble per rank is in the table.")
    with st.expander("How the step is split"):
        st.markdown("Each instant goes to the first category that covers it: compute inside a dimension's code (ring "
                    "attention blocks, a ring reduction's sums, Adam), then a dimension's exposed communication (a blocking "
                    "collective, the blocked tail of a ring message, a pipeline receive), then the rest of an F/B/I/W "
                    "action; idle is what no event covers. The check: the parts sum to the step's wall time on every rank.")
        ui.table(split)


def comm_replay(result: dict) -> None:
    """The last step replayed with one core per rank and a lane per dimension's communication, beside the wall clock."""
    t, m = result["tables"], result["metrics"]
    st.subheader("The step replayed with its communication")
    left, right = st.columns([2, 3])
    left.altair_chart(_split_bars(pd.DataFrame(t["comm_replay"]), "replayed step (ms)",
                                  f"Replayed {m['step_replayed_with_comm_ms']:.1f} ms (wall {m['step_wall_ms']:.1f} ms)"),
                      width="stretch")
    right.altair_chart(_lanes_chart(pd.DataFrame(t["comm_lanes"]), "time in the replayed step (ms, one core per rank)",
                                    "Replayed: compute and communication per rank"), width="stretch")
    st.caption("Each rank on a core of its own: compute at its CPU time, each collective starting when its group's "
               "slowest member arrives, each receive when its send was posted; waiting is idle.")
    with st.expander("How the replay is built and checked"):
        st.markdown("Costs come from the last step's trace: compute is an action's CPU time less its collectives', "
                    "spread between them; a collective costs from its last member's arrival to its first member's finish, "
                    "a message from the later of its post and its wait to its arrival (on this shared 2-core machine these "
                    "include time the OS gave other ranks). Checks: per rank the parts sum to the replayed step; with "
                    "communication free and each action at its stage's mean cost the replay equals the makespan model "
                    "action by action.")
        ui.table(pd.DataFrame(t["comm_replay"]))
