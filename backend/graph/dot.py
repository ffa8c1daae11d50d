"""networkx DiGraph -> Graphviz DOT text (for st.graphviz_chart), without pydot or pygraphviz.

Node attributes `label`, `shape`, `fillcolor`, `tooltip` and edge attribute `label` are passed through.
"""
from __future__ import annotations

import networkx as nx


def _quote(value) -> str:
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def to_dot(graph: nx.DiGraph, rankdir: str = "LR") -> str:
    lines = [f"digraph G {{", f"  rankdir={rankdir};", '  node [fontname="Helvetica", fontsize=10, style="rounded,filled", '
             'fillcolor="#f4f6fa", shape=box];', '  edge [fontname="Helvetica", fontsize=9];']
    for node, attrs in graph.nodes(data=True):
        a = " ".join(f"{k}={_quote(v)}" for k, v in attrs.items() if k in ("label", "shape", "fillcolor", "tooltip", "color", "style"))
        lines.append(f"  {_quote(node)} [{a}];")
    for u, v, attrs in graph.edges(data=True):
        a = " ".join(f"{k}={_quote(val)}" for k, val in attrs.items() if k in ("label", "style", "color"))
        lines.append(f"  {_quote(u)} -> {_quote(v)} [{a}];")
    lines.append("}")
    return "\n".join(lines)
