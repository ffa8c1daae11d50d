"""FlashAttention: tiles on chip, the running max and sum, traffic counted from the kernel, error vs SDPA."""
import altair as alt
import pandas as pd
import streamlit as st

from pages import ui

st.title("FlashAttention")


def render(result: dict, rec) -> None:
    m, tables, cfg = result["metrics"], result["tables"], rec.config
    cols = st.columns(4)
    cols[0].metric("implementation", f"{cfg['impl']} ({m['device']})")
    cols[1].metric("forward time", f"{m['seconds'] * 1e3:,.1f} ms", help="wall time of this run's pass(es); interpreter on a CPU")
    cols[2].metric("IO model, standard", f"{m['io_model.standard_bytes'] / 2**20:,.2f} MiB", help="Θ(Nd + N²): Q, K, V, O once; S and P written and read")
    cols[3].metric("IO model, flash", f"{m['io_model.flash_bytes'] / 2**20:,.2f} MiB",
                   help=f"Θ(N²d²/M); on-chip bytes per tile step M = {m['io_model.sram_bytes_per_step']:,}")

    traffic = pd.DataFrame(tables["traffic"])  # empty for the tiled path, which counts none
    if not traffic.empty:
        st.subheader("Global-memory bytes per tensor, counted as the kernel ran")
        st.altair_chart(alt.Chart(traffic).mark_bar().encode(
            x=alt.X("bytes:Q", title="bytes loaded + stored"), y=alt.Y("tensor:N", title=None, sort=None),
            color=alt.Color("pass:N"), tooltip=["tensor", "pass", alt.Tooltip("bytes:Q", format=",")],
        ).properties(height=24 * traffic["tensor"].nunique() + 40), width="stretch")
        if cfg["impl"] == "triton":
            st.caption("S and P never reach global memory: they live in registers/shared memory for one tile step.")

    steps = tables["tile_steps"]  # empty above 256 tokens
    if steps:
        st.subheader("Which tiles are on chip, step by step (batch 0, head 0)")
        i = st.slider("tile step", 0, len(steps) - 1, 0, key=f"tile-{rec.id}")
        step = steps[i]
        grid = pd.DataFrame([{**tile, "state": "skipped (causal)" if tile["step"] is None else "on chip now" if tile["step"] == i
                              else "done" if tile["step"] < i else "to do"} for tile in tables["tile_grid"]])
        left, right = st.columns([1, 1])
        left.altair_chart(alt.Chart(grid).mark_rect(stroke="white").encode(
            x=alt.X("kv_tile:O", title=f"K/V tile ({cfg['block_n']} rows)"), y=alt.Y("q_tile:O", title=f"Q tile ({cfg['block_m']} rows)"),
            color=alt.Color("state:N", scale=alt.Scale(domain=["on chip now", "done", "to do", "skipped (causal)"],
                                                       range=["#e4572e", "#1f6fd1", "#e6e9ef", "#ffffff"])),
            tooltip=["q_tile", "kv_tile", "state"]).properties(height=260), width="stretch")
        rows = pd.DataFrame({"row": range(len(step["m"])), "running max m": step["m"], "running sum l": step["l"]}).melt("row")
        right.altair_chart(alt.Chart(rows).mark_line(point=True).encode(
            x=alt.X("row:Q", title="row within the Q tile"), y=alt.Y("value:Q", title=None), color=alt.Color("variable:N", title=None),
            tooltip=["row", "variable", alt.Tooltip("value:Q", format=".4f")]).properties(height=260), width="stretch")

    budget = tables["sram_budget"]
    if budget:
        st.subheader(f"The SRAM budget (seed 003): {cfg['sram_kib']} KiB, d = {cfg['head_dim']}, {cfg['dtype']}")
        words = m["sram.words"]
        st.markdown(f"M = {words:,} words → Bc = ⌈M / 4d⌉ = **{m['sram.Bc']}**, Br = min(Bc, d) = **{m['sram.Br']}** "
                    f"(this run's kernel tiles: {cfg['block_m']} x {cfg['block_n']}, powers of two for tl.dot). "
                    f"Peak live words {m['sram.peak_words']:,} = {m['sram.peak_share']:.0%} of M.")
        steps = pd.DataFrame(budget)
        for col in ("seed_delta_words", "seed_ledger_words"):  # runs recorded before the seed's ledger was compared
            steps[col] = steps[col] if col in steps else None
        bars = alt.Chart(steps).mark_bar().encode(
            x=alt.X("step:O", title="step of one (K/V tile, Q tile) iteration"), y=alt.Y("live_words:Q", title="words on chip"),
            tooltip=["step", "what", alt.Tooltip("delta_words:Q", format="+,"), alt.Tooltip("live_words:Q", format=","),
                     alt.Tooltip("seed_delta_words:Q", format="+,", title="seed 003's change"),
                     alt.Tooltip("seed_live_words:Q", format=",", title="seed 003's total")])
        cap = alt.Chart(pd.DataFrame({"M": [words]})).mark_rule(color="#e4572e", strokeDash=[4, 3]).encode(y="M:Q")
        seed_ledger = alt.Chart(steps.dropna(subset=["seed_ledger_words"])).mark_tick(color="black", thickness=2, size=30).encode(
            x="step:O", y="seed_ledger_words:Q", tooltip=["step", alt.Tooltip("seed_ledger_words:Q", format=",", title="seed 003's running total")])
        st.altair_chart((bars + cap + seed_ledger).properties(height=260), width="stretch")
        ui.table(steps[["step", "what", "delta_words", "seed_delta_words", "live_words", "seed_ledger_words"]])
        st.caption("Dashed: the SRAM size M. Bc = M/4d leaves room for four Bc x d tiles (Q, K, V, O); while S and P̃ are both "
                   "live (step 3) the set can pass M, which is why the paper's bound is O(M). Black ticks: seed 003's own running "
                   "total, its printed changes summed (Br = d only).")

    st.subheader("Seed 000's online-softmax example, run by the same update the tiled path uses")
    example = tables["online_softmax_example"]
    ui.table(pd.DataFrame(example[:-1]), column_config={
        "m_before": "m before", "rescale_exp(m_old-m)": "rescale exp(m before − m)", "f_block": "f of the block",
        "f_so_far": "f so far"})
    final = example[-1]
    st.markdown(f"After both blocks: m = {final['m']:.0f}, l = {final['l']:.6f} (closed form e⁻³ + e⁻² + e⁻¹ + e⁰ = "
                f"{final['l_closed_form']:.6f}); softmax = {', '.join(f'{v:.5f}' for v in final['softmax'])} "
                f"(torch.softmax: {', '.join(f'{v:.5f}' for v in final['reference_softmax'])}).")


ui.experiment_page(
    "attention.flash", render,
    intro="Attention computed by the FlashAttention-2 Triton kernels (interpreted on a CPU), the naive path that "
          "stores S and P, or the tiled PyTorch path; checked against torch's SDPA, forward and backward.",
)
