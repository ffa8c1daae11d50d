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

import dataclasses

import networkx as nx

from backend.graph import ir
from backend.graph.passes import dce, replace_uses


def _save_cost(g: nx.DiGraph, v: str) -> int:
    node = ir.get(g, v)
    if node.kind == "input":
        return 0
    return node.bytes  # a tuple (var_mean) has 0 bytes: its getitems carry the cost


def _never_recomputed(g: nx.DiGraph, v: str) -> bool:
    node = ir.get(g, v)
    if node.op == "getitem":
        return _never_recomputed(g, node.args[0].name)
    return node.kind in ("input", "opaque", "reduction")


def _read_by_backward(g: nx.DiGraph, v: str) -> bool:
    return any(ir.get(g, u).phase == "backward" for u in g.successors(v))


def saved_values(g: nx.DiGraph) -> list[str]:
    """Forward values some backward node reads: what stays in memory between the two."""
    return sorted(v for v, node in ir.items(g) if node.phase == "forward" and _read_by_backward(g, v))


def min_cut(g: nx.DiGraph) -> tuple[nx.DiGraph, list[str], dict]:
    fwd = [v for v, node in ir.items(g) if node.phase == "forward"]
    net = nx.DiGraph()
    for v in fwd:
        net.add_edge((v, "in"), (v, "out"), capacity=_save_cost(g, v))
        if _never_recomputed(g, v):
            net.add_edge("source", (v, "in"))          # never recomputed
        for u in g.successors(v):
            if ir.get(g, u).phase == "forward":
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
        if _read_by_backward(g, v):
            needed |= {v} | nx.ancestors(g, v)
    recompute = [v for v in nx.topological_sort(g) if v in needed and ir.get(g, v).phase == "forward"
                 and (v, "in") not in source_side]
    g2, log = g.copy(), []
    clone = {}
    for v in recompute:  # in topological order, so a clone reads the clones of what it reads
        node = dataclasses.replace(ir.get(g2, v), phase="backward")
        for u in node.inputs:
            if u in clone:
                node = node.with_input(u, clone[u])
        clone[v] = f"{v}_rc"
        ir.put(g2, clone[v], node)
    for v, name in clone.items():
        users = {u for u in g2.successors(v) if ir.get(g2, u).phase == "backward" and u != name}
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

