"""The zoomable graph view reads back the DOT the backend writes and lays it out so every edge runs down."""
import json

import networkx as nx

from backend.graph.dot import to_dot
from pages import graph_view


def _graph(n=40):
    g = nx.gn_graph(n, seed=3).reverse()  # a random tree, edges from the root outwards: a DAG
    for node in g.nodes:
        g.nodes[node].update(label=f"n{node}\nop \"q\"", fillcolor="#dbe8fb", tooltip=f"{node * 4} B")
    for u, v in list(g.edges)[:5]:
        g.edges[u, v].update(label="send/recv 64 B", style="dashed", color="#d62728")
    return g


def test_the_dot_the_backend_writes_reads_back_whole():
    g = _graph()
    dot = to_dot(g, rankdir="TB")
    dot = dot[:-1] + '  subgraph cluster_7 { label="kernel 7 (pointwise)"; style=dashed; "1"; "2"; }\n}'
    back, cluster_of = graph_view.parse_dot(dot)
    assert set(back.nodes) == {str(n) for n in g.nodes} and set(back.edges) == {(str(u), str(v)) for u, v in g.edges}
    assert back.nodes["3"]["label"] == 'n3\nop "q"' and back.nodes["3"]["tooltip"] == "12 B"
    assert sum(a.get("style") == "dashed" for *_, a in back.edges(data=True)) == 5
    assert cluster_of == {"1": "kernel 7 (pointwise)", "2": "kernel 7 (pointwise)"}


def test_every_edge_runs_down_and_no_two_nodes_share_a_place():
    g, _ = graph_view.parse_dot(to_dot(_graph(60)))
    pos = graph_view.layered_layout(g)
    assert all(pos[u][1] < pos[v][1] for u, v in g.edges)
    assert len(set(pos.values())) == len(pos)


def test_the_zoomable_chart_draws_every_node_and_edge_and_zooms():
    g = _graph(50)
    spec = graph_view.zoomable(to_dot(g)).to_dict()
    rows = {name: len(values) for name, values in spec["datasets"].items()}
    assert sorted(rows.values()) == sorted([g.number_of_nodes(), g.number_of_edges()])
    assert "bind" in json.dumps(spec["layer"][0].get("params", spec.get("params", [])))  # scroll zoom, drag pan
