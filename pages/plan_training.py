"""Plan a training run: one plan's memory, step and Gantt (plan.training), or every plan ranked (plan.search)."""
import altair as alt
import pandas as pd
import streamlit as st

from pages import form, ui

GiB = 2 ** 30
VIEWS = {"plan.training": "One plan", "plan.search": "Search every plan"}


def published(tables: dict) -> None:
    st.subheader("The planner against published measurements")
    df = pd.DataFrame(tables["published"])
    df["error %"] = 100 * df["error"]
    chart = alt.Chart(df).mark_bar().encode(
        x=alt.X("error %:Q", title="prediction error (%)"), y=alt.Y("row:N", title=None, sort=None, axis=alt.Axis(labelLimit=320)),
        color=alt.Color("role:N", title=None, scale=alt.Scale(domain=["calibration", "validation"], range=["#888", "#4c78a8"])),
        tooltip=["row", "role", "published", alt.Tooltip("predicted:Q", format=",.4g"), alt.Tooltip("error %:Q", format="+.1f"), "source"])
    band = alt.Chart(pd.DataFrame({"x": [-10, 10]})).mark_rule(strokeDash=[4, 3], color="#c00").encode(x="x:Q")
    st.altair_chart((chart + band).properties(height=28 * len(df) + 40))
    st.caption("Grey rows fitted the constants (calibration); blue rows were predicted with them (validation). Dashed: ±10%.")
    with st.expander("Every row with its source"):
        ui.table(df.drop(columns=["error"]))
    cap = tables.get("hopper_500w", [{}])[0]
    if cap:
        st.caption(f"The 500 W H100 96GB's fitted GEMM share is {cap['fitted 500 W ÷ 700 W']:.2f}× the 700 W one: eager PyTorch's "
                   f"elementwise passes, the HBM2e and FlashAttention-2's H100 speed are modelled, the power cap can take at most "
                   f"{1 - cap['power cap at most (NVL ÷ SXM peak)']:.0%}, a factor {cap['unexplained factor']:.2f} stays unexplained.")
        with st.expander("Why the 500 W constant is lower, where the DP-128 row's v comes from, and the 131k row's attention"):
            st.markdown(
                "torchtitan's Dec 2024 rows ran eager PyTorch (`compile = false`), bf16 without Float8, selective op-level "
                "activation checkpointing, on H100 96GB HBM2e cards at their default 500 W power limit; tokens/s/GPU counts "
                "every token of the local batch, read at step 90. Eager RMSNorm, RoPE and SwiGLU run as separate fp32/bf16 "
                "passes over a 2.4 TB/s HBM: the planner counts their bytes (checked against torch's dispatched ops) and "
                "predicts the published FSDP + torch.compile rows from the eager fit. The power cap lowers the clocks: "
                "torchtitan states the card's peak lies between the H100 NVL's and the SXM's, which bounds the cap's share. "
                "The card's HBM2e (2.4 TB/s against HBM3's 3.35) is modelled; so is attention at FlashAttention-2's "
                "published H100 speed, the kernel PyTorch's SDPA ran on H100 in Dec 2024 (cuDNN was opt-in). What remains "
                "has no source: the clock a dense GEMM sustains under the 500 W cap (the NVL bound is a boost-clock peak), "
                "and the 700 W constant coming from Meta's production stack on Llama 3 405B, the 500 W one from "
                "torchtitan's eager 8B run.")
            ui.table(pd.DataFrame([cap]))
            st.markdown(
                "The Llama 3 paper (Sec. 3.3.2) removes one layer from the first and the last stage so that the first "
                "chunk of the first stage holds only the embedding: one-layer chunks, 126 layers + 2 = 128 chunks over 16 "
                "ranks, v = 8. The paper prints no v; this is the planner's reading. The fitted Hopper constant cancels "
                "between the 8,192-GPU calibration row and the DP-128 row, so that row's error tests the bubble (16 micro-"
                "batches instead of 32) and data parallel's exposed time at the chosen v, not a fitted constant:")
            ui.table(pd.DataFrame(tables.get("dp128_by_virtual_stages", [])))
            st.markdown(
                "The 131k context-parallel row runs Llama 3's own CP (Sec. 3.3.2): K and V all-gathered before attention "
                "(exposed on the critical path, GQA's 8 KV heads only), their gradients reduce-scattered, the gathered K/V "
                "held for the backward; the explorer's live mesh runs ring attention only, so these bytes are checked "
                "against the tensor shapes, not a live run. At 131k, attention is 40% of the FLOPs, and on Hopper it "
                "runs at a published kernel's measured H100 speed (FlashAttention-3 paper), not at the Ampere-fitted ratio "
                "(FlashAttention-2 reaches 35% of an H100's peak, 50-73% of an A100's). The paper names no kernel; the "
                "Llama 3 rows take FlashAttention-3, the fastest published, and every kernel's result is shown "
                "(the Hopper constant refitted on the 8,192-GPU row each time):")
            ui.table(pd.DataFrame(tables.get("cp131k_by_attention_kernel", [])))


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
    published(t)
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
run_id = st.query_params.get("run")
shown = ui.store().get(run_id) if run_id else None
asked = st.query_params.get("view")
default = shown.experiment if shown and shown.experiment in VIEWS else asked if asked in VIEWS else "plan.training"
view = st.segmented_control("View", list(VIEWS), default=default, format_func=VIEWS.get, key="plan-view") or default
if shown and shown.experiment != view:
    st.query_params.pop("run")
st.query_params["view"] = view
form.model_config_upload(view, ui.store().root)
ui.experiment_page(
    view, render_training if view == "plan.training" else render_search, page_params=("view",),
    intro="A real model on a real cluster, predicted: memory per GPU, the step's time, MFU and days. Byte, memory and "
          "schedule functions are the ones the live runs check; a few efficiency constants are fitted on named "
          "published rows and every other row's error is shown below.")
