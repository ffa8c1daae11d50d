"""Native sparse attention: what each query reads through the compressed, selected and window branches, and how
few KV bytes that is beside full attention."""
import altair as alt
import pandas as pd
import streamlit as st

from pages import ui

st.title("Native sparse attention")

BRANCHES = ("compressed", "selected", "window")


def _one_query(result: dict, cfg: dict, rec) -> None:
    selection = result["tables"]["selection"]
    n = len(selection)
    t = st.slider("query position", 0, n - 1, n - 1, key=f"nsa-q-{rec.id}")
    row = selection[t]
    spans = []
    if row["compressed_visible"]:  # compressed keys summarise every token up to the last visible block's end
        spans.append({"branch": "compressed", "start": 0, "end": row["compressed_end"],
                      "what": f"{row['compressed_visible']} compressed keys (one per {cfg['cmp_block']} tokens, every {cfg['cmp_stride']})"})
    for b, (start, end) in zip(row["blocks"], row["selected_spans"]):
        spans.append({"branch": "selected", "start": start, "end": end, "what": f"block {b}"})
    spans.append({"branch": "window", "start": row["window_start"], "end": row["window_end"], "what": f"last {cfg['window']} tokens"})
    st.altair_chart(alt.Chart(pd.DataFrame(spans)).mark_bar(stroke="white").encode(
        x=alt.X("start:Q", title="key position", scale=alt.Scale(domain=[0, n])), x2="end:Q",
        y=alt.Y("branch:N", title=None, scale=alt.Scale(domain=list(BRANCHES))),
        color=alt.Color("branch:N", scale=alt.Scale(domain=list(BRANCHES)), legend=None),
        tooltip=["branch", "what", "start", "end"]).properties(height=150), width="stretch")
    st.caption(f"Query {t} (KV group 0): the selected branch reads blocks {row['blocks']} of {cfg['sel_block']} tokens "
               f"(always the first and the {cfg.get('local_blocks', 1)} latest, the rest by importance); the compressed branch "
               "reads one key per block; the window the latest tokens.")


def render(result: dict, rec) -> None:
    m, tables, cfg = result["metrics"], result["tables"], rec.config
    cols = st.columns(4)
    cols[0].metric("KV bytes, last query (NSA)", f"{m['kv_bytes_per_query.nsa_last']:,.0f}")
    cols[1].metric("KV bytes, last query (full)", f"{m['kv_bytes_per_query.full_last']:,.0f}")
    cols[2].metric("NSA / full", f"{m['nsa_over_full_last']:.1%}")
    cols[3].metric("compressed / selection blocks", f"{m['compressed_blocks']} / {m['selection_blocks']}")

    st.subheader("What one query reads")
    _one_query(result, cfg, rec)

    st.subheader("Block importance from the compressed branch (KV group 0)")
    imp = pd.DataFrame(tables["importance"])
    st.altair_chart(alt.Chart(imp).mark_rect().encode(
        x=alt.X("sel_block:O", title=f"selection block ({cfg['sel_block']} tokens)"),
        y=alt.Y("query:O", title="query position", axis=alt.Axis(labelOverlap=True)),
        color=alt.Color("importance:Q", scale=alt.Scale(scheme="blues")),
        stroke=alt.condition("datum.selected", alt.value("#e4572e"), alt.value(None)),
        tooltip=["query", "sel_block", alt.Tooltip("importance:Q", format=".3f"), "selected"]).properties(height=360), width="stretch")
    st.caption("Importance (NSA's eq. 9): the compressed attention probabilities summed over the group's heads and over the "
               "compressed blocks that overlap each selection block, each counted once per stride of it inside the block. "
               "Outlined: the blocks chosen (the first and the local blocks, then the highest).")

    sweep = pd.DataFrame(tables["sweep"])
    if not sweep.empty:
        st.subheader("KV bytes per query as the sequence grows (counted from the gathers)")
        long = sweep.melt("seq_len", [f"{b}_last" for b in BRANCHES] + ["nsa_last", "full_last"], "what", "bytes")
        long["what"] = long["what"].str.replace("_last", "")
        st.altair_chart(alt.Chart(long).mark_line(point=True).encode(
            x=alt.X("seq_len:Q", title="sequence length N", scale=alt.Scale(type="log", base=2)),
            y=alt.Y("bytes:Q", title="K + V bytes read by the last query", scale=alt.Scale(type="log"), axis=alt.Axis(format="~s")),
            color=alt.Color("what:N", title=None),
            strokeDash=alt.condition("datum.what == 'full'", alt.value([5, 3]), alt.value([1, 0])),
            tooltip=["seq_len", "what", alt.Tooltip("bytes:Q", format=",")]).properties(height=320), width="stretch")
        ui.table(sweep[["seq_len", "nsa_mean", "full_mean", "nsa_last", "full_last", "nsa_over_full_last"]],
                     hide_index=True, width="stretch")
    st.caption("Mean gate per branch: " + ", ".join(f"{b} {m[f'gate_mean.{b}']:.3f}" for b in BRANCHES))


ui.experiment_page(
    "attention.nsa", render,
    intro="Seed 003's native sparse attention: skim (compressed blocks), read the marked passages (top-n selected "
          "blocks), read around yourself (a sliding window), and gate the three. Computed by gathering only what each "
          "branch reads, and checked against dense attention with the same masks.",
)
