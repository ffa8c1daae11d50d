"""Graph passes, each a function from a DAG to a DAG (or to a grouping) with a log of what it did and why.

dce: drop nodes nothing uses. cse: merge nodes computing the same op on the same inputs. constant_fold:
drop identity views, fold fills and all-constant ops into their consumers as literals, simplify x*1, x+0,
t(t(x)). fuse: group pointwise ops and reductions into kernels, vertically (a producer into its consumer)
and horizontally (siblings reading the same input), and give, for every candidate pair left apart, the
reason. A group is one kernel over a 2D iteration space (rows × columns): the pointwise template walks its
elements; the reduction template gives each program one row (or one column) to reduce, and, when the
reduced axis fits one block (a "persistent" reduction), lets the rest of the kernel reuse the result.
"""
from __future__ import annotations

import dataclasses

import networkx as nx
import torch

from backend.graph.capture import Ref, refs

GROUPABLE = ("pointwise", "reduction")


def dce(g: nx.DiGraph) -> tuple[nx.DiGraph, list[str]]:
    g, log = g.copy(), []
    outputs = set(g.graph["outputs"])
    changed = True
    while changed:
        changed = False
        for n in list(g.nodes):
            if g.nodes[n]["kind"] != "input" and n not in outputs and g.out_degree(n) == 0:
                g.remove_node(n)
                log.append(f"dce: removed {n}: nothing uses it")
                changed = True
    return g, log


def substitute(args, old: str, new):
    if isinstance(args, Ref):
        return (Ref(new) if isinstance(new, str) else new) if args.name == old else args
    if isinstance(args, tuple):
        return tuple(substitute(a, old, new) for a in args)
    return args


def replace_uses(g: nx.DiGraph, old: str, new, only=None) -> None:
    """Make users of `old` read `new` (a node name, or a Python scalar literal) instead."""
    for user in list(g.successors(old)):
        if only is not None and user not in only:
            continue
        d = g.nodes[user]
        d["args"] = substitute(d["args"], old, new)
        d["kwargs"] = tuple((k, substitute(v, old, new)) for k, v in d["kwargs"])
        g.remove_edge(old, user)
        if isinstance(new, str):
            g.add_edge(new, user)
    if isinstance(new, str) and only is None:
        g.graph["outputs"] = [new if o == old else o for o in g.graph["outputs"]]


def cse(g: nx.DiGraph) -> tuple[nx.DiGraph, list[str]]:
    g, log, seen = g.copy(), [], {}
    for n in list(nx.topological_sort(g)):
        d = g.nodes[n]
        if d["kind"] == "input":
            continue
        key = (d["target"], d["args"], d["kwargs"])
        if key in seen:
            keep = seen[key]
            replace_uses(g, n, keep)
            g.remove_node(n)
            log.append(f"cse: {n} computes what {keep} does ({d['op']} of the same inputs); reuse {keep}")
        else:
            seen[key] = n
    return g, log


FILL_VALUE = {"ones_like": lambda a: 1.0, "zeros_like": lambda a: 0.0, "full_like": lambda a: a[1], "scalar_tensor": lambda a: a[0]}
IDENTITY_VIEWS = ("detach", "alias", "clone")


def _is_transpose(d) -> bool:
    return d["op"] == "t" or (d["op"] == "permute" and tuple(d["args"][1]) == (1, 0)) or \
        (d["op"] == "transpose" and len(d["shape"]) == 2)


def constant_fold(g: nx.DiGraph) -> tuple[nx.DiGraph, list[str]]:
    g, log = g.copy(), []
    for n in list(nx.topological_sort(g)):
        if n not in g:
            continue
        d = g.nodes[n]
        op, args = d["op"], d["args"]
        if d["kind"] == "input":
            continue
        if op in IDENTITY_VIEWS:
            src = args[0].name
            replace_uses(g, n, src)
            g.remove_node(n)
            log.append(f"fold: {n} ({op}) is an identity: users read {src}")
            continue
        if d["kind"] == "view" and _is_transpose(d) and _is_transpose(g.nodes[args[0].name]):
            src = g.nodes[args[0].name]["args"][0].name
            replace_uses(g, n, src)
            log.append(f"fold: {n} transposes a transpose of {src}: users read {src}")
            continue
        if d["kind"] != "pointwise":
            continue
        value = None
        if op in FILL_VALUE:
            value = float(FILL_VALUE[op](args))
        elif not refs(args) and not refs(tuple(v for _, v in d["kwargs"])):
            # every input is a literal: compute it now
            value = float(d["fn"](*[torch.tensor(a) if isinstance(a, (int, float)) else a for a in args]).item())
        if value is not None:
            users = [u for u in g.successors(n) if g.nodes[u]["kind"] == "pointwise" and _same_broadcast(g, n, u)]
            if users:
                replace_uses(g, n, value, only=set(users))
                log.append(f"fold: {n} ({op}) is the constant {value:g}: {', '.join(users)} read it as a literal")
            continue
        # x*1, 1*x, x/1, x+0, 0+x, x-0 -> x, when no broadcast changes the shape
        literal = [a for a in args if not isinstance(a, Ref)]
        tensors = [a for a in args if isinstance(a, Ref)]
        if len(args) == 2 and len(tensors) == 1 and len(literal) == 1 and not d["kwargs"]:
            x, c = tensors[0].name, literal[0]
            neutral = {"mul": 1, "div": 1, "add": 0, "sub": 0}.get(op)
            if neutral is not None and c == neutral and (op in ("mul", "add") or args[0] == tensors[0]) \
                    and g.nodes[x]["shape"] == d["shape"] and g.nodes[x]["dtype"] == d["dtype"]:
                replace_uses(g, n, x)
                g.remove_node(n)
                log.append(f"fold: {n} = {x} {op} {c:g} is {x}")
    g, dead = dce(g)
    return g, log + [e.replace("dce:", "fold:") for e in dead]


def _same_broadcast(g, const: str, user: str) -> bool:
    """A literal can replace a tensor argument only if that argument does not set the user's shape."""
    d = g.nodes[user]
    others = [g.nodes[r]["shape"] for r in refs(d["args"]) if r != const]
    try:
        return tuple(torch.broadcast_shapes(*others)) == tuple(d["shape"]) if others else False
    except RuntimeError:
        return False


def to2d(shape) -> tuple[int, int]:
    shape = tuple(shape)
    return ((1, 1) + shape)[-2:] if len(shape) < 2 else shape[-2:]


@dataclasses.dataclass
class Group:
    members: set
    domain: tuple
    axis: int | None           # reduction axis (0 rows, 1 columns) or None for a pointwise kernel
    phase: str


@dataclasses.dataclass
class FusionPlan:
    group: dict                # node -> group id, for pointwise, reduction and their getitems
    groups: dict               # group id -> Group
    rejected: list             # {"producer","consumer","kind","why not"}
    log: list
    block_limit: int

    def template(self, gid: int) -> str:
        grp = self.groups[gid]
        if grp.axis is None:
            return "pointwise"
        return "persistent reduction" if grp.domain[grp.axis] <= self.block_limit else "looped reduction"


def _node_space(g, n):
    d = g.nodes[n]
    if d["kind"] == "reduction":
        return to2d(g.nodes[d["args"][0].name]["shape"]), d["axis"]
    return to2d(d["shape"]), None


def varies(g, n) -> set[int]:
    """The 2D axes along which node n's value changes inside a kernel."""
    d = g.nodes[n]
    if d["kind"] == "reduction":
        src = to2d(g.nodes[d["args"][0].name]["shape"])
        other = 1 - d["axis"]
        return {other} if src[other] > 1 else set()
    if d["kind"] == "view" and d["op"] == "getitem":
        return varies(g, d["args"][0].name)
    return {ax for ax, size in enumerate(to2d(d["shape"])) if size > 1}


def fuse(g: nx.DiGraph, vertical: bool = True, horizontal: bool = True, block_limit: int = 1024) -> FusionPlan:
    groups: dict[int, Group] = {}
    group: dict[str, int] = {}
    for i, n in enumerate(nx.topological_sort(g)):
        d = g.nodes[n]
        if d["kind"] in GROUPABLE:
            domain, axis = _node_space(g, n)
            groups[i] = Group({n}, domain, axis, d["phase"])
            group[n] = i
    for n in g.nodes:  # a getitem of a tuple (var_mean) lives with its producer
        d = g.nodes[n]
        if d["op"] == "getitem" and d["args"][0].name in group:
            group[n] = group[d["args"][0].name]
            groups[group[n]].members.add(n)
    log, rejected = [], []

    def merged_space(a: Group, b: Group):
        dom = []
        for x, y in zip(a.domain, b.domain):
            if x != y and 1 not in (x, y):
                return None, f"different iteration spaces ({a.domain[0]}×{a.domain[1]} vs {b.domain[0]}×{b.domain[1]})"
            dom.append(max(x, y))
        axes = {x.axis for x in (a, b) if x.axis is not None}
        if len(axes) > 1:
            return None, "reductions along different axes (rows vs columns) need different loop orders"
        axis = axes.pop() if axes else None
        for grp in (a, b):
            for m in grp.members:
                if g.nodes[m]["kind"] == "reduction" and _node_space(g, m)[0][m_axis(m)] != dom[m_axis(m)]:
                    return None, f"{m} reduces fewer elements than the kernel's {dom[m_axis(m)]} along its axis"
        return (tuple(dom), axis), None

    def m_axis(m):
        return g.nodes[m]["axis"]

    def why_not(a: int, b: int, edges: list[tuple[str, str]]) -> str | None:
        A, B = groups[a], groups[b]
        if A.phase != B.phase:
            return "forward and backward run at different times (the backward waits for the loss gradient)"
        space, reason = merged_space(A, B)
        if reason:
            return reason
        (dom, axis) = space
        members = A.members | B.members
        if axis is not None:
            inner = dom[axis]
            for p, c in edges + [(p, c) for p in members for c in g.successors(p) if c in members]:
                if g.nodes[p]["kind"] != "reduction" and not (g.nodes[p]["op"] == "getitem"):
                    continue
                if axis in varies(g, c) and inner > block_limit:
                    return (f"{c} reads the result of reducing {inner} elements, more than one block ({block_limit}): "
                            "the looped reduction cannot broadcast it back without a second pass")
        for p, c in edges:
            pd = g.nodes[p]
            if pd["kind"] == "reduction" or pd["op"] == "getitem":
                src_axis = pd["axis"] if pd["kind"] == "reduction" else g.nodes[pd["args"][0].name]["axis"]
                seen = {ax for ax, size in enumerate(to2d(pd["shape"])) if size > 1}
                if seen != varies(g, p):
                    return f"{p} drops its reduced axis ({src_axis}); {c} would broadcast it along the other axis"
        via = creates_cycle(members)
        if via is not None:
            return (f"{via[0]} uses {via[1]}'s result and feeds the kernel: fusing would put {via[0]}, "
                    "an intermediate user outside the kernel, both before and after it (a cycle)")
        return None

    def creates_cycle(merged: set):
        for src in merged:
            for succ in g.successors(src):
                if succ in merged:
                    continue
                if any(nx.has_path(g, succ, m) for m in merged):
                    return succ, src
        return None

    def merge(a: int, b: int) -> None:
        A, B = groups[a], groups.pop(b)
        (dom, axis), _ = merged_space(A, B)
        A.members |= B.members
        A.domain, A.axis = dom, axis
        for m in B.members:
            group[m] = a

    if vertical:
        for n in nx.topological_sort(g):
            if g.nodes[n]["kind"] == "opaque":
                for p in g.predecessors(n):
                    if p in group:
                        rejected.append({"producer": p, "consumer": n, "kind": "vertical",
                                         "why not": f"{n}: {g.nodes[n]['why_opaque']}"})
            if n not in group or g.nodes[n]["op"] == "getitem":
                continue
            for p in list(g.predecessors(n)):
                pk = g.nodes[p]["kind"]
                if p in group and group[p] == group[n]:
                    continue
                if p not in group:
                    if pk == "opaque":
                        rejected.append({"producer": p, "consumer": n, "kind": "vertical",
                                         "why not": f"{p}: {g.nodes[p]['why_opaque']}"})
                    elif pk == "view" and g.nodes[p]["op"] != "getitem":
                        rejected.append({"producer": p, "consumer": n, "kind": "vertical",
                                         "why not": f"{p} ({g.nodes[p].get('category', 'injective')}: {g.nodes[p]['op']}) "
                                                    "re-indexes its input: kernels read views from memory"})
                    continue
                reason = why_not(group[p], group[n], [(p, n)])
                if reason:
                    rejected.append({"producer": p, "consumer": n, "kind": "vertical", "why not": reason})
                else:
                    log.append(f"vertical: {p} ({pk}) into {n} ({g.nodes[n]['kind']})")
                    merge(group[n], group[p])
    if horizontal:
        for x in nx.topological_sort(g):
            users = [u for u in g.successors(x) if u in group and g.nodes[u]["op"] != "getitem"]
            for a, b in zip(users, users[1:]):
                if group[a] == group[b]:
                    continue
                reason = why_not(group[a], group[b], [])
                if reason:
                    rejected.append({"producer": x, "consumer": f"{a} + {b}", "kind": "horizontal", "why not": reason})
                else:
                    log.append(f"horizontal: {a} and {b} both read {x}: one kernel, one read of {x}")
                    merge(group[a], group[b])
    # a pair can be met twice (an extern consumer seen from both ends): keep its first reason
    seen, unique = set(), []
    for r in rejected:
        key = (r["producer"], r["consumer"])
        if key not in seen:
            seen.add(key)
            unique.append(r)
    return FusionPlan(group, groups, unique, log, block_limit)


def unfused_plan(g: nx.DiGraph) -> FusionPlan:
    """Every op its own kernel: the baseline the fused plan is measured against."""
    return fuse(g, vertical=False, horizontal=False)


def group_io(g: nx.DiGraph, members) -> tuple[list[str], list[str]]:
    """What a group's kernel reads from memory (its external inputs) and writes (values used outside it),
    in topological order; a tuple (var_mean) is never written, its getitems are."""
    inside = set(members)
    order = [n for n in nx.topological_sort(g) if n in inside]
    inputs = list(dict.fromkeys(p for n in order for p in g.predecessors(n) if p not in inside))
    outputs = [n for n in order if g.nodes[n]["op"] != "var_mean"
               and (n in g.graph["outputs"] or any(u not in inside for u in g.successors(n)))]
    return inputs, outputs


def modelled_bytes(g: nx.DiGraph, plan: FusionPlan) -> dict:
    """Bytes if every group reads each external input once and writes each value used outside it once."""
    per_group = {}
    for gid, grp in plan.groups.items():
        inputs, outputs = group_io(g, grp.members)
        per_group[gid] = sum(g.nodes[n]["bytes"] for n in inputs + outputs)
    ideal = sum(g.nodes[n]["bytes"] for n in g.graph["inputs"]) + sum(g.nodes[n]["bytes"] for n in set(g.graph["outputs"]))
    return {"per_group": per_group, "ideal_unique_bytes": ideal}
