"""Autograd: symbolic, numeric and automatic differentiation side by side, and the DAGs behind them."""
import pandas as pd
import streamlit as st

from pages import ui

st.title("Autograd: three ways to differentiate")


def render(result: dict, rec) -> None:
    m = result["metrics"]
    cols = st.columns(3)
    cols[0].metric("forward nodes", m["forward_nodes"])
    cols[1].metric("backward nodes", m["backward_nodes"])
    cols[2].metric("kept for backward", f"{m['saved_for_backward_bytes']:,} B", help="tensors the backward rules read: the activations training holds")
    left, right = st.columns(2)
    with left:
        st.caption("Forward DAG (inputs in blue)")
        st.graphviz_chart(result["tables"]["forward_dot"][0]["dot"])
    with right:
        st.caption("Backward DAG: each edge is a local derivative, labelled with what it reads from the forward")
        st.graphviz_chart(result["tables"]["backward_dot"][0]["dot"])
    st.markdown(f"Symbolic (sympy): ∂loss/∂`{m['symbolic_element']}` of this expression = {m['symbolic_value']:.10g}, "
                f"written out with {m['symbolic_operations']:,} operations (the expression swell that automatic "
                "differentiation avoids); compared with ours and torch's in the checks above.")
    errors = {"ours_error": "|ours − torch|", "numeric_error": "|numeric − torch|"}
    ui.table(pd.DataFrame(result["tables"]["gradients"]),
             column_config={c: st.column_config.NumberColumn(title, format="%.3e") for c, title in errors.items()})


ui.experiment_page("graph.autodiff", render,
                   intro="Our reverse-mode autograd, central differences and sympy, each against torch.autograd in float64.")
