"""Plan a training run: one plan's memory, step and Gantt (plan.training), or every plan ranked (plan.search)."""
import altair as alt
import pandas as pd
import streamlit as st

from pages import form, plan_views, ui

GiB = 2 ** 30
VIEWS = {"One plan": "plan.training", "Search every plan": "plan.search"}  # label -> experiment


def render_training(result: dict, rec) -> None:
    m, t, cfg = result["metrics"], result["tables"], rec.config
    cols = st.columns(5)
    cols[0].metric("memory per GPU", f"{m['memory_gib']:.1f} GiB", help=f"HBM {m['hbm_gib']:.0f} GiB; fits: {m['fits']}")
    cols[1].metric("step", f"{m['step_s']:.2f} s")
    cols[2].metric("tokens/s per GPU", f"{m['tokens_per_s_per_gpu']:,.0f}")
    cols[3].metric("MFU", f"{m['mfu']:.1%}", help=f"{m['model_tflops_per_gpu']:.0f} model TFLOP/s per GPU")
    cols[4].metric(f"days for {cfg['tokens_b']:g}B tokens", f"{m['train_days']:,.1f}", help=f"{m['gpu_hours']:,.0f} GPU-hours")

    st.subheader("Memory per GPU by category")
    mem = pd.DataFrame(t["memory"]).assign(GiB=lambda d: d["bytes"] / GiB)
    bars = alt.Chart(mem).mark_bar().encode(
        x=alt.X("sum(GiB):Q", title=f"GiB per GPU ({mem['stage'][0]} pipeline stage)"), y=alt.Y("stage:N", title=None),
        color=alt.Color("category:N", title=None, legend=alt.Legend(labelLimit=300)),
        tooltip=["category", alt.Tooltip("GiB:Q", format=",.2f")])
    hbm = alt.Chart(pd.DataFrame({"GiB": [m["hbm_gib"]]})).mark_rule(color="#c00", strokeWidth=2).encode(
        x="GiB:Q", tooltip=[alt.Tooltip("GiB:Q", title="HBM (GiB)")])
    st.altair_chart((bars + hbm).properties(height=150))
    st.caption(f"Red line: the GPU's HBM. At the {m.get('peak_moment', 'peak')} moment; the allocator's fragmentation "
               f"({m.get('allocator_fragmentation', 0):.0%} of the allocated bytes) is the one fitted memory constant.")

    st.subheader("One step")
    parts = pd.DataFrame(t["time"])
    st.altair_chart(alt.Chart(parts).mark_bar().encode(
        x=alt.X("seconds:Q", title="seconds per step"), y=alt.Y("part:N", title=None, sort=None, axis=alt.Axis(labelLimit=260)),
        tooltip=["part", alt.Tooltip("seconds:Q", format=".4f")]).properties(height=26 * len(parts) + 40))
    links = ", ".join(f"{r['dimension']} {r['size']}: {r['link']}" for r in t["links"] if r["size"] and r["size"] > 1) or "none"
    st.caption(f"Groups larger than one and the link each crosses, ranks numbered {cfg.get('order', 'pp-dp-cp-tp')} "
               f"(outermost first; nodes hold consecutive ranks): {links}.")
    if t["gantt"]:
        g = pd.DataFrame(t["gantt"]).assign(start_ms=lambda d: d["ts"] / 1e3, end_ms=lambda d: (d["ts"] + d["dur"]) / 1e3)
        g["action"] = g["kind"] + " stage " + g["stage"].astype(str) + " mb " + g["mb"].astype(str)
        g["row"] = g["rank"].map(lambda r: f"rank {r}")
        st.altair_chart(alt.Chart(g).mark_bar(height=alt.RelativeBandSize(0.8), stroke="white", strokeWidth=0.3).encode(
            x=alt.X("start_ms:Q", title="time in the step (ms, predicted)"), x2="end_ms:Q",
            y=alt.Y("row:N", title=None, sort="ascending"), color=alt.Color("kind:N", title=None),
            tooltip=["action", alt.Tooltip("start_ms:Q", format=",.1f"), alt.Tooltip("end_ms:Q", format=",.1f")])
            .properties(height=alt.Step(30 if g["rank"].max() < 12 else 14)))
        st.caption(f"The {cfg['schedule']} schedule's own per-rank order, each action at its predicted cost, replayed.")
    else:
        st.caption("No pipeline (pp = 1) or too many actions to draw: no Gantt.")
    if t.get("live"):
        st.subheader("Checked live, scaled down")
        ui.table(pd.DataFrame(t["live"]))
        st.caption("The plan's dimensions, schedule, virtual stages, dp strategy and recompute at tiny widths on gloo ranks "
                   "(parallel.mesh), checked against the planner's own functions; the checks are listed with this run's.")
    else:
        st.caption("Set live_check to run this plan scaled down on gloo ranks; what the tiny run cannot mirror is refused by name.")
    plan_views.published(t)
    with st.expander("Korthikanti et al. and ZeRO: the exact memory figures"):
        ui.table(pd.DataFrame(t["published_exact"]))


CHOICE_HELP = {
    "cp_comm": st.column_config.TextColumn("K/V exchange", help="context parallel's K/V exchange: ring attention passes "
                                           "blocks while attending (hidden behind attention), Llama 3's all-gather "
                                           "completes before attention (exposed) but sends 2(cp−1) blocks to ring's 3(cp−1)"),
    "order": st.column_config.TextColumn("rank order", help="ranks numbered outermost dimension first; nodes hold "
                                         "consecutive ranks: pp-dp-cp-tp (Megatron, the live mesh) puts dp inside pp, "
                                         "dp-pp-cp-tp (Llama 3) pp inside dp"),
    "attention_kernel": st.column_config.TextColumn("attention kernel", help="the kernel every plan runs (this search's "
                                                    "setting, not searched): its published H100 speed"),
    "why_not_best": st.column_config.TextColumn("why it loses", help="the part of the step where it loses most time "
                                                "to the best, and whether its K/V exchange or rank order decides"),
}


def render_search(result: dict, rec) -> None:
    m, t = result["metrics"], result["tables"]
    cols = st.columns(4)
    cols[0].metric("plans that fit", f"{m['plans_feasible']:,}")
    cols[1].metric("refused", f"{m['plans_infeasible']:,}")
    cols[2].metric("best tokens/s per GPU", f"{m.get('best_tokens_per_s_per_gpu', 0):,.0f}")
    cols[3].metric("search time", f"{m['search_s']:.2f} s")
    ranked = pd.DataFrame(t["ranked"])
    if not ranked.empty:
        ranked["rank"] = range(1, len(ranked) + 1)
        st.altair_chart(alt.Chart(ranked).mark_bar().encode(
            x=alt.X("tokens_per_s_per_gpu:Q", title="predicted tokens/s per GPU"), y=alt.Y("plan:N", title=None, sort=None, axis=alt.Axis(labelLimit=360)),
            color=alt.Color("memory_gib:Q", title="GiB per GPU"),
            tooltip=["rank", "plan", alt.Tooltip("cp_comm:N", title="K/V exchange"), alt.Tooltip("order:N", title="rank order"),
                     alt.Tooltip("attention_kernel:N", title="attention kernel"),
                     alt.Tooltip("tokens_per_s_per_gpu:Q", format=",.0f"), alt.Tooltip("mfu:Q", format=".1%"),
                     alt.Tooltip("memory_gib:Q", format=".1f"), "why_not_best"]).properties(height=22 * len(ranked) + 40))
        st.caption(f"Every plan runs {ranked['attention_kernel'][0]} attention; both K/V exchanges are tried for every "
                   "cp > 1, both rank orders where they put a group on another link.")
        ui.table(ranked, column_config=CHOICE_HELP)
    st.subheader("What does not fit or divide, and why")
    ui.table(pd.DataFrame(t["infeasible"]))


st.title("Plan a training run")
view = VIEWS[ui.chosen_view(VIEWS, key="plan-view", param="view")]
form.model_config_upload(view, ui.store().root)
ui.experiment_page(
    view, render_training if view == "plan.training" else render_search, page_params=("view",),
    intro="A real model on a real cluster, predicted: memory per GPU, the step's time, MFU and days. Byte, memory and "
          "schedule functions are the ones the live runs check; a few efficiency constants are fitted on named "
          "published rows and every other row's error is shown below.")
