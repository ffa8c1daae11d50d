"""Each pointwise aten op as a Triton expression: the one table of what the generated kernels can compute.
capture.py marks an op pointwise (fusable) only if it is here; codegen.py writes its expression."""
from __future__ import annotations


def lit(v) -> str:
    if isinstance(v, bool):
        return "1.0" if v else "0.0"
    v = float(v)
    if v == float("inf"):
        return 'float("inf")'
    if v == float("-inf"):
        return 'float("-inf")'
    return repr(v)


def _pow(a, b):
    if isinstance(b, str):
        return f"tl.exp({b} * tl.log({a}))"
    b = float(b)
    if b == 2.0:
        return f"({a} * {a})"
    if b == 3.0:
        return f"({a} * {a} * {a})"
    if b == 0.5:
        return f"tl.sqrt({a})"
    if b == -1.0:
        return f"(1.0 / {a})"
    return f"tl.exp({lit(b)} * tl.log({a}))"


POINTWISE = {
    "add": lambda a, b: f"({a} + {b})", "sub": lambda a, b: f"({a} - {b})", "mul": lambda a, b: f"({a} * {b})",
    "div": lambda a, b: f"({a} / {b})", "neg": lambda a: f"(-{a})", "exp": lambda a: f"tl.exp({a})",
    "log": lambda a: f"tl.log({a})", "rsqrt": lambda a: f"tl.rsqrt({a})", "sqrt": lambda a: f"tl.sqrt({a})",
    "erf": lambda a: f"tl.erf({a})", "tanh": lambda a: f"(2.0 * tl.sigmoid(2.0 * {a}) - 1.0)",
    "sigmoid": lambda a: f"tl.sigmoid({a})", "relu": lambda a: f"tl.maximum({a}, 0.0)", "abs": lambda a: f"tl.abs({a})",
    "reciprocal": lambda a: f"(1.0 / {a})", "maximum": lambda a, b: f"tl.maximum({a}, {b})",
    "minimum": lambda a, b: f"tl.minimum({a}, {b})", "pow": _pow, "where": lambda c, a, b: f"tl.where({c}, {a}, {b})",
    "gt": lambda a, b: f"({a} > {b})", "lt": lambda a, b: f"({a} < {b})", "ge": lambda a, b: f"({a} >= {b})",
    "le": lambda a, b: f"({a} <= {b})", "clone": lambda a: a,
    "ones_like": lambda *a: "1.0", "zeros_like": lambda *a: "0.0", "full_like": lambda x, v, *a: lit(v),
    "scalar_tensor": lambda v, *a: lit(v),
}
