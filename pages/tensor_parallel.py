"""Tensor & sequence parallel: the tiny LLaMA's weights split over gloo ranks, every collective with its bytes."""
import altair as alt
import pandas as pd
import streamlit as st

from pages import timeline, ui

st.title("Tensor & sequence parallel")


def _matrix(rows) -> str:
    return " ; ".join(" ".join(f"{v:g}" for v in row) for row in rows)


def worked_examples(steps: list[dict]) -> None:
    st.subheader("Seed 000's worked examples, as the two ranks ran them")
    st.caption("X = [1 2 ; 3 4], W = [5 6 ; 7 8]. Column split: each rank computes its column of Y and the columns are "
               "gathered. Row split: each rank multiplies its column of X by its row of W (an outer product) and the "
               "2x2 partial products are summed.")
    rows = []
    for s in steps:
        shown = {k: _matrix(v) for k, v in s.items() if k not in ("example", "rank", "step")}
        rows.append({"example": s["example"], "rank": s["rank"], "step": s["step"],
                     "values": ",  ".join(f"{k} = [{v}]" for k, v in shown.items())})
    df = pd.DataFrame(rows)
    for example in ("column", "row"):  # one above the other: side by side, the row split's values were cut
        st.markdown(f"**Split by {example}s**")
        ui.table(df[df["example"] == example].drop(columns="example"))


def render(result: dict, rec) -> None:
    m, t = result["metrics"], result["tables"]
    cols = st.columns(3)
    cols[0].metric("ranks t", m["world_size"])
    cols[1].metric("MLP forward bytes per rank per layer (TP)", f"{m['TP MLP forward bytes per rank per layer']:,} B",
                   help="one ring all-reduce of b·s·h float64 values: 2(t-1)/t of them leave each rank")
    cols[2].metric("same with SP (all-gather + reduce-scatter)", f"{m['TP + SP MLP forward bytes per rank per layer']:,} B")

    st.subheader("Each rank's shard of every weight")
    shards = pd.DataFrame(t["shards"])
    st.altair_chart(alt.Chart(shards).mark_bar().encode(
        y=alt.Y("parameter:N", title=None, sort=None, axis=alt.Axis(labelLimit=220)), x=alt.X("elements:Q", title="elements held (per rank)"),
        color=alt.Color("rank:N"), yOffset="rank:N",
        tooltip=["rank", "parameter", "shape", alt.Tooltip("elements:Q", format=",")]).properties(height=alt.Step(9)), width="stretch")
    st.caption("wqkv and w13 are the column-parallel weights (query heads with their GQA KV heads; gate and up), wo and "
               "down the row-parallel ones; norms are whole on every rank, embedding and head split by vocabulary.")

    st.subheader("The f and g collectives of one training step")
    coll = pd.DataFrame(t["collectives"])
    st.altair_chart(alt.Chart(coll).mark_bar().encode(
        x=alt.X("sent_bytes:Q", title="bytes rank 0 sent (measured, B)"), y=alt.Y("name:N", title=None, axis=alt.Axis(labelOverlap=False)),
        color=alt.Color("op:N", title="collective"), row=alt.Row("mode:N", title=None), column=alt.Column("phase:N", title=None),
        tooltip=["mode", "phase", "op", "name", "calls", alt.Tooltip("sent_bytes:Q", format=","),
                 alt.Tooltip("model_bytes:Q", format=",", title="model (B)")]
    ).properties(height=alt.Step(18), width=300).configure_axisY(labelLimit=220))
    ui.table(coll)

    st.subheader("Activation memory per rank, measured against the formula")
    mem = pd.DataFrame(t["memory"])
    long = mem.melt(id_vars=["layout", "rank"], value_vars=["measured_bytes", "formula_bytes"], var_name="source", value_name="bytes")
    st.altair_chart(alt.Chart(long).mark_bar().encode(
        x=alt.X("rank:N", title="rank"), xOffset="source:N", y=alt.Y("bytes:Q", title="bytes saved for backward (B)"),
        color=alt.Color("source:N", title=None), column=alt.Column("layout:N", title=None, sort=["one rank, t=1"]),
        tooltip=["layout", "rank", "source", alt.Tooltip("bytes:Q", format=",")]).properties(width=160, height=220))
    ui.table(mem,
                 column_config={"paper_gpt_block_bytes": st.column_config.NumberColumn("Korthikanti, GPT block fp16 (B)", format="%d")})

    if "worked_examples" in t:
        worked_examples(t["worked_examples"])

    st.subheader("DTensor (parallelize_module) on the same layers")
    peer = pd.DataFrame(t["dtensor"])
    if peer["dtensor_bytes_written"].notna().all():
        sent = pd.DataFrame([{"layer": r["layer"], "side": side, "bytes": r[f"{key}_bytes_written"], "model": r[f"{key}_bytes_model"]}
                             for r in t["dtensor"] for side, key in (("DTensor on gloo", "dtensor"), ("ours", "ours"))])
        st.altair_chart(alt.Chart(sent).mark_bar().encode(
            x=alt.X("bytes:Q", title="bytes rank 0 wrote to its sockets, forward + backward (measured, B)"),
            y=alt.Y("side:N", title=None), color=alt.Color("side:N", legend=None), row=alt.Row("layer:N", title=None, header=alt.Header(labelAngle=0, labelAlign="left")),
            tooltip=["layer", "side", alt.Tooltip("bytes:Q", format=","), alt.Tooltip("model:Q", format=",", title="model (B)")]
        ).properties(height=alt.Step(22), width=420))
        st.caption("Measured from /proc/self/io (bytes handed to write calls, less gloo's 48 B message preamble), beside "
                   "the model of the collectives each side issued (the tooltip). Every DTensor collective, with its size, "
                   "is in the run's dtensor_collectives table.")
    errors = ["output_error", "input_grad_error", "weight_grad_error"]  # two tables: together they were cut at the right
    st.markdown("**DTensor against ours**: the largest difference in each output and gradient, then the bytes each side sent")
    ui.table(peer[["layer", *errors]], column_config={
        c: st.column_config.NumberColumn(c.removesuffix("_error").replace("_", " ") + " error", format="%.1e",
                                         help="max |DTensor − ours| over the tensor") for c in errors})
    ui.table(peer[["layer"] + [c for c in peer if "_bytes_" in c]], column_config={
        f"{side}_bytes_{what}": st.column_config.NumberColumn(f"{name}, {what} (B)", format="localized")
        for side, name in (("dtensor", "DTensor"), ("ours", "ours")) for what in ("model", "written")})
    with st.expander("The collectives each side issued, per layer"):
        st.markdown("\n".join(f"- **{r['layer']}**: DTensor {r['dtensor_collectives']}; ours {r['ours_collectives']}"
                               for r in t["dtensor"]))
    st.subheader("Seed 004: 2MK for tensor parallel against MK for pipeline parallel")
    ui.table(pd.DataFrame(t["tp_vs_pp"]))
    st.caption("The pipeline row is a real two-stage cut after layer 0: rank 0 computes the layer and sends its output to "
               "rank 1 (our p2p send, the bytes also read off rank 0's socket), which finishes the forward to one process's loss.")
    timeline.run_timeline(rec, title="Per-rank timeline: compute, collectives (our ring over send/recv)")


ui.experiment_page(
    "parallel.tp", render,
    intro="The tiny LLaMA, split over the ranks as Megatron-LM splits it, runs one training step twice: tensor parallel "
          "(norms whole on every rank; an all-reduce after each row-parallel layer in forward, before each column-parallel "
          "layer in backward) and with sequence parallel (norms on sequence shards; all-gather and reduce-scatter instead). "
          "Every output, gradient, byte and saved activation is checked against one process and the models.")
