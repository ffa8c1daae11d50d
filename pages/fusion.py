"""Operator fusion: the captured forward+backward graph, the passes' log, why pairs did not fuse, kernels and bytes."""
import pandas as pd
import streamlit as st

from pages import ui

st.title("Operator fusion")


def render(result: dict, rec) -> None:
    m = result["metrics"]
    cols = st.columns(4)
    cols[0].metric("kernels, one per op", m["kernels_unfused"])
    cols[1].metric("kernels, fused plan", m["kernels_fused"])
    cols[2].metric("bytes moved, unfused → fused", f"{m['bytes_unfused']:,} → {m['bytes_fused']:,} B")
    cols[3].metric("ideal unique bytes", f"{m['ideal_unique_bytes']:,} B", help="graph inputs and outputs, once each")
    for note in result.get("notes", []):
        st.caption(note)
    st.caption("Blue pointwise, red reduction, green extern (library) kernels, grey views; dashed boxes are fused kernels.")
    st.graphviz_chart(result["tables"]["graph_dot"][0]["dot"])
    left, right = st.columns(2)
    with left:
        st.subheader("What the passes did")
        st.dataframe(pd.DataFrame(result["tables"]["log"]), hide_index=True, width="stretch")
    with right:
        st.subheader("Why these did not fuse")
        why = pd.DataFrame(result["tables"]["why_not"])
        if why.empty:
            st.info("Every producer-consumer pair fused.")
        else:
            st.dataframe(why, hide_index=True, width="stretch")


ui.experiment_page("graph.fusion", render,
                   intro="The function is traced to aten ops (make_fx, with LayerNorm and GELU decomposed), forward and backward "
                         "together; dead-code and common-subexpression elimination run, then ops are grouped into kernels.")
