"""Graphs of any size: a small one drawn by Graphviz as it is; a large one in a zoomable view (scroll to zoom, drag to
pan, every node's details in its tooltip), with the Graphviz drawing one tab away.

The zoomable view reads the DOT text backend/graph/dot.py writes (node and edge statements, one a line, and the fusion
pass's kernel clusters), lays the graph out in layers with networkx (each node one layer below its deepest input, each
layer ordered by the mean place of its inputs, so edges mostly run straight down) and draws it with Altair.
"""
from __future__ import annotations

import re

import altair as alt
import networkx as nx
import pandas as pd
import streamlit as st

SMALL = 30  # nodes that stay readable when the drawing is scaled to fit its column
_STRING = r'"((?:[^"\\]|\\.)*)"'
NODE = re.compile(rf'^\s+{_STRING} \[(.*)\];$', re.M)
EDGE = re.compile(rf'^\s+{_STRING} -> {_STRING} \[(.*)\];$', re.M)
ATTR = re.compile(rf'(\w+)={_STRING}')
CLUSTER = re.compile(rf'subgraph cluster_\w+ {{ label={_STRING};[^;]*;((?: "(?:[^"\\]|\\.)*";)*) }}')


def _unquote(text: str) -> str:
    return text.replace("\\n", "\n").replace('\\"', '"').replace("\\\\", "\\")


def parse_dot(dot: str) -> tuple[nx.DiGraph, dict[str, str]]:
    """The graph with each node's and edge's attributes, and each clustered node's cluster label."""
    g = nx.DiGraph()
    for name, attrs in NODE.findall(dot):
        g.add_node(_unquote(name), **{k: _unquote(v) for k, v in ATTR.findall(attrs)})
    for u, v, attrs in EDGE.findall(dot):
        g.add_edge(_unquote(u), _unquote(v), **{k: _unquote(val) for k, val in ATTR.findall(attrs)})
    cluster_of = {}
    for label, members in CLUSTER.findall(dot):
        for member in re.findall(_STRING, members):
            cluster_of[_unquote(member)] = _unquote(label)
    return g, cluster_of


def layered_layout(g: nx.DiGraph) -> dict[str, tuple[float, int]]:
    """(x, layer) per node: a node's layer is one below its deepest input, and an input sits just above its first
    reader (not at the top, with long edges down); within a layer, nodes are ordered by the mean x of their inputs
    (an input by its place in the graph), then spaced one apart, centred."""
    layer: dict[str, int] = {}
    for node in nx.topological_sort(g):
        layer[node] = 1 + max((layer[p] for p in g.predecessors(node)), default=-1)
    for node in g.nodes:
        if g.in_degree(node) == 0 and g.out_degree(node):
            layer[node] = min(layer[s] for s in g.successors(node)) - 1
    layers: dict[int, list[str]] = {}
    for node in g.nodes:
        layers.setdefault(layer[node], []).append(node)
    x: dict[str, float] = {}
    for depth in sorted(layers):
        nodes = layers[depth]

        def centre(i, n):
            inputs = [x[p] for p in g.predecessors(n) if p in x]
            return sum(inputs) / len(inputs) if inputs else i - len(nodes) / 2
        ordered = sorted(nodes, key=lambda n: centre(nodes.index(n), n))
        for i, n in enumerate(ordered):
            x[n] = 2.0 * (i - (len(ordered) - 1) / 2)
    return {n: (x[n], layer[n]) for n in g.nodes}


PX_PER_LAYER = 34


def zoomable(dot: str, max_height: int = 900) -> alt.LayerChart:
    g, cluster_of = parse_dot(dot)
    pos = layered_layout(g)
    layers = max(p[1] for p in pos.values()) - min(p[1] for p in pos.values()) + 1
    height = min(max_height, max(320, PX_PER_LAYER * layers))
    nodes = pd.DataFrame([{"node": n, "x": pos[n][0], "layer": pos[n][1], "name": a.get("label", n).split("\n")[0],
                           "label": a.get("label", n).replace("\n", " · "), "details": a.get("tooltip", ""),
                           "fill": a.get("fillcolor", "#f4f6fa"), "kernel": cluster_of.get(n, "")} for n, a in g.nodes(data=True)])
    edges = pd.DataFrame([{"x": pos[u][0], "layer": pos[u][1], "x2": pos[v][0], "layer2": pos[v][1],
                           "edge": f"{u} → {v}", "label": a.get("label", ""), "crossing": "dashed" in a.get("style", ""),
                           "color": a.get("color", "#9aa3b2")} for u, v, a in g.edges(data=True)],
                         columns=["x", "layer", "x2", "layer2", "edge", "label", "crossing", "color"])
    x = alt.X("x:Q", axis=None, scale=alt.Scale(padding=30))
    y = alt.Y("layer:Q", axis=None, scale=alt.Scale(reverse=True, padding=30))
    links = alt.Chart(edges).mark_rule(strokeWidth=1.2).encode(
        x=x, y=y, x2="x2:Q", y2="layer2:Q", color=alt.Color("color:N", scale=None),
        strokeDash=alt.condition("datum.crossing", alt.value([5, 3]), alt.value([1, 0])),
        tooltip=[alt.Tooltip("edge:N", title="edge"), alt.Tooltip("label:N", title="transfer")])
    tooltip = [alt.Tooltip("label:N", title="node"), alt.Tooltip("details:N", title="details")]
    if cluster_of:
        tooltip.append(alt.Tooltip("kernel:N", title="fused into"))
    boxes = alt.Chart(nodes).mark_square(size=260, stroke="#5b6472", strokeWidth=0.6).encode(
        x=x, y=y, fill=alt.Fill("fill:N", scale=None), tooltip=tooltip)
    names = alt.Chart(nodes).mark_text(align="left", dx=10, fontSize=10, color="#1f2430").encode(
        x=x, y=y, text="name:N", tooltip=tooltip)
    return (links + boxes + names).properties(height=height).interactive()


def graph(dot: str, height: int = 640) -> None:
    nodes = len(NODE.findall(dot))  # counted without building the graph: most drawings are small
    if nodes <= SMALL:
        st.graphviz_chart(dot)
        return
    zoom, drawing = st.tabs([f"Zoomable ({nodes} nodes)", "Graphviz drawing"])
    with zoom:
        st.caption("Scroll to zoom, drag to pan, double-click to reset; hover a node for its op, shape and bytes. "
                   "Data flows down: each node sits one layer below its deepest input.")
        st.altair_chart(zoomable(dot), width="stretch")
    with drawing:
        st.caption("Graphviz's own layout, full size: scroll inside the box; the fullscreen button (top right of the "
                   "drawing) shows it whole.")
        with st.container(height=height):
            st.graphviz_chart(dot, width="content")  # its natural size (at most the box's width), never blown up
