"""A small expression language for the fusion experiment: `gelu(layer_norm(x) * w + b) @ W`.

Python syntax, parsed with `ast` and allowed only: numbers, the variables below, + - * / ** @, unary minus
and the functions below. Anything else is an ExprError that names what is wrong and where.
"""
from __future__ import annotations

import ast

import torch
import torch.nn.functional as F

MAX_LENGTH = 200
VARIABLES = {  # name -> shape in terms of (rows, width)
    "x": lambda r, c: (r, c), "y": lambda r, c: (r, c), "w": lambda r, c: (c,), "b": lambda r, c: (c,),
    "W": lambda r, c: (c, c), "V": lambda r, c: (c, c),
}


def _dim(d=-1):
    if not isinstance(d, int) or d not in (-1, 0, 1):
        raise ExprError("a reduction's dim must be 0, 1 or -1")
    return d


FUNCTIONS = {
    "exp": torch.exp, "log": torch.log, "sqrt": torch.sqrt, "rsqrt": torch.rsqrt, "tanh": torch.tanh,
    "sigmoid": torch.sigmoid, "relu": torch.relu, "gelu": F.gelu, "erf": torch.erf, "abs": torch.abs,
    "silu": F.silu, "maximum": torch.maximum, "minimum": torch.minimum,
    "softmax": lambda t, d=-1: torch.softmax(t, dim=_dim(d)),
    "layer_norm": lambda t: F.layer_norm(t, t.shape[-1:]),
    "sum": lambda t, d=-1: t.sum(dim=_dim(d), keepdim=True),
    "mean": lambda t, d=-1: t.mean(dim=_dim(d), keepdim=True),
    "max": lambda t, d=-1: t.amax(dim=_dim(d), keepdim=True),
}
BINARY = {ast.Add: torch.add, ast.Sub: torch.sub, ast.Mult: torch.mul, ast.Div: torch.div, ast.Pow: torch.pow,
          ast.MatMult: torch.matmul}


class ExprError(ValueError):
    pass


def parse(text: str) -> tuple[ast.Expression, list[str]]:
    """Check the syntax and the names; returns the tree and the variables in order of first use."""
    if not text.strip():
        raise ExprError("empty; write an expression such as gelu(layer_norm(x) * w + b)")
    if len(text) > MAX_LENGTH:
        raise ExprError(f"{len(text)} characters; at most {MAX_LENGTH}")
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError as e:
        raise ExprError(f"syntax error at column {e.offset}: {e.msg}") from None
    used: list[str] = []

    def visit(node):
        where = f" at column {getattr(node, 'col_offset', 0) + 1}"
        if isinstance(node, ast.Expression):
            return visit(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return
        if isinstance(node, ast.Name):
            if node.id not in VARIABLES:
                raise ExprError(f"unknown variable {node.id!r}{where} (variables: {', '.join(VARIABLES)})")
            if node.id not in used:
                used.append(node.id)
            return
        if isinstance(node, ast.BinOp) and type(node.op) in BINARY:
            visit(node.left)
            visit(node.right)
            return
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            return visit(node.operand)
        if isinstance(node, ast.Call):
            if not isinstance(node.func, ast.Name) or node.func.id not in FUNCTIONS:
                name = node.func.id if isinstance(node.func, ast.Name) else ast.unparse(node.func)
                raise ExprError(f"unknown function {name!r}{where} (functions: {', '.join(FUNCTIONS)})")
            if node.keywords:
                raise ExprError(f"keyword arguments are not supported{where}")
            for a in node.args:
                visit(a)
            return
        raise ExprError(f"{type(node).__name__} is not allowed{where}: use numbers, variables, + - * / ** @ and functions")

    visit(tree)
    if not used:
        raise ExprError("uses no variable; differentiate with respect to at least one of " + ", ".join(VARIABLES))
    return tree, used


def compile_expression(text: str, rows: int, width: int):
    """A torch function of the expression's variables, its seeded inputs, and a shape check on them."""
    tree, names = parse(text)

    def ev(node, env):
        if isinstance(node, ast.Expression):
            return ev(node.body, env)
        if isinstance(node, ast.Constant):
            return float(node.value)
        if isinstance(node, ast.Name):
            return env[node.id]
        if isinstance(node, ast.BinOp):
            return BINARY[type(node.op)](ev(node.left, env), ev(node.right, env))
        if isinstance(node, ast.UnaryOp):
            v = ev(node.operand, env)
            return -v if isinstance(node.op, ast.USub) else v
        args = [ev(a, env) for a in node.args]
        return FUNCTIONS[node.func.id](*[int(a) if isinstance(a, float) and a.is_integer() and i > 0 else a
                                          for i, a in enumerate(args)])

    def fn(*tensors):
        return ev(tree, dict(zip(names, tensors)))

    g = torch.Generator().manual_seed(0)
    inputs = [torch.randn(*VARIABLES[n](rows, width), generator=g) for n in names]
    inputs = [t.abs() + 0.5 if _needs_positive(tree, n) else t for n, t in zip(names, inputs)]
    try:
        out = fn(*[t.to("meta") for t in inputs])
    except ExprError:
        raise
    except (RuntimeError, TypeError, ValueError) as e:
        raise ExprError(f"shapes do not fit (x, y: {rows}×{width}; w, b: {width}; W, V: {width}×{width}): "
                        f"{str(e).splitlines()[0]}") from None
    if not isinstance(out, torch.Tensor):
        raise ExprError("the result is a constant; it must depend on a variable")
    if out.dim() > 2:
        raise ExprError(f"the result has {out.dim()} dimensions; at most 2")
    return fn, inputs


def _needs_positive(tree, name) -> bool:
    """Inputs under log, sqrt or rsqrt are made positive so the check compares finite numbers."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("log", "sqrt", "rsqrt"):
            if any(isinstance(n, ast.Name) and n.id == name for n in ast.walk(node)):
                return True
    return False
