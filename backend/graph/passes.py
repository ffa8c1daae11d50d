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

from backend.graph import ir
from backend.graph.ir import Ref

GROUPABLE = ("pointwise", "reduction")


def dce(g: nx.DiGraph) -> tuple[nx.DiGraph, list[str]]:
    g, log = g.copy(), []
    outputs = set(g.graph["outputs"])
    changed = True
    while changed:
        changed = False
        for n in list(g.nodes):
            if ir.get(g, n).kind != "input" and n not in outputs and g.out_degree(n) == 0:
                g.remove_node(n)
                log.append(f"dce: removed {n}: nothing uses it")
                changed = True
    return g, log


def replace_uses(g: nx.DiGraph, old: str, new, only=None) -> None:
    """Make users of `old` read `new` (a node name, or a Python scalar literal) instead."""
    for user in list(g.successors(old)):
        if only is None or user in only:
            ir.put(g, user, ir.get(g, user).with_input(old, new))
    if isinstance(new, str) and only is None:
        g.graph["outputs"] = [new if o == old else o for o in g.graph["outputs"]]


def cse(g: nx.DiGraph) -> tuple[nx.DiGraph, list[str]]:
    g, log, seen = g.copy(), [], {}
    for n in list(nx.topological_sort(g)):
        node = ir.get(g, n)
        if node.kind == "input":
            continue
        key = (node.fn, node.args, node.kwargs)
        if key in seen:
            keep = seen[key]
            replace_uses(g, n, keep)
            g.remove_node(n)
            log.append(f"cse: {n} computes what {keep} does ({node.op} of the same inputs); reuse {keep}")
        else:
            seen[key] = n
    return g, log


FILL_VALUE = {"ones_like": lambda a: 1.0, "zeros_like": lambda a: 0.0, "full_like": lambda a: a[1], "scalar_tensor": lambda a: a[0]}
IDENTITY_VIEWS = ("detach", "alias", "clone")
NEUTRAL = {"mul": 1, "div": 1, "add": 0, "sub": 0}  # x op c is x (div and sub only with x on the left)


def _is_transpose(node: ir.Node) -> bool:
    return node.op == "t" or (node.op == "permute" and tuple(node.args[1]) == (1, 0)) or \
        (node.op == "transpose" and len(node.shape) == 2)


def constant_fold(g: nx.DiGraph) -> tuple[nx.DiGraph, list[str]]:
    g, log = g.copy(), []
    for n in list(nx.topological_sort(g)):
        if n not in g or ir.get(g, n).kind == "input":
            continue
        entry = _fold_identity(g, n) or _fold_double_transpose(g, n) or _fold_constant(g, n) or _fold_neutral(g, n)
        if entry:
            log.append(entry)
    g, dead = dce(g)
    return g, log + [e.replace("dce:", "fold:") for e in dead]


def _fold_identity(g: nx.DiGraph, n: str) -> str | None:
    node = ir.get(g, n)
    if node.op not in IDENTITY_VIEWS:
        return None
    src = node.args[0].name
    replace_uses(g, n, src)
    g.remove_node(n)
    return f"fold: {n} ({node.op}) is an identity: users read {src}"


def _fold_double_transpose(g: nx.DiGraph, n: str) -> str | None:
    node = ir.get(g, n)
    if not (node.kind == "view" and _is_transpose(node) and _is_transpose(ir.get(g, node.args[0].name))):
        return None
    src = ir.get(g, node.args[0].name).args[0].name
    replace_uses(g, n, src)
    return f"fold: {n} transposes a transpose of {src}: users read {src}"


def _fold_constant(g: nx.DiGraph, n: str) -> str | None:
    """A fill, or a pointwise op of literals only, becomes a literal in the pointwise users it does not shape."""
    node = ir.get(g, n)
    if node.kind != "pointwise":
        return None
    if node.op in FILL_VALUE:
        value = float(FILL_VALUE[node.op](node.args))
    elif not node.inputs:  # every input is a literal: compute it now
        value = float(node.fn(*[torch.tensor(a) if isinstance(a, (int, float)) else a for a in node.args]).item())
    else:
        return None
    users = [u for u in g.successors(n) if ir.get(g, u).kind == "pointwise" and _same_broadcast(g, n, u)]
    if not users:
        return None
    replace_uses(g, n, value, only=set(users))
    return f"fold: {n} ({node.op}) is the constant {value:g}: {', '.join(users)} read it as a literal"


def _fold_neutral(g: nx.DiGraph, n: str) -> str | None:
    """x*1, 1*x, x/1, x+0, 0+x, x-0 -> x, when no broadcast changes the shape."""
    node = ir.get(g, n)
    if node.kind != "pointwise":
        return None
    literal = [a for a in node.args if not isinstance(a, Ref)]
    tensors = [a for a in node.args if isinstance(a, Ref)]
    if not (len(node.args) == 2 and len(tensors) == 1 and len(literal) == 1 and not node.kwargs):
        return None
    x, c = tensors[0].name, literal[0]
    neutral = NEUTRAL.get(node.op)
    if neutral is None or c != neutral or not (node.op in ("mul", "add") or node.args[0] == tensors[0]) \
            or ir.get(g, x).shape != node.shape or ir.get(g, x).dtype != node.dtype:
        return None
    replace_uses(g, n, x)
    g.remove_node(n)
    return f"fold: {n} = {x} {node.op} {c:g} is {x}"


def _same_broadcast(g, const: str, user: str) -> bool:
    """A literal can replace a tensor argument only if that argument does not set the user's shape."""
    node = ir.get(g, user)
    others = [ir.get(g, r).shape for r in ir.refs(node.args) if r != const]
    try:
        return tuple(torch.broadcast_shapes(*others)) == tuple(node.shape) if others else False
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


def _node_space(g, n) -> tuple[tuple[int, int], int | None]:
    """The 2D iteration space of n's own kernel, and the axis it reduces (None for pointwise)."""
    node = ir.get(g, n)
    if node.kind == "reduction":
        return to2d(ir.get(g, node.args[0].name).shape), node.axis
    return to2d(node.shape), None


def _reduced_by(g, n) -> bool:
    """n is a reduction's result, or one of a tuple reduction's (var_mean's) getitems."""
    node = ir.get(g, n)
    return node.kind == "reduction" or node.op == "getitem"


def varies(g, n) -> set[int]:
    """The 2D axes along which node n's value changes inside a kernel."""
    node = ir.get(g, n)
    if node.kind == "reduction":
        src = to2d(ir.get(g, node.args[0].name).shape)
        other = 1 - node.axis
        return {other} if src[other] > 1 else set()
    if node.kind == "view" and node.op == "getitem":
        return varies(g, node.args[0].name)
    return {ax for ax, size in enumerate(to2d(node.shape)) if size > 1}


def fuse(g: nx.DiGraph, vertical: bool = True, horizontal: bool = True, block_limit: int = 1024) -> FusionPlan:
    plan = _one_group_per_op(g, block_limit)
    if vertical:
        _fuse_vertically(g, plan)
    if horizontal:
        _fuse_horizontally(g, plan)
    plan.rejected = _first_reason_per_pair(plan.rejected)
    return plan


def _one_group_per_op(g: nx.DiGraph, block_limit: int) -> FusionPlan:
    """Every pointwise op and reduction its own group; a getitem of a tuple (var_mean) lives with its producer."""
    plan = FusionPlan({}, {}, [], [], block_limit)
    for i, n in enumerate(nx.topological_sort(g)):
        node = ir.get(g, n)
        if node.kind in GROUPABLE:
            plan.groups[i] = Group({n}, *_node_space(g, n), node.phase)
            plan.group[n] = i
    for n, node in ir.items(g):
        if node.op == "getitem" and node.args[0].name in plan.group:
            plan.group[n] = plan.group[node.args[0].name]
            plan.groups[plan.group[n]].members.add(n)
    return plan


def _fuse_vertically(g: nx.DiGraph, plan: FusionPlan) -> None:
    """Each op into its consumer's kernel, in topological order, unless a reason keeps them apart."""
    for n in nx.topological_sort(g):
        node = ir.get(g, n)
        if node.kind == "opaque":
            for p in g.predecessors(n):
                if p in plan.group:
                    _reject(plan, p, n, "vertical", f"{n}: {node.why_opaque}")
        if n not in plan.group or node.op == "getitem":
            continue
        for p in list(g.predecessors(n)):
            if p not in plan.group:
                _reject_unfusable_producer(g, plan, p, n)
            elif plan.group[p] != plan.group[n]:
                reason = why_not(g, plan, plan.group[p], plan.group[n], [(p, n)])
                if reason:
                    _reject(plan, p, n, "vertical", reason)
                else:
                    plan.log.append(f"vertical: {p} ({ir.get(g, p).kind}) into {n} ({node.kind})")
                    _merge(g, plan, plan.group[n], plan.group[p])


def _reject_unfusable_producer(g: nx.DiGraph, plan: FusionPlan, p: str, n: str) -> None:
    producer = ir.get(g, p)
    if producer.kind == "opaque":
        _reject(plan, p, n, "vertical", f"{p}: {producer.why_opaque}")
    elif producer.kind == "view" and producer.op != "getitem":
        _reject(plan, p, n, "vertical", f"{p} ({producer.category}: {producer.op}) re-indexes its input: "
                                        "kernels read views from memory")


def _fuse_horizontally(g: nx.DiGraph, plan: FusionPlan) -> None:
    """Siblings reading the same value into one kernel, which then reads it once."""
    for x in nx.topological_sort(g):
        users = [u for u in g.successors(x) if u in plan.group and ir.get(g, u).op != "getitem"]
        for a, b in zip(users, users[1:]):
            if plan.group[a] == plan.group[b]:
                continue
            reason = why_not(g, plan, plan.group[a], plan.group[b], [])
            if reason:
                _reject(plan, x, f"{a} + {b}", "horizontal", reason)
            else:
                plan.log.append(f"horizontal: {a} and {b} both read {x}: one kernel, one read of {x}")
                _merge(g, plan, plan.group[a], plan.group[b])


def _reject(plan: FusionPlan, producer: str, consumer: str, kind: str, why: str) -> None:
    plan.rejected.append({"producer": producer, "consumer": consumer, "kind": kind, "why not": why})


def _first_reason_per_pair(rejected: list[dict]) -> list[dict]:
    """A pair can be met twice (an extern consumer seen from both ends): keep its first reason."""
    seen, unique = set(), []
    for r in rejected:
        key = (r["producer"], r["consumer"])
        if key not in seen:
            seen.add(key)
            unique.append(r)
    return unique


def merged_space(g: nx.DiGraph, a: Group, b: Group):
    """((domain, axis), None) of one kernel running both groups, or (None, why it cannot)."""
    dom = []
    for x, y in zip(a.domain, b.domain):
        if x != y and 1 not in (x, y):
            return None, f"different iteration spaces ({a.domain[0]}×{a.domain[1]} vs {b.domain[0]}×{b.domain[1]})"
        dom.append(max(x, y))
    axes = {x.axis for x in (a, b) if x.axis is not None}
    if len(axes) > 1:
        return None, "reductions along different axes (rows vs columns) need different loop orders"
    axis = axes.pop() if axes else None
    for m in sorted(a.members | b.members):  # sorted, here and below: the same reason every run
        node = ir.get(g, m)
        if node.kind == "reduction" and _node_space(g, m)[0][node.axis] != dom[node.axis]:
            return None, f"{m} reduces fewer elements than the kernel's {dom[node.axis]} along its axis"
    return (tuple(dom), axis), None


def why_not(g: nx.DiGraph, plan: FusionPlan, a: int, b: int, edges: list[tuple[str, str]]) -> str | None:
    """Why groups a and b (joined by the producer -> consumer `edges`) cannot be one kernel, or None."""
    A, B = plan.groups[a], plan.groups[b]
    if A.phase != B.phase:
        return "forward and backward run at different times (the backward waits for the loss gradient)"
    space, reason = merged_space(g, A, B)
    if reason:
        return reason
    dom, axis = space
    members = A.members | B.members
    if axis is not None and dom[axis] > plan.block_limit:
        for p, c in edges + [(p, c) for p in sorted(members) for c in g.successors(p) if c in members]:
            if _reduced_by(g, p) and axis in varies(g, c):
                return (f"{c} reads the result of reducing {dom[axis]} elements, more than one block ({plan.block_limit}): "
                        "the looped reduction cannot broadcast it back without a second pass")
    for p, c in edges:
        if _reduced_by(g, p):
            producer = ir.get(g, p)
            src_axis = producer.axis if producer.kind == "reduction" else ir.get(g, producer.args[0].name).axis
            seen = {ax for ax, size in enumerate(to2d(producer.shape)) if size > 1}
            if seen != varies(g, p):
                return f"{p} drops its reduced axis ({src_axis}); {c} would broadcast it along the other axis"
    via = _outside_user_between(g, members)
    if via is not None:
        return (f"{via[0]} uses {via[1]}'s result and feeds the kernel: fusing would put {via[0]}, "
                "an intermediate user outside the kernel, both before and after it (a cycle)")
    return None


def _outside_user_between(g: nx.DiGraph, merged: set):
    """(user, member): a user outside the merged kernel that reads a member and feeds another, or None."""
    for src in sorted(merged):
        for succ in g.successors(src):
            if succ not in merged and any(nx.has_path(g, succ, m) for m in merged):
                return succ, src
    return None


def _merge(g: nx.DiGraph, plan: FusionPlan, a: int, b: int) -> None:
    """Group b joins group a."""
    A, B = plan.groups[a], plan.groups.pop(b)
    (A.domain, A.axis), _ = merged_space(g, A, B)
    A.members |= B.members
    for m in B.members:
        plan.group[m] = a


def unfused_plan(g: nx.DiGraph) -> FusionPlan:
    """Every op its own kernel: the baseline the fused plan is measured against."""
    return fuse(g, vertical=False, horizontal=False)


def group_io(g: nx.DiGraph, members) -> tuple[list[str], list[str]]:
    """What a group's kernel reads from memory (its external inputs) and writes (values used outside it),
    in topological order; a tuple (var_mean) is never written, its getitems are."""
    inside = set(members)
    order = [n for n in nx.topological_sort(g) if n in inside]
    inputs = list(dict.fromkeys(p for n in order for p in g.predecessors(n) if p not in inside))
    outputs = [n for n in order if ir.get(g, n).op != "var_mean"
               and (n in g.graph["outputs"] or any(u not in inside for u in g.successors(n)))]
    return inputs, outputs


def modelled_bytes(g: nx.DiGraph, plan: FusionPlan) -> dict:
    """Bytes if every group reads each external input once and writes each value used outside it once."""
    per_group = {}
    for gid, grp in plan.groups.items():
        inputs, outputs = group_io(g, grp.members)
        per_group[gid] = sum(ir.get(g, n).bytes for n in inputs + outputs)
    ideal = sum(ir.get(g, n).bytes for n in g.graph["inputs"]) + sum(ir.get(g, n).bytes for n in set(g.graph["outputs"]))
    return {"per_group": per_group, "ideal_unique_bytes": ideal}
