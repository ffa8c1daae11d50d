"""A small reverse-mode autograd on tensors (micrograd's idea, with torch tensors as values), and the three ways
seed 002 lists to differentiate: symbolic (sympy, on a scalar expression), numeric (central differences) and
automatic (this module's backward pass), each compared with torch.autograd.

`Node`s record their inputs and a local backward rule; `backward()` walks the DAG in reverse topological
order, accumulating gradients. The forward and backward DAGs are exported to networkx for drawing: the
backward DAG mirrors the forward one and needs every saved intermediate, which is why training holds
activations (seed 002).
"""
from __future__ import annotations

import itertools

import networkx as nx
import torch

_ids = itertools.count()


class Node:
    def __init__(self, value: torch.Tensor, inputs=(), op: str = "input", backward=None, saved=()):
        self.value, self.inputs, self.op = value, tuple(inputs), op
        self._backward, self.saved = backward, saved
        self.grad: torch.Tensor | None = None
        self.id = next(_ids)

    # --- ops: each returns a Node whose backward maps the output gradient to input gradients ---------------
    def __add__(self, other):
        other = _lift(other)
        return Node(self.value + other.value, (self, other), "add",
                    lambda g: (_unbroadcast(g, self.value), _unbroadcast(g, other.value)))

    def __mul__(self, other):
        other = _lift(other)
        return Node(self.value * other.value, (self, other), "mul",
                    lambda g: (_unbroadcast(g * other.value, self.value), _unbroadcast(g * self.value, other.value)),
                    saved=(self, other))

    def __sub__(self, other):
        return self + _lift(other) * -1.0

    def __matmul__(self, other):
        return Node(self.value @ other.value, (self, other), "matmul",
                    lambda g: (g @ other.value.T, self.value.T @ g), saved=(self, other))

    def tanh(self):
        out = torch.tanh(self.value)
        return Node(out, (self,), "tanh", lambda g: (g * (1 - out ** 2),), saved=("output",))

    def exp(self):
        out = torch.exp(self.value)
        return Node(out, (self,), "exp", lambda g: (g * out,), saved=("output",))

    def log(self):
        return Node(torch.log(self.value), (self,), "log", lambda g: (g / self.value,), saved=(self,))

    def pow(self, k: float):
        return Node(self.value ** k, (self,), f"pow {k:g}", lambda g: (g * k * self.value ** (k - 1),), saved=(self,))

    def sum(self, dim=None, keepdim=False):
        out = self.value.sum() if dim is None else self.value.sum(dim, keepdim=keepdim)

        def back(g):
            if dim is not None and not keepdim:
                g = g.unsqueeze(dim)
            return (g.expand_as(self.value),)
        return Node(out, (self,), "sum", back)

    def mean(self, dim=None, keepdim=False):
        n = self.value.numel() if dim is None else self.value.shape[dim]
        return self.sum(dim, keepdim) * (1.0 / n)

    def max_detached(self, dim, keepdim=True):
        """The row max as a constant (softmax's shift: it cancels, so no gradient flows through it)."""
        return Node(self.value.amax(dim, keepdim=keepdim), (), "amax (no grad)")

    # --- backward ---------------------------------------------------------------------------------------
    def backward(self):
        order = topological_order(self)
        self.grad = torch.ones_like(self.value)
        for n in reversed(order):
            if n._backward is None or n.grad is None:
                continue
            for inp, g in zip(n.inputs, n._backward(n.grad)):
                inp.grad = g if inp.grad is None else inp.grad + g
        return order


def topological_order(output: Node) -> list[Node]:
    """Every node `output` depends on, inputs before the nodes that use them."""
    order, seen = [], set()

    def visit(n):
        if n.id in seen:
            return
        seen.add(n.id)
        for i in n.inputs:
            visit(i)
        order.append(n)
    visit(output)
    return order


def _lift(x) -> Node:
    return x if isinstance(x, Node) else Node(torch.as_tensor(x, dtype=torch.float64), (), "const")


def _unbroadcast(g: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Sum a gradient back to the shape of a broadcast input."""
    while g.dim() > like.dim():
        g = g.sum(0)
    for d, size in enumerate(like.shape):
        if size == 1 and g.shape[d] != 1:
            g = g.sum(d, keepdim=True)
    return g


def graphs(output: Node, names: dict[int, str]) -> tuple[nx.DiGraph, nx.DiGraph]:
    """Forward DAG (inputs -> output) and the backward DAG autograd derives from it (grad of output -> grads of inputs)."""
    fwd, bwd = nx.DiGraph(), nx.DiGraph()
    for n in topological_order(output):
        label = names.get(n.id, n.op)
        shape = "×".join(map(str, n.value.shape)) or "scalar"
        fwd.add_node(n.id, label=f"{label}\n[{shape}]", shape="ellipse" if n.inputs else "box",
                     fillcolor="#dbe8fb" if not n.inputs else "#f4f6fa")
        for i in n.inputs:
            fwd.add_edge(i.id, n.id)
        if n._backward is not None:
            bwd.add_node(f"g{n.id}", label=f"∂L/∂({label})\n[{shape}]", fillcolor="#fde3d9")
            for i in n.inputs:
                if i.inputs or names.get(i.id):
                    bwd.add_node(f"g{i.id}", label=f"∂L/∂({names.get(i.id, i.op)})", fillcolor="#fde3d9")
                    saved = ", ".join("output" if s == "output" else names.get(s.id, s.op) for s in n.saved)
                    bwd.add_edge(f"g{n.id}", f"g{i.id}", label=f"{n.op}'" + (f" uses {saved}" if saved else ""))
    return fwd, bwd


# --- the workloads ----------------------------------------------------------------------------------------
def build(expression: str, tensors: dict[str, torch.Tensor]):
    """Return (loss Node, leaf Nodes by name, a torch function of the same maths)."""
    leaves = {k: Node(v.clone()) for k, v in tensors.items()}
    x, w1, w2 = leaves["x"], leaves["w1"], leaves["w2"]
    if expression == "mlp":
        loss = ((x @ w1).tanh() @ w2).pow(2).mean()

        def torch_fn(x, w1, w2):
            return (torch.tanh(x @ w1) @ w2).pow(2).mean()
    elif expression == "softmax":
        s = x @ w1
        e = (s - s.max_detached(1)).exp()
        p = e * e.sum(1, keepdim=True).pow(-1.0)
        loss = (p @ w2.pow(2)).log().mean()

        def torch_fn(x, w1, w2):
            return torch.log(torch.softmax(x @ w1, dim=1) @ w2.pow(2)).mean()
    elif expression == "layernorm":
        h = x @ w1
        mu = h.mean(1, keepdim=True)
        c = h - mu
        var = c.pow(2).mean(1, keepdim=True)
        y = c * (var + 1e-5).pow(-0.5)
        loss = (y @ w2).tanh().sum()

        def torch_fn(x, w1, w2):
            return torch.tanh(torch.nn.functional.layer_norm(x @ w1, (w1.shape[1],), eps=1e-5) @ w2).sum()
    else:
        raise ValueError(expression)
    return loss, leaves, torch_fn


def numeric_grad(fn, tensors: dict[str, torch.Tensor], name: str, eps: float = 1e-6) -> torch.Tensor:
    """Central differences, one element at a time (float64)."""
    base = {k: v.clone() for k, v in tensors.items()}
    grad = torch.zeros_like(base[name])
    flat = base[name].view(-1)
    for i in range(flat.numel()):
        old = flat[i].item()
        flat[i] = old + eps
        up = fn(**base).item()
        flat[i] = old - eps
        down = fn(**base).item()
        flat[i] = old
        grad.view(-1)[i] = (up - down) / (2 * eps)
    return grad


def symbolic_derivative(expression: str, tensors: dict[str, torch.Tensor], wrt: str = "w1", index=(0, 0)) -> dict:
    """Seed 002's symbolic differentiation on the chosen expression itself: sympy writes the loss with the element
    `wrt[index]` as a symbol t (every other entry a number), differentiates by t, and evaluates at t's value."""
    import sympy

    t = sympy.Symbol(f"{wrt}[{index[0]},{index[1]}]")
    m = {k: sympy.Matrix(v.tolist()) for k, v in tensors.items()}
    t0 = m[wrt][index]
    m[wrt][index] = t
    x, w1, w2 = m["x"], m["w1"], m["w2"]
    if expression == "mlp":
        y = (x * w1).applyfunc(sympy.tanh) * w2
        loss = sum(v ** 2 for v in y) / len(y)
    elif expression == "softmax":
        s = x * w1
        rows = []
        for i in range(s.rows):
            e = [sympy.exp(v) for v in s.row(i)]
            rows.append([v / sum(e) for v in e])
        z = sympy.Matrix(rows) * w2.applyfunc(lambda v: v ** 2)
        loss = sum(sympy.log(v) for v in z) / len(z)
    elif expression == "layernorm":
        h = x * w1
        rows = []
        for i in range(h.rows):
            r = list(h.row(i))
            mu = sum(r) / len(r)
            var = sum((v - mu) ** 2 for v in r) / len(r)
            rows.append([(v - mu) / sympy.sqrt(var + sympy.Float(1e-5)) for v in r])
        loss = sum(sympy.tanh(v) for v in sympy.Matrix(rows) * w2)
    else:
        raise ValueError(expression)
    derivative = sympy.diff(loss, t)
    return {"symbol": str(t), "value": float(derivative.subs(t, t0)), "operations": int(sympy.count_ops(derivative))}


