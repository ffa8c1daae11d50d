"""Capture a PyTorch function's forward and backward computation as an aten-level DAG.

make_fx traces the function through the dispatcher. With `backward`, the traced function also asks
torch.autograd.grad for the inputs' gradients given an incoming gradient `tangent` (an input, as in
AOTAutograd's joint graph), so the graph holds the backward ops autograd derives (seed 002: the backward
DAG is derived from the forward one and reads its saved intermediates). LayerNorm, GELU and softmax are
decomposed into pointwise ops and reductions, as compilers do before fusing.

Each node of the networkx DAG is an `ir.Node`: op, kind (input, pointwise, reduction, view, opaque), shape,
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

from backend.graph import ir
from backend.graph.ir import Node, Ref
from backend.graph.triton_ops import POINTWISE as TRITON_POINTWISE

aten = torch.ops.aten
DECOMPOSE = get_decompositions([aten.native_layer_norm, aten.native_layer_norm_backward, aten.gelu, aten.gelu_backward,
                                aten._softmax, aten._softmax_backward_data, aten.sigmoid_backward, aten.tanh_backward,
                                aten.threshold_backward, aten.mean.dim, aten.silu, aten.silu_backward])
VIEWS = {"view", "_unsafe_view", "reshape", "permute", "t", "transpose", "expand", "unsqueeze", "squeeze", "alias", "detach",
         "split", "split_with_sizes", "chunk", "unbind", "narrow", "slice", "select"}  # results alias their input
FILLS = ("ones_like", "zeros_like", "full_like", "scalar_tensor", "clone")  # not tagged pointwise, yet elementwise
REDUCTIONS = {"sum", "amax", "amin", "var_mean"}


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


def _tensor_fields(val) -> dict:
    """Shape, stride, dtype and bytes of an fx node's value; a tuple (var_mean's) has none of them."""
    if not isinstance(val, torch.Tensor):
        return dict(shape=(), stride=(), dtype="", bytes=0)
    return dict(shape=tuple(val.shape), stride=tuple(val.stride()), dtype=str(val.dtype).removeprefix("torch."),
                bytes=int(val.numel() * val.element_size()))


def to_networkx(gm: torch.fx.GraphModule, backward: bool) -> nx.DiGraph:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    g = nx.DiGraph(inputs=[n.name for n in placeholders], outputs=[a.name for a in gm.graph.output_node().args[0]])
    for node in gm.graph.nodes:
        tensor = _tensor_fields(node.meta.get("val"))
        if node.op == "placeholder":
            role = "tangent" if backward and node is placeholders[-1] else "primal"
            ir.put(g, node.name, Node("input", "input", role=role, **tensor))
        elif node.op != "output":
            ir.put(g, node.name, _op_node(g, node, tensor))
    mark_phases(g)
    return g


def _op_node(g: nx.DiGraph, node: torch.fx.Node, tensor: dict) -> Node:
    """An aten op; ops outside the 2D templates (rank 3+, multi-axis reductions) run as library calls."""
    kind, why = kind_of(node.target)
    op = "getitem" if node.target is operator.getitem else node.target.overloadpacket.__name__
    args, kwargs = _freeze(node.args), tuple(sorted((k, _freeze(v)) for k, v in node.kwargs.items()))
    axis = None
    if kind == "pointwise" and len(tensor["shape"]) > 2:
        kind, why = "opaque", f"rank-{len(tensor['shape'])} tensor: the 2D templates do not cover it"
    if kind == "reduction":
        axis = reduction_axis(len(ir.get(g, args[0].name).shape), args, kwargs)
        if axis is None:
            kind, why = "opaque", "reduces over several or no axes: the templates reduce one axis of a 2D tensor"
    return Node(op, kind, args=args, kwargs=kwargs, fn=node.target, axis=axis, why_opaque=why, **tensor)


def reduction_axis(rank: int, args: tuple, kwargs: tuple) -> int | None:
    """The 2D axis (0 rows, 1 columns, right-aligned) a reduction of a rank-`rank` tensor reduces, or None if
    it is not one axis."""
    dims = args[1] if len(args) > 1 else dict(kwargs).get("dim")
    if dims is None or rank == 0 or rank > 2:
        return None
    dims = [dims] if isinstance(dims, int) else list(dims)
    if len(dims) != 1:
        return None
    return dims[0] % rank + (2 - rank)


def mark_phases(g: nx.DiGraph) -> None:
    """Forward: what the forward output needs; backward: the rest (it runs once the loss gradient arrives)."""
    forward = set(nx.ancestors(g, g.graph["outputs"][0])) | {g.graph["outputs"][0]}
    for n, node in list(ir.items(g)):
        phase = "forward" if n in forward or node.role == "primal" else "backward"
        ir.put(g, n, dataclasses.replace(node, phase=phase))


def evaluate(g: nx.DiGraph, inputs: list[torch.Tensor], nodes=None) -> dict[str, torch.Tensor]:
    """Run the DAG's ops eagerly on real tensors; returns every node's value."""
    env = dict(zip(g.graph["inputs"], inputs))
    for n in nodes if nodes is not None else nx.topological_sort(g):
        node = ir.get(g, n)
        if node.kind != "input":
            env[n] = node.run(env)
    return env
