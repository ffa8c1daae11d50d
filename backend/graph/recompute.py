"""Save or recompute: which forward values the backward reads from memory and which it recomputes, chosen by
a minimum cut, as AOTAutograd's min-cut partitioner does.

Flow network: every forward node v is an edge v_in -> v_out whose capacity is the bytes it would cost to
save v. Data edges u_out -> v_in, the source's edges into the inputs, and edges into the sink from every
forward value the backward reads are uncuttable. A cut separates what the forward computes from what the
backward recomputes, and its capacity is the bytes saved between them. Matmuls and other library calls,
and reductions, are never recomputed (the source feeds them directly), so the cut falls after them; the
graph's inputs cost nothing to save (they stay alive through the step: weights, the layer's input).
The rewritten graph clones the recomputed nodes into the backward.
"""
from __future__ import annotations

import networkx as nx

from backend.graph.passes import dce, replace_uses, substitute


def _save_cost(g: nx.DiGraph, v: str) -> int:
    d = g.nodes[v]
    if d["kind"] == "input":
        return 0
    return d["bytes"]  # a tuple (var_mean) has 0 bytes: its getitems carry the cost


def _never_recomputed(g: nx.DiGraph, v: str) -> bool:
    d = g.nodes[v]
    if d["op"] == "getitem":
        return _never_recomputed(g, d["args"][0].name)
    return d["kind"] in ("input", "opaque", "reduction")


def saved_values(g: nx.DiGraph) -> list[str]:
    """Forward values some backward node reads: what stays in memory between the two."""
    return sorted(v for v, d in g.nodes(data=True) if d["phase"] == "forward"
                  and any(g.nodes[u]["phase"] == "backward" for u in g.successors(v)))


def min_cut(g: nx.DiGraph) -> tuple[nx.DiGraph, list[str], dict]:
    fwd = [v for v, d in g.nodes(data=True) if d["phase"] == "forward"]
    net = nx.DiGraph()
    for v in fwd:
        d = g.nodes[v]
        net.add_edge((v, "in"), (v, "out"), capacity=_save_cost(g, v))
        if _never_recomputed(g, v):
            net.add_edge("source", (v, "in"))          # never recomputed
        for u in g.successors(v):
            if g.nodes[u]["phase"] == "forward":
                net.add_edge((v, "out"), (u, "in"))
            else:
                net.add_edge((v, "out"), "sink")
    before = saved_values(g)
    info = {"saved_before": before, "saved_bytes_before": sum(_save_cost(g, v) for v in before)}
    if "sink" not in net:
        return g.copy(), ["recompute: the backward reads no forward value"], {**info, "saved_after": before,
                                                                              "saved_bytes_after": info["saved_bytes_before"]}
    cut_bytes, (source_side, _) = nx.minimum_cut(net, "source", "sink")
    needed = set()
    for v in fwd:
        if any(g.nodes[u]["phase"] == "backward" for u in g.successors(v)):
            needed |= {v} | nx.ancestors(g, v)
    recompute = [v for v in nx.topological_sort(g) if v in needed and g.nodes[v]["phase"] == "forward"
                 and (v, "in") not in source_side]
    g2, log = g.copy(), []
    clone = {}
    for v in recompute:
        d = dict(g2.nodes[v])
        name = f"{v}_rc"
        args = d["args"]
        for u in list(g2.predecessors(v)):
            if u in clone:
                args = substitute(args, u, clone[u])
        d.update(args=args, phase="backward")
        g2.add_node(name, **d)
        for u in g2.predecessors(v):
            g2.add_edge(clone.get(u, u), name)
        clone[v] = name
    for v, name in clone.items():
        users = {u for u in g2.successors(v) if g2.nodes[u]["phase"] == "backward" and u != name}
        replace_uses(g2, v, name, only=users)
    g2, _ = dce(g2)
    after = saved_values(g2)
    if recompute:
        log.append(f"recompute: the backward recomputes {', '.join(recompute)} from "
                   f"{', '.join(after)}: {info['saved_bytes_before']:,} B saved between forward and backward → "
                   f"{sum(_save_cost(g2, v) for v in after):,} B (cut capacity {cut_bytes:,} B)")
    else:
        log.append(f"recompute: saving {', '.join(after)} is already the cheapest cut ({cut_bytes:,} B)")
    return g2, log, {**info, "saved_after": after, "saved_bytes_after": sum(_save_cost(g2, v) for v in after),
                     "recomputed": recompute}

