"""Graph passes, each a function from a DAG to a DAG (or a grouping) with a log of what it did and why.

dce: drop nodes nothing uses. cse: merge nodes computing the same op on the same inputs. fuse: group
nodes into kernels, vertically (a producer into its consumer) and horizontally (siblings reading the same
input), by op kind, and record for every producer→consumer pair left apart the reason it was not fused.
"""
from __future__ import annotations

import networkx as nx

COMPUTE = ("pointwise", "reduction", "opaque")


def dce(g: nx.DiGraph) -> tuple[nx.DiGraph, list[str]]:
    g, log = g.copy(), []
    changed = True
    while changed:
        changed = False
        for n in list(g.nodes):
            if g.nodes[n]["kind"] not in ("input", "output") and g.out_degree(n) == 0:
                g.remove_node(n)
                log.append(f"dce: removed {n}: nothing uses it")
                changed = True
    return g, log


def cse(g: nx.DiGraph) -> tuple[nx.DiGraph, list[str]]:
    g, log, seen = g.copy(), [], {}
    for n in list(nx.topological_sort(g)):
        if n not in g or g.nodes[n]["kind"] in ("input", "output"):
            continue
        key = (g.nodes[n]["target"], g.nodes[n]["args"])
        if key in seen:
            keep = seen[key]
            for user in list(g.successors(n)):
                g.add_edge(keep, user)
                for attr in ("args",):  # the user now reads `keep` in place of `n`
                    g.nodes[user][attr] = g.nodes[user][attr].replace(f"'{n}'", f"'{keep}'")
            g.remove_node(n)
            log.append(f"cse: {n} computes what {keep} does ({g.nodes[keep]['op']} of the same inputs); reuse {keep}")
        else:
            seen[key] = n
    return g, log


def fuse(g: nx.DiGraph, vertical: bool = True, horizontal: bool = True) -> tuple[dict[str, int], list[dict], list[str]]:
    """Returns the group of every compute node, the pairs left apart with the reason, and the log."""
    group = {n: i for i, n in enumerate(g.nodes) if g.nodes[n]["kind"] in COMPUTE}
    log, rejected = [], []

    def members(gid):
        return [n for n, x in group.items() if x == gid]

    def iteration(n):  # elements the kernel of n loops over: its output, or a reduction's input
        preds = list(g.predecessors(n)) if g.nodes[n]["kind"] == "reduction" else []
        return max([g.nodes[n]["numel"]] + [g.nodes[p]["numel"] for p in preds])

    def creates_cycle(a, b):
        """Merging groups a and b is unsafe if a path leaves the pair and comes back."""
        merged = set(members(a)) | set(members(b))
        for src in merged:
            for succ in g.successors(src):
                if succ in merged:
                    continue
                if any(nx.has_path(g, succ, m) for m in merged):
                    return succ
        return None

    def reduction_feeds(a, b):
        """A reduction in group a whose result a node of group b reads: one pass cannot both finish and reuse it."""
        into = set(members(b))
        return any(g.nodes[r]["kind"] == "reduction" and any(u in into for u in g.successors(r)) for r in members(a))

    def merge(a, b):
        for n, x in group.items():
            if x == b:
                group[n] = a

    if vertical:
        for n in nx.topological_sort(g):
            if n not in group:
                continue
            for p in list(g.predecessors(n)):
                pk, nk = g.nodes[p]["kind"], g.nodes[n]["kind"]
                if p not in group or group[p] == group[n]:
                    continue
                reason = None
                if "opaque" in (pk, nk):
                    reason = f"{g.nodes[p if pk == 'opaque' else n]['op']} is an extern (library) kernel"
                elif pk == "reduction" or reduction_feeds(group[p], group[n]):
                    reason = "consumer reads a reduction's result broadcast over the row: needs the two-pass row template"
                elif iteration(p) != iteration(n):
                    reason = (f"different iteration spaces ({iteration(p)} vs {iteration(n)} elements): a broadcast "
                              "needs the row template")
                elif (via := creates_cycle(group[p], group[n])) is not None:
                    reason = f"fusing would create a cycle through {via}"
                if reason:
                    rejected.append({"producer": p, "consumer": n, "why not": reason})
                else:
                    log.append(f"vertical: {p} ({pk}) into {n} ({nk})")
                    merge(group[n], group[p])
    if horizontal:
        for x in g.nodes:
            users = [u for u in g.successors(x) if u in group and g.nodes[u]["kind"] == "pointwise"]
            for a, b in zip(users, users[1:]):
                if (group[a] != group[b] and iteration(a) == iteration(b) and creates_cycle(group[a], group[b]) is None
                        and not reduction_feeds(group[a], group[b]) and not reduction_feeds(group[b], group[a])):
                    log.append(f"horizontal: {a} and {b} both read {x}: one kernel, one read of {x}")
                    merge(group[a], group[b])
    return group, rejected, log


def kernel_stats(g: nx.DiGraph, group: dict[str, int] | None) -> dict:
    """Kernels launched and global-memory bytes moved if every group is one kernel that reads its external
    inputs once and writes the values used outside it (views move nothing)."""
    if group is None:
        group = {n: i for i, n in enumerate(g.nodes) if g.nodes[n]["kind"] in ("pointwise", "reduction", "opaque")}
    gids = sorted(set(group.values()))
    moved = 0
    for gid in gids:
        mem = {n for n, x in group.items() if x == gid}
        inputs = {p for n in mem for p in g.predecessors(n) if p not in mem}
        outputs = {n for n in mem if any(u not in mem for u in g.successors(n))}
        moved += sum(g.nodes[p]["bytes"] for p in inputs) + sum(g.nodes[n]["bytes"] for n in outputs)
    ideal = sum(d["bytes"] for n, d in g.nodes(data=True) if d["kind"] == "input") + \
        sum(g.nodes[p]["bytes"] for n, d in g.nodes(data=True) if d["kind"] == "output" for p in g.predecessors(n))
    return {"kernels": len(gids), "bytes_moved": moved, "ideal_unique_bytes": ideal}
