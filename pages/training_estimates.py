"""The training pipeline (pretraining, SFT, RLHF) and back-of-envelope estimates of training time and memory."""
import altair as alt
import pandas as pd
import streamlit as st

from pages import ui

st.title("The training pipeline and its estimates")

STAGES = [
    ("Pretraining", "learn the language itself: self-supervised next-token prediction over trillions of tokens",
     [("pages/data_parallel.py", "Data parallel & ZeRO"), ("pages/pipeline.py", "Pipeline parallel"),
      ("pages/mixed_precision.py", "Mixed precision & loss scaling"), ("pages/number_formats.py", "Number formats"),
      ("pages/flash_attention.py", "FlashAttention"), ("pages/moe_routing.py", "MoE routing"),
      ("pages/collectives.py", "Collectives")]),
    ("SFT (supervised fine-tuning)", "follow instructions: supervised training on labelled prompt/answer pairs "
     "(full-parameter, LoRA or adapter tuning); the same training systems on far fewer tokens",
     [("pages/variants_train.py", "Attention variants in training"), ("pages/kv_cache.py", "KV cache")]),
    ("RLHF (reinforcement learning from human feedback)", "match human preferences: a policy (the model) acts in an MDP "
     "and maximises reward; generating its rollouts is serving",
     [("pages/bellman.py", "MDPs & Bellman"), ("pages/speculative.py", "Speculative sampling"),
      ("pages/paged_attention.py", "Paged attention")]),
]


def general(df: pd.DataFrame) -> dict:
    """Float columns in %g form: 3.15e+23, not 315000000000000000000000."""
    # beyond 2^53 the table shows raw digits for %g, so those columns use its scientific form
    return {c: st.column_config.NumberColumn(format="scientific" if df[c].abs().max() > 2**53 else "%.4g")
            for c in df.columns if df[c].dtype.kind == "f"}


def pipeline_overview() -> None:
    st.subheader("Where each stage's systems run in this explorer")
    cols = st.columns(len(STAGES))
    for col, (stage, goal, pages) in zip(cols, STAGES):
        with col:
            st.markdown(f"**{stage}**  \n{goal}.")
            for path, label in pages:
                st.page_link(path, label=label, icon=":material/arrow_forward:")
    st.caption("Seed 000: pretraining learns a general representation of language, SFT teaches the model to follow "
               "instructions, RLHF aligns it with human preferences; distillation and further tuning extend it.")


def render(result: dict, rec) -> None:
    m, t, cfg = result["metrics"], result["tables"], rec.config
    st.subheader("Seed 002's training-time equation")
    st.latex(r"T = \frac{6\,N\,D}{\text{peak}\cdot\text{MFU}\cdot\text{devices}\cdot\text{parallel efficiency}}")
    cols = st.columns(3)
    cols[0].metric("training compute 6·N·D", f"{m['training_flops']:.3g} FLOPs")
    cols[1].metric(f"time on {cfg['devices']:,} × {cfg['device']}", f"{m['training_days']:,.1f} days")
    cols[2].metric(f"memory per rank, ZeRO-3 over {cfg['dp_ranks']} ranks", f"{m['memory_per_rank_gb.ZeRO-3']:,.1f} GB",
                   help=f"DDP: {m['memory_per_rank_gb.DDP']:,.0f} GB (weights, gradients, Adam states; no activations)")
    scaling = pd.DataFrame(t["scaling"])
    chosen = alt.Chart(pd.DataFrame({"devices": [cfg["devices"]], "days": [m["training_days"]]})).mark_point(
        size=150, shape="diamond", color="black", filled=True).encode(x="devices:Q", y="days:Q", tooltip=["devices", alt.Tooltip("days:Q", format=",.1f")])
    st.altair_chart((alt.Chart(scaling).mark_line(point=True).encode(
        x=alt.X("devices:Q", scale=alt.Scale(type="log"), title="accelerators (log)"),
        y=alt.Y("days:Q", scale=alt.Scale(type="log"), title="predicted training time (days, log)"),
        color=alt.Color("device:N", title=None), tooltip=["device", "devices", alt.Tooltip("days:Q", format=",.1f")]) + chosen)
        .properties(height=300), width="stretch")
    st.caption(f"N = {cfg['params_b']:g}B parameters, D = {cfg['tokens_b']:g}B tokens, MFU {cfg['mfu']}, parallel efficiency "
               f"{cfg['parallel_efficiency']}. A model, not a measurement.")

    st.subheader("Memory per data-parallel rank: (2 + 2 + 12)ψ and ZeRO")
    st.altair_chart(alt.Chart(pd.DataFrame(t["memory_per_rank"]).assign(GB=lambda d: d["bytes"] / 1e9)).mark_bar().encode(
        x=alt.X("GB:Q", title=f"GB per rank ({cfg['dp_ranks']} ranks)"), y=alt.Y("stage:N", title=None, sort=None),
        color=alt.Color("category:N", title=None), tooltip=["stage", "category", alt.Tooltip("GB:Q", format=",.2f")])
        .properties(height=180), width="stretch")

    st.subheader("The formulas against measured small runs")
    meas = t["measured"][0]
    ui.table(pd.DataFrame([
        {"quantity": "FLOPs of one training step (tiny LLaMA)", "measured": meas["counted"], "formula": meas["exact"],
         "how measured": "FlopCounterMode", "formula used": "6·N_linear·D + 12·L·T·d·D"},
        {"quantity": "same, by 6·N·D with all parameters", "measured": meas["counted"], "formula": meas["six_n_all"],
         "how measured": "FlopCounterMode", "formula used": "6·N·D"},
        {"quantity": "step time at twice the batch (s), this CPU", "measured": meas["double_step_s"], "formula": meas["double_step_predicted_s"],
         "how measured": "wall clock, this CPU", "formula used": f"FLOPs ÷ this CPU's rate at one batch ({meas['cpu_flops_per_s'] / 1e9:.2f} GFLOP/s)"},
    ]).drop(columns="how measured"))  # FLOPs by FlopCounterMode, time by the wall clock: the caption says so
    st.caption("FLOPs counted by torch's FlopCounterMode; step time on this CPU's wall clock.")
    mem = pd.DataFrame(t["memory_measured"] + t["zero_memory"])
    ui.table(mem)
    st.caption("Bytes read off real tensors (an fp16 copy with gradients, fp32 master weights and AdamW's states"
               + (", and each rank of a ZeRO-1 run" if t["zero_memory"] else "; set zero_run to add a real ZeRO-1 run") + ").")

    st.subheader("Seed 002: a 175B model's memory")
    seed2 = pd.DataFrame(t["seed_002_175b"])
    seed2["GB"] = seed2["bytes"] / 1e9
    seed2 = seed2.drop(columns=["bytes"])
    ui.table(seed2, column_config=general(seed2))
    st.caption("The seed's 320 GB is 350 GB in GiB (326 GiB); 5600 GB ÷ 64 GB is 87.5, so 88 cards.")

    st.subheader("Seed 004: training times on one V100, and what they imply")
    seed4 = pd.DataFrame(t["seed_004"])
    ui.table(seed4, column_config={**general(seed4),
        "parameters": st.column_config.NumberColumn("N", format="%.3g"),
        "dataset_bytes": st.column_config.NumberColumn("data (B)", format="%.3g"),
        "tokens": st.column_config.NumberColumn("D (tokens)", format="%.3g"),
        "flops_6nd": st.column_config.NumberColumn("6·N·D", format="%.3g"),
        "seed_days": st.column_config.NumberColumn("seed's days", format="%.1f"),
        "implied_tflops": st.column_config.NumberColumn("TFLOP/s", format="%.2f", help="implied sustained TFLOP/s"),
        "implied_mfu": st.column_config.NumberColumn("MFU", format="percent", help="implied MFU, of the V100's 125 TFLOP/s"),
        "predicted_days": st.column_config.NumberColumn("days", format="%.1f", help=f"predicted at MFU {cfg['mfu']}")})
    long = seed4.melt(id_vars=["model"], value_vars=["seed_days", "predicted_days"], var_name="source", value_name="days")
    long["source"] = long["source"].map({"seed_days": "seed 004's table", "predicted_days": f"6·N·D at MFU {cfg['mfu']}"})
    st.altair_chart(alt.Chart(long).mark_point(size=140, filled=True).encode(
        x=alt.X("days:Q", scale=alt.Scale(type="log"), title="days on one V100 (log)"), y=alt.Y("model:N", title=None, sort=None),
        color=alt.Color("source:N", title=None), shape=alt.Shape("source:N", title=None),
        tooltip=["model", "source", alt.Tooltip("days:Q", format=",.1f")]).properties(height=200), width="stretch")
    st.caption("The table's rows imply very different utilisations (a few TFLOP/s for the small models, close to the V100's "
               "peak for GPT-3): they come from different setups, not from one formula. The disagreement is shown, not fitted.")


pipeline_overview()
ui.experiment_page("estimate.training", render,
                   intro="A calculator for the seeds' estimates, with its formulas checked on small runs measured here.")
