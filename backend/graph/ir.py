"""The graph compiler's representation: a networkx DiGraph whose nodes each carry one frozen `Node`.

A node is one aten op (or a graph input); its arguments are literals and `Ref`s to other nodes, and the
graph's edges are exactly those references (`put` keeps them so). Nodes are frozen: a pass that changes
one builds a new one (`dataclasses.replace`) and puts it back, so a graph copy never shares a change.
The graph's input and output node names, in order, are `g.graph["inputs"]` and `g.graph["outputs"]`.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Iterator

import networkx as nx
import torch


@dataclasses.dataclass(frozen=True)
class Ref:
    """An argument that is another node's value."""
    name: str

    def __repr__(self) -> str:
        return self.name


@dataclasses.dataclass(frozen=True)
class Node:
    op: str                    # the aten op's name ("add", "sum", "mm"), "getitem", or "input"
    kind: str                  # input, pointwise, reduction, view, opaque (a library call)
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str                 # "float32"; "" for a tuple (var_mean's (var, mean))
    bytes: int                 # 0 for a tuple: its getitems carry the bytes
    phase: str = "forward"     # forward, or backward: it runs once the loss gradient arrives
    args: tuple = ()           # literals and Refs
    kwargs: tuple = ()         # sorted (name, value) pairs
    fn: object = None          # the aten overload that computes it; None for an input
    axis: int | None = None    # a reduction's 2D axis (0 rows, 1 columns, right-aligned)
    role: str = ""             # an input's: primal, or tangent (the incoming gradient)
    why_opaque: str = ""       # why an opaque op is a library call

    @classmethod
    def make(cls, fn=None, *args, shape: tuple[int, ...], kind: str | None = None, dtype: str = "float32",
             **fields) -> Node:
        """A contiguous tensor node with its bytes from shape and dtype, for graphs built by hand: with no fn a
        primal input, else the op fn of args (pointwise unless `kind` says otherwise)."""
        if fn is None:
            return cls("input", "input", tuple(shape), _contiguous(shape), dtype, _nbytes(shape, dtype),
                       **{"role": "primal", **fields})
        kind = kind or "pointwise"
        if kind == "opaque":
            fields.setdefault("why_opaque", "a library call")
        return cls(fn.overloadpacket.__name__, kind, tuple(shape), _contiguous(shape), dtype, _nbytes(shape, dtype),
                   args=args, fn=fn, **fields)

    @property
    def category(self) -> str:
        """The fusion literature's op kinds: elementwise, broadcast, injective (re-indexing), reduction, opaque."""
        if self.kind == "view":
            return "broadcast" if self.op == "expand" else "injective"
        return {"pointwise": "elementwise"}.get(self.kind, self.kind)

    @property
    def numel(self) -> int:
        return math.prod(self.shape) if self.bytes else 0

    @property
    def inputs(self) -> list[str]:
        """The nodes it reads, each once, in argument order."""
        return list(dict.fromkeys(refs(self.args) + refs(tuple(v for _, v in self.kwargs))))

    def with_input(self, old: str, new) -> Node:
        """The same op reading `new` (a node name, or a Python scalar literal) where it read `old`."""
        return dataclasses.replace(self, args=substitute(self.args, old, new),
                                   kwargs=tuple((k, substitute(v, old, new)) for k, v in self.kwargs))

    def run(self, env: dict):
        """Compute it eagerly, its Refs read from env (node name -> value)."""
        return self.fn(*[_resolve(a, env) for a in self.args], **{k: _resolve(v, env) for k, v in self.kwargs})


def _contiguous(shape) -> tuple[int, ...]:
    return tuple(torch.empty(shape, device="meta").stride())


def _nbytes(shape, dtype: str) -> int:
    return math.prod(shape) * getattr(torch, dtype).itemsize


def refs(args) -> list[str]:
    out = []
    for a in args:
        if isinstance(a, Ref):
            out.append(a.name)
        elif isinstance(a, tuple):
            out += refs(a)
    return out


def substitute(args, old: str, new):
    """args with every Ref to `old` replaced by a Ref to `new` (a name) or by `new` itself (a literal)."""
    if isinstance(args, Ref):
        return (Ref(new) if isinstance(new, str) else new) if args.name == old else args
    if isinstance(args, tuple):
        return tuple(substitute(a, old, new) for a in args)
    return args


def _resolve(a, env):
    if isinstance(a, Ref):
        return env[a.name]
    if isinstance(a, tuple):
        return [_resolve(x, env) for x in a]
    return a


def get(g: nx.DiGraph, name: str) -> Node:
    return g.nodes[name]["node"]


def put(g: nx.DiGraph, name: str, node: Node) -> None:
    """Add or replace a node, and make its incoming edges exactly the nodes it reads."""
    g.add_node(name, node=node)
    for p in list(g.predecessors(name)):
        if p not in node.inputs:
            g.remove_edge(p, name)
    for p in node.inputs:
        if p not in g:
            raise KeyError(f"{name} reads {p}, which is not in the graph")
        g.add_edge(p, name)


def items(g: nx.DiGraph) -> Iterator[tuple[str, Node]]:
    """(name, node) for every node."""
    return iter(g.nodes(data="node"))
