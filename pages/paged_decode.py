"""Paged attention, the kernel: the tiny decoder generating with real K/V in the block pool (kvcache.paged_decode)."""
import altair as alt
import pandas as pd
import streamlit as st

from pages import ui

st.title("Paged attention: the kernel on real K/V")
st.page_link("pages/paged_attention.py", label="The block manager over a whole request trace: the Paged attention page",
             icon=":material/grid_view:")

HELD = alt.Scale(domain=["free", "one table", "shared"], range=["#e6e9ef", "#1f6fd1", "#f2a541"])


def block_tables(rows: pd.DataFrame, block_size: int, height: int = 40) -> alt.Chart:
    """Each sequence's block table: logical block -> physical block (the number in the cell)."""
    base = alt.Chart(rows).encode(x=alt.X("logical:O", title=f"logical block ({block_size} tokens each)", axis=alt.Axis(labelAngle=0)),
                                  y=alt.Y("seq:N", title="sequence"))
    cells = base.mark_rect(stroke="white").encode(
        color=alt.Color("physical:Q", title="physical block", scale=alt.Scale(scheme="viridis")),
        tooltip=["seq", "logical", "physical", alt.Tooltip("tokens:Q", title="tokens in the block")])
    return (cells + base.mark_text(color="white", fontSize=12).encode(text="physical:Q")).properties(
        height=60 + height * max(1, rows["seq"].nunique()))  # Streamlit's height includes the axes


def pool_strip(pool: pd.DataFrame) -> alt.Chart:
    """The physical blocks: free, in one table or shared (ref count 2+) as colour, the owners in the cell."""
    held = pool["ref_count"].map(lambda r: "free" if r == 0 else "one table" if r == 1 else "shared")
    pool = pool.assign(held=held, row="pool")
    base = alt.Chart(pool).encode(x=alt.X("block:O", title="physical block", axis=alt.Axis(labelAngle=0)),
                                  y=alt.Y("row:N", title=None, axis=None))
    cells = base.mark_rect(stroke="white").encode(
        color=alt.Color("held:N", scale=HELD, title="block"),
        tooltip=["block", alt.Tooltip("ref_count:Q", title="ref count"), alt.Tooltip("tokens:Q", title="tokens held"),
                 alt.Tooltip("owners:N", title="sequences")])
    return (cells + base.mark_text(fontSize=11).encode(text="owners:N")).properties(height=110)


def render(result: dict, rec) -> None:
    m, t, cfg = result["metrics"], result["tables"], rec.config
    cols = st.columns(5)
    cols[0].metric("max |logit difference|", f"{m['max_logit_diff']:.1e}", help="paged kernel against a contiguous cache, every position")
    cols[1].metric("blocks in use", m["blocks_used"], help="at the end, all sequences")
    cols[2].metric("copy-on-write copies", m["cow_copies"])
    cols[3].metric("swaps out and in", m["swaps"])
    cols[4].metric("4-token waste", f"{100 * m['seed_waste.contiguous']:.2f} %",
                   help=f"seed 000's example: 4 tokens in a cache reserved for 1,024; in pages of {cfg['block_size']}: {100 * m['seed_waste.paged']:.1f} % of one block")

    history = t["history"]
    st.subheader("Block tables and the pool, step by step")
    labels = [f"{i}: {h['label']}" for i, h in enumerate(history)]
    chosen = st.select_slider("state after", labels, value=labels[-1], key=f"paged-step-{rec.id}")
    snap = history[labels.index(chosen)]
    tables, pool = pd.DataFrame(snap["tables"]), pd.DataFrame(snap["pool"])
    left, right = st.columns([3, 2])
    if not tables.empty:
        left.altair_chart(block_tables(tables, cfg["block_size"]), width="stretch")
    left.caption("Each sequence's block table: logical block → physical block (the number)."
                 + (f" Swapped out to CPU: sequence {', '.join(map(str, snap['swapped']))}." if snap["swapped"] else ""))
    right.altair_chart(alt.Chart(pd.DataFrame(t["blocks_held"])).mark_line(point=True, interpolate="step-after").encode(
        x=alt.X("state:Q", title="state (prefill, fork, swap, decode steps)"), y=alt.Y("blocks:Q", title="blocks held"),
        color="seq:N", tooltip=["label", "seq", "blocks"]).properties(height=220), width="stretch")
    right.caption("Blocks each sequence holds, state by state.")
    st.altair_chart(pool_strip(pool), width="stretch")
    st.caption("The pool's physical blocks (up to the highest ever used): colour is the ref count, the text the "
               "sequences whose tables point at the block. A forked sequence shares its parent's blocks (ref count 2).")

    swap, fork = (t["swap"] or [None])[0], t["fork"][0]
    with st.expander("The fork and the swap"):
        st.markdown(f"Sequence {fork['child']} forks from sequence {fork['parent']} at {fork['at_tokens']} tokens, sharing "
                    f"{fork['shared_full_blocks']} full block(s) for good and the partial last block until its first write, "
                    "which copies it (copy-on-write)."
                    + (f" Sequence {fork['copied_by']} wrote first, so it holds the copy." if fork.get("copied_by") is not None else ""))
        if swap:
            st.markdown(f"At step {swap['step']}, sequence 1's blocks {swap['out']} go to CPU memory and come back into blocks "
                        f"{swap['in']}; its K/V read through the new table differs from before by {swap['kv_gap']:g}.")

    st.subheader("The kernel's logits against a contiguous cache")
    final, gaps = pd.DataFrame(t["final_logits"]), pd.DataFrame(t["logit_gaps"])
    left, right = st.columns(2)
    left.altair_chart(alt.Chart(final).mark_circle(size=18, opacity=0.6).encode(
        x=alt.X("contiguous:Q", title="logit, contiguous cache"), y=alt.Y("paged:Q", title="logit, paged (Triton kernel)"),
        color="seq:N", tooltip=["seq", "token", alt.Tooltip("paged:Q", format=".6f"), alt.Tooltip("contiguous:Q", format=".6f")],
    ).properties(height=260), width="stretch")
    left.caption("The last position's logits, every vocabulary entry: paged against contiguous.")
    gaps["max_abs_diff"] = gaps["max_abs_diff"].clip(lower=1e-9)
    right.altair_chart(alt.Chart(gaps).mark_line(point=True).encode(
        x=alt.X("position:Q", title="position (tokens)"),
        y=alt.Y("max_abs_diff:Q", title="max |logit difference| (floor 1e-9)", scale=alt.Scale(type="log")),
        color="seq:N", tooltip=["seq", "position", alt.Tooltip("max_abs_diff:Q", format=".2e")],
    ).properties(height=260), width="stretch")
    right.caption("The largest logit difference at every position; prompt positions attend through gather + SDPA, "
                  "generated ones through the kernel.")

    st.subheader("Seed 000's examples, on real caches")
    waste = pd.DataFrame(t["seed_waste"])
    long = waste.rename(columns={"slots_empty": "empty"}).melt(
        id_vars=["allocator"], value_vars=["slots_used", "empty"], var_name="slots", value_name="tokens")
    bars = alt.Chart(long).mark_bar().encode(
        x=alt.X("tokens:Q", title="KV slots reserved (tokens)"), y=alt.Y("allocator:N", title=None, axis=alt.Axis(labelLimit=300)),
        color=alt.Color("slots:N", title=None, scale=alt.Scale(domain=["slots_used", "empty"], range=["#1f6fd1", "#e6e9ef"])),
        tooltip=["allocator", "slots", "tokens"])
    labels = alt.Chart(waste.assign(text=waste.apply(lambda r: f"{r['slots_used']} of {r['slots_reserved']:,} hold tokens ({100 * r['waste']:.1f}% empty)", axis=1))
                       ).mark_text(align="left", dx=6).encode(x="slots_used:Q", y="allocator:N", text="text:N")
    st.altair_chart((bars + labels).properties(height=130), width="stretch")
    st.caption("Seed 000's four-token answer in a cache reserved for 1,024 tokens, against the same tokens in pages; "
               "bytes read off the cache tensors.")
    cow, cow_pool = pd.DataFrame(t["seed_cow_tables"]), pd.DataFrame(t["seed_cow_pool"])
    for when in cow["when"].unique():
        st.markdown(f"**{when}**: block tables, then the pool")
        st.altair_chart(block_tables(cow[cow["when"] == when], 4), width="stretch")
        st.altair_chart(pool_strip(cow_pool[cow_pool["when"] == when]), width="stretch")
    st.caption("Copy-on-write (pages of 4 tokens; A is sequence 0, B 1, C 2): C forks from A and shares pages 0-3; C's first token goes to the shared, "
               "partly filled page 3, so the manager copies it to page 5 and only C's table changes.")


ui.experiment_page(
    "kvcache.paged_decode", render,
    intro="The tiny GQA decoder generates several sequences round-robin with its K and V in one block pool; each decode "
          "step reads them through the block tables in the Triton paged-attention kernel. One sequence forks (copy-on-write), "
          "one is swapped out to CPU and back.",
)
