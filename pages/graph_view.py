"""Graphs of any size: a small one drawn as it is, a large one at its natural size (at most full width) in a box of its own
that scrolls (the chart's fullscreen button, top right on hover, shows it whole)."""
import re

import streamlit as st

SMALL = 30  # nodes that stay readable when the drawing is scaled to fit its column
NODE = re.compile(r'^\s+"[^"]*" \[', re.M)  # a node statement of backend/graph/dot.py's to_dot


def graph(dot: str, height: int = 720) -> None:
    nodes = len(NODE.findall(dot))
    if nodes <= SMALL:
        st.graphviz_chart(dot)
        return
    st.caption(f"{nodes} nodes, drawn full size: scroll inside the box to follow the graph; the fullscreen button "
               "(top right of the drawing) shows it whole.")
    with st.container(height=height):
        st.graphviz_chart(dot, width="content")  # its natural size (at most the box's width), never blown up
