"""Capture a PyTorch function's forward (and, with it, backward) computation as an aten-level DAG.

make_fx traces the function through the dispatcher; with `backward`, the traced function also asks
torch.autograd.grad for the inputs' gradients, so the joint graph holds the backward ops autograd derives
(seed 002: the backward DAG is derived from the forward one and reads its saved intermediates).
LayerNorm and GELU are decomposed into pointwise ops and reductions, as compilers do before fusing.
The networkx DAG carries, per node: op, kind (pointwise, reduction, view, opaque), shape, dtype, bytes.
"""
from __future__ import annotations

import networkx as nx
import torch
from torch._decomp import get_decompositions
from torch.fx.experimental.proxy_tensor import make_fx

aten = torch.ops.aten
DECOMPOSE = get_decompositions([aten.native_layer_norm, aten.native_layer_norm_backward, aten.gelu, aten.gelu_backward,
                                aten._softmax, aten._softmax_backward_data])
VIEWS = {"view", "_unsafe_view", "reshape", "permute", "t", "transpose", "expand", "unsqueeze", "squeeze", "slice", "select",
         "alias", "clone", "detach"}
REDUCTIONS = {"sum", "mean", "amax", "amin", "var_mean", "var", "max", "min", "prod", "argmax", "logsumexp"}
FILLS = {"ones_like", "zeros_like", "full_like", "full", "ones", "zeros", "scalar_tensor"}  # elementwise, no inputs read


def kind_of(target) -> str:
    if not isinstance(target, torch._ops.OpOverload):
        return "view"  # getitem of a tuple result: no kernel
    name = target.overloadpacket.__name__
    if name in VIEWS:
        return "view"
    if name in REDUCTIONS:
        return "reduction"
    if name in FILLS:
        return "pointwise"
    if torch.Tag.pointwise in target.tags:
        return "pointwise"
    return "opaque"


def capture(fn, inputs: list[torch.Tensor], backward: bool) -> torch.fx.GraphModule:
    inputs = [t.detach().requires_grad_(t.is_floating_point()) for t in inputs]
    if backward:
        def joint(*args):
            out = fn(*args)
            grads = torch.autograd.grad(out, [a for a in args if a.requires_grad], torch.ones_like(out))
            return (out, *grads)
        return make_fx(joint, decomposition_table=DECOMPOSE, tracing_mode="fake")(*inputs)
    return make_fx(lambda *a: (fn(*a),), decomposition_table=DECOMPOSE, tracing_mode="fake")(*inputs)


def to_networkx(gm: torch.fx.GraphModule) -> nx.DiGraph:
    g = nx.DiGraph()
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        shape = tuple(val.shape) if hasattr(val, "shape") else ()
        nbytes = val.numel() * val.element_size() if hasattr(val, "numel") else 0
        if node.op == "placeholder":
            kind, op = "input", "input"
        elif node.op == "output":
            kind, op = "output", "output"
        else:
            kind, op = kind_of(node.target), (node.target.overloadpacket.__name__ if isinstance(node.target, torch._ops.OpOverload) else "getitem")
        g.add_node(node.name, op=op, kind=kind, shape=shape, bytes=nbytes, numel=int(val.numel()) if hasattr(val, "numel") else 0,
                   target=str(node.target), args=repr([a.name if isinstance(a, torch.fx.Node) else a for a in node.args]))
        for inp in node.all_input_nodes:
            g.add_edge(inp.name, node.name)
    return g
