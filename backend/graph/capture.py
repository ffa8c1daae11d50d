"""Capture a PyTorch function's forward and backward computation as an aten-level DAG.

make_fx traces the function through the dispatcher. With `backward`, the traced function also asks
torch.autograd.grad for the inputs' gradients given an incoming gradient `tangent` (an input, as in
AOTAutograd's joint graph), so the graph holds the backward ops autograd derives (seed 002: the backward
DAG is derived from the forward one and reads its saved intermediates). LayerNorm, GELU and softmax are
decomposed into pointwise ops and reductions, as compilers do before fusing.

The networkx DAG carries, per node: op, kind (input, pointwise, reduction, view, opaque, output), shape,
stride, bytes, the aten overload `fn` and its `args` (node references as `Ref`), and the phase: forward if
the forward output needs it, else backward. `evaluate` runs the DAG on real tensors.
"""
from __future__ import annotations

import dataclasses
import operator

import networkx as nx
import torch
from torch._decomp import get_decompositions
from torch.fx.experimental.proxy_tensor import make_fx

from backend.graph.triton_ops import POINTWISE as TRITON_POINTWISE

aten = torch.ops.aten
DECOMPOSE = get_decompositions([aten.native_layer_norm, aten.native_layer_norm_backward, aten.gelu, aten.gelu_backward,
                                aten._softmax, aten._softmax_backward_data, aten.sigmoid_backward, aten.tanh_backward,
                                aten.threshold_backward, aten.mean.dim, aten.silu, aten.silu_backward])
VIEWS = {"view", "_unsafe_view", "reshape", "permute", "t", "transpose", "expand", "unsqueeze", "squeeze", "alias", "detach",
         "split", "split_with_sizes", "chunk", "unbind", "narrow", "slice", "select"}  # results alias their input
FILLS = ("ones_like", "zeros_like", "full_like", "scalar_tensor", "clone")  # not tagged pointwise, yet elementwise
REDUCTIONS = {"sum", "amax", "amin", "var_mean"}


def category(kind: str, op: str) -> str:
    """The fusion literature's op kinds: elementwise, broadcast, injective (re-indexing), reduction, opaque."""
    if kind == "view":
        return "broadcast" if op == "expand" else "injective"
    return {"pointwise": "elementwise"}.get(kind, kind)


@dataclasses.dataclass(frozen=True)
class Ref:
    """An argument that is another node's value."""
    name: str

    def __repr__(self) -> str:
        return self.name


def kind_of(fn) -> tuple[str, str]:
    """(kind, why it is opaque, if it is)."""
    if fn is operator.getitem:
        return "view", ""
    name = fn.overloadpacket.__name__
    if name in ("mm", "bmm", "addmm", "matmul"):
        return "opaque", "matmuls stay library calls (cuBLAS / oneDNN), as in TorchInductor"
    if name in VIEWS:
        return "view", ""
    if name in REDUCTIONS:
        return "reduction", ""
    if name in TRITON_POINTWISE and (torch.Tag.pointwise in fn.tags or name in FILLS):
        return "pointwise", ""
    return "opaque", f"{name} has no Triton template here: a library call"


def capture(fn, inputs: list[torch.Tensor], backward: bool, real: bool = False) -> torch.fx.GraphModule:
    """Trace fn (and, with backward, its gradients given a tangent input) to an aten fx graph."""
    mode = "real" if real else "fake"
    if backward:
        def joint(*args):
            *primals, tangent = args
            out = fn(*primals)
            grads = torch.autograd.grad(out, [a for a in primals if a.requires_grad], tangent)
            return (out, *grads)
        with torch.enable_grad():
            primals = [t.detach().requires_grad_(t.is_floating_point()) for t in inputs]
            out_meta = fn(*primals)
        return make_fx(joint, decomposition_table=DECOMPOSE, tracing_mode=mode)(*primals, torch.zeros_like(out_meta.detach()))
    return make_fx(lambda *a: (fn(*a),), decomposition_table=DECOMPOSE, tracing_mode=mode)(*[t.detach() for t in inputs])


def _freeze(a):
    if isinstance(a, torch.fx.Node):
        return Ref(a.name)
    if isinstance(a, (list, tuple)):
        return tuple(_freeze(x) for x in a)
    return a


def to_networkx(gm: torch.fx.GraphModule, backward: bool) -> nx.DiGraph:
    g = nx.DiGraph()
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node in gm.graph.nodes:
        if node.op == "output":
            outs = [a.name for a in node.args[0]]
            g.graph["outputs"] = outs
            continue
        val = node.meta.get("val")
        is_tensor = isinstance(val, torch.Tensor)
        attrs = dict(shape=tuple(val.shape) if is_tensor else (), stride=tuple(val.stride()) if is_tensor else (),
                     dtype=str(val.dtype).replace("torch.", "") if is_tensor else "",
                     numel=int(val.numel()) if is_tensor else 0,
                     bytes=int(val.numel() * val.element_size()) if is_tensor else 0)
        if node.op == "placeholder":
            role = "tangent" if backward and node is placeholders[-1] else "primal"
            g.add_node(node.name, op="input", kind="input", role=role, fn=None, args=(), kwargs=(), target="input", why_opaque="",
                       **attrs)
            continue
        kind, why = kind_of(node.target)
        op = node.target.overloadpacket.__name__ if kind != "view" or node.target is not operator.getitem else "getitem"
        g.add_node(node.name, op=op, kind=kind, fn=node.target, args=_freeze(node.args), target=str(node.target),
                   kwargs=tuple(sorted((k, _freeze(v)) for k, v in node.kwargs.items())), why_opaque=why, **attrs)
        for inp in node.all_input_nodes:
            g.add_edge(inp.name, node.name)
    g.graph["inputs"] = [n.name for n in placeholders]
    for n, d in g.nodes(data=True):
        _check_template_fit(g, n, d)
        d["category"] = category(d["kind"], d["op"])
    mark_phases(g)
    return g


def reduction_axis(g: nx.DiGraph, n: str) -> int | None:
    """The 2D axis (0 rows, 1 columns, right-aligned) a reduction reduces, or None if it is not one axis."""
    d = g.nodes[n]
    src = g.nodes[d["args"][0].name]
    rank = len(src["shape"])
    dims = d["args"][1] if len(d["args"]) > 1 else dict(d["kwargs"]).get("dim")
    if dims is None or rank == 0 or rank > 2:
        return None
    dims = [dims] if isinstance(dims, int) else list(dims)
    if len(dims) != 1:
        return None
    return dims[0] % rank + (2 - rank)


def _check_template_fit(g: nx.DiGraph, n: str, d: dict) -> None:
    """Ops outside the 2D templates (rank 3+, multi-axis reductions) run as library calls."""
    if d["kind"] == "pointwise" and len(d["shape"]) > 2:
        d["kind"], d["why_opaque"] = "opaque", f"rank-{len(d['shape'])} tensor: the 2D templates do not cover it"
    if d["kind"] == "reduction":
        d["axis"] = reduction_axis(g, n)
        if d["axis"] is None:
            d["kind"], d["why_opaque"] = "opaque", "reduces over several or no axes: the templates reduce one axis of a 2D tensor"


def mark_phases(g: nx.DiGraph) -> None:
    """Forward: what the forward output needs; backward: the rest (it runs once the loss gradient arrives)."""
    forward = set(nx.ancestors(g, g.graph["outputs"][0])) | {g.graph["outputs"][0]}
    for n, d in g.nodes(data=True):
        d["phase"] = "forward" if n in forward or (d["kind"] == "input" and d.get("role") == "primal") else "backward"


def refs(args) -> list[str]:
    out = []
    for a in args:
        if isinstance(a, Ref):
            out.append(a.name)
        elif isinstance(a, tuple):
            out += refs(a)
    return out


def _resolve(a, env):
    if isinstance(a, Ref):
        return env[a.name]
    if isinstance(a, tuple):
        return [_resolve(x, env) for x in a]
    return a


def run_node(d: dict, env: dict):
    return d["fn"](*[_resolve(a, env) for a in d["args"]], **{k: _resolve(v, env) for k, v in d["kwargs"]})


def evaluate(g: nx.DiGraph, inputs: list[torch.Tensor], nodes=None) -> dict[str, torch.Tensor]:
    """Run the DAG's ops eagerly on real tensors; returns every node's value."""
    env = dict(zip(g.graph["inputs"], inputs))
    for n in nodes if nodes is not None else nx.topological_sort(g):
        d = g.nodes[n]
        if d["kind"] not in ("input", "output"):
            env[n] = run_node(d, env)
    return env
