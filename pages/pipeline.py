"""Pipeline parallel: live Gantt charts of a schedule on gloo ranks, the bubble measured against the model."""
import altair as alt
import pandas as pd
import streamlit as st

from pages import recompute_view, ui

st.title("Pipeline parallel")

KINDS = ["forward", "backward", "input grad", "weight grad", "waiting to receive"]
KIND_NAMES = {"F": "forward", "B": "backward", "I": "input grad", "W": "weight grad"}
KIND_COLORS = alt.Scale(domain=KINDS, range=["#1f6fd1", "#e4572e", "#f2a541", "#76b041", "#c9ced6"])
TIMELINES = {"replayed": "Replayed: one core per rank, each action's least CPU time over the timed steps",
             "measured": "Measured wall clock on this machine (ranks share its cores)"}


def gantt(result: dict, which: str, title: str) -> alt.Chart:
    """One Gantt: rows are ranks, bars actions coloured by kind; model chunks (interleaved) told apart by shade;
    micro-batch numbers only on bars wide enough to hold them; drag to zoom, double-click to reset."""
    rows = [e for e in result["tables"]["gantt"] if (e["lane"] == "replayed") == (which == "replayed")
            and e["lane"] in ("compute", "recv", "replayed")]
    df = pd.DataFrame(rows)
    if df.empty:
        return alt.Chart(pd.DataFrame({"x": []})).mark_text()
    df["row"] = df["rank"].map(lambda r: f"rank {r}")
    df["kind"] = df.apply(lambda e: "waiting to receive" if e["lane"] == "recv" else KIND_NAMES[e["kind"]], axis=1)
    p = result["metrics"]["p"]
    df["chunk"] = df["stage"].map(lambda s: "" if s is None or pd.isna(s) else f"chunk {int(s) // p}")
    df["start_ms"] = df["start_ms"].clip(lower=0)
    df["dur_ms"] = df["end_ms"] - df["start_ms"]
    span = max(df["end_ms"].max(), 1e-9)
    df["label"] = df.apply(lambda e: str(int(e["mb"])) if e["lane"] != "recv" and e["dur_ms"] > span / 45 else "", axis=1)
    zoom = alt.selection_interval(bind="scales", encodings=["x"])
    base = alt.Chart(df).encode(y=alt.Y("row:N", title=None, sort="ascending"))
    bars = base.mark_bar(height=alt.RelativeBandSize(0.8), stroke="white", strokeWidth=0.5).encode(
        x=alt.X("start_ms:Q", title="time (ms)", scale=alt.Scale(domain=[0, span], nice=False)), x2="end_ms:Q",
        color=alt.Color("kind:N", scale=KIND_COLORS, title="action", legend=alt.Legend(orient="top")),
        opacity=alt.Opacity("chunk:N", title="model chunk", legend=alt.Legend(orient="top") if df["chunk"].nunique() > 1 else None,
                            scale=alt.Scale(range=[1.0, 0.55, 0.8, 0.4])),
        tooltip=["row", "kind", alt.Tooltip("mb:Q", title="micro-batch"), alt.Tooltip("stage:Q", title="stage"), "chunk",
                 alt.Tooltip("start_ms:Q", format=".2f", title="start (ms)"), alt.Tooltip("dur_ms:Q", format=".2f", title="duration (ms)")])
    labels = base.transform_filter(alt.datum.label != "").mark_text(color="white", fontSize=10).encode(
        x=alt.X("mid:Q"), text="label:N").transform_calculate(mid="(datum.start_ms + datum.end_ms) / 2")
    return (bars + labels).add_params(zoom).properties(title=title, height=alt.Step(30))


def summary(m: dict) -> None:
    cols = st.columns(5)
    cols[0].metric("bubble, replayed", f"{100 * m['bubble_replayed']:.1f} %",
                   help="the busiest stage's idle share with one core per rank and each action's least CPU time over the timed steps")
    cols[1].metric("bubble, formula", f"{100 * m['bubble_model']:.1f} %", help=m["bubble_formula"])
    cols[2].metric("bubble, wall clock", f"{100 * m['bubble_measured']:.1f} %",
                   help="1 − busy ÷ makespan on this machine's wall clock, mean over ranks: includes the ranks' contention for cores")
    if m["bubble_makespan_model"] is not None:  # None: a run stored before the makespan model
        cols[4].metric("bubble, modelled", f"{100 * m['bubble_makespan_model']:.1f} %",
                       help="the same rank in the makespan model (backend/parallel/pp/makespan.py): the schedule's order and "
                            f"dependencies walked with this run's mean cost per action kind and stage; step {m['makespan_model_ms']:,.1f} ms")
    cols[3].metric("makespan, replayed", f"{m['makespan_replayed_ms']:,.1f} ms", help=f"wall clock: {m['makespan_ms']:,.1f} ms")
    if "bubble_published_measured_costs" in m:
        st.caption(f"Published formula with this run's measured chunk costs: {100 * m['bubble_published_measured_costs']:.1f} % "
                   f"idle ({m['published_idle_formula']}).")


IDLE_PARTS = {"transfer_ms": "in send/recv, after the data was sent", "waiting_ms": "waiting for the neighbour's compute",
              "between_ms": "between actions (posting sends, bookkeeping)"}


def idle_chart(stages: pd.DataFrame, where) -> None:
    """Each rank's wall-clock idle time, stacked by what it was spent on (the run's idle split)."""
    parts = stages.melt(id_vars=["rank"], value_vars=list(IDLE_PARTS), var_name="part", value_name="ms")
    parts["part"] = parts["part"].map(IDLE_PARTS)
    where.altair_chart(alt.Chart(parts).mark_bar().encode(
        y=alt.Y("rank:O", title="rank"), x=alt.X("ms:Q", title="idle time on the wall clock (ms)", stack="zero"),
        color=alt.Color("part:N", title=None, sort=list(IDLE_PARTS.values()), legend=alt.Legend(orient="right", labelLimit=320),
                        scale=alt.Scale(domain=list(IDLE_PARTS.values()), range=["#d1495b", "#c9ced6", "#8d99ae"])),
        tooltip=["rank", "part", alt.Tooltip("ms:Q", format=".2f")]).properties(height=alt.Step(28), title="Idle time, per rank"))


def idle_sentence(m: dict) -> str:
    """Why the wall-clock bubble exceeds the formula, in one sentence from the run's own figures."""
    return (f"Actions here take about {m['mean_action_cpu_ms']:.1f} ms of CPU, so send/recv latency is visible: "
            f"{m['recv_transfer_ms']:.2f} ms per receive after the data was sent ({100 * m['idle_transfer_share']:.0f}% "
            "of the idle time; ranks that share cores also wait for one), which the bubble formula, counting compute only, "
            "leaves out, as it does the time between actions.")


def render(result: dict, rec) -> None:
    m = result["metrics"]
    summary(m)
    title = f"{m['schedule']}: p={m['p']}, m={m['m']}" + (f", v={m['v']}" if m["v"] > 1 else "")
    for which, label in TIMELINES.items():
        st.altair_chart(gantt(result, which, f"{label} — {title}"))
    st.caption("Drag on a chart to zoom in time, double-click to reset; hover a bar for its micro-batch, stage and duration.")
    stages = pd.DataFrame(result["tables"]["stages"])
    shown = ["rank", "busy_ms", "cpu_ms", "bubble_wall", "bubble_replayed", "bubble_model", "peak_live", "peak_live_bound"]
    ui.table(stages[shown], column_config={
        "busy_ms": st.column_config.NumberColumn("busy, wall (ms)", format="%.1f"),
        "cpu_ms": st.column_config.NumberColumn("busy, CPU (ms)", format="%.1f"),
        "bubble_wall": st.column_config.NumberColumn("bubble, wall", format="percent"),
        "bubble_replayed": st.column_config.NumberColumn("bubble, replay", format="percent"),
        "bubble_model": st.column_config.NumberColumn("bubble, formula", format="percent"),
        "peak_live": st.column_config.NumberColumn("peak live", help="activations held at once"),
        "peak_live_bound": st.column_config.NumberColumn("its bound", help="the schedule's bound on live activations")})
    if stages["transfer_ms"].notna().all():
        idle_chart(stages, st)
        st.caption(idle_sentence(result["metrics"]))
    else:
        st.caption("This run did not split its idle time (stored before runs did): run it again to see it.")
    live = pd.DataFrame(result["tables"]["live"])
    st.altair_chart(alt.Chart(live).mark_line(interpolate="step-after").encode(
        x=alt.X("t_ms:Q", title="time on the wall clock (ms)"), y=alt.Y("live:Q", title="live activations (micro-batches)",
                                                                      axis=alt.Axis(tickMinStep=1)),
        color=alt.Color("rank:N")).properties(height=220, title="Activations held, per rank"))
    if result["tables"]["recompute"]:
        recompute_view.recompute_price(result)
    versions = pd.DataFrame(result["tables"]["versions"])
    if not versions.empty:
        st.caption("PipeDream: the weight version each micro-batch's forward and backward used on each stage")
        ui.table(versions)

    st.subheader("Side by side")
    others = {row["schedule"]: row for row in result["tables"]["side_by_side"]}
    if not others:
        st.caption("This run did not list the other schedules' settings (stored before runs did): run it again to "
                   "compare it with another schedule side by side.")
        return
    other = st.selectbox("compare with schedule", list(others), key=f"cmp-{rec.id}")
    compare_id = st.query_params.get("compare")
    if st.button(f"Run {other} on the same settings"):
        compare_id = ui.submit("parallel.pipeline", others[other]) or compare_id
        if compare_id:
            st.query_params["compare"] = compare_id
    if compare_id:
        left, right = st.columns(2)
        with left:
            compact(result, rec)
        with right:
            ui.show_run(compare_id, compact)


def compact(result: dict, rec) -> None:
    """One run of a side-by-side pair: its bubble figures and its replayed timeline."""
    st.markdown(f"**{rec.config['schedule']}** · run `{rec.id}`")
    summary(result["metrics"])
    st.altair_chart(gantt(result, "replayed", "replayed, one core per rank"))


ui.experiment_page(
    "parallel.pipeline", render,
    intro="Each rank is a process holding pipeline stages of a Linear+tanh model; it runs its schedule's actions and "
          "sends activations and gradients to its neighbours. Every box below is one measured action.",
)
