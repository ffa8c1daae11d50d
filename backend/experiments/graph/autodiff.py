"""graph.autodiff: seed 002's three ways to differentiate, side by side on one expression.

Automatic: our reverse-mode autograd (backend/graph/autograd.py) against torch.autograd (float64; the same
operations in the same order, so agreement to ~1e-15). Numeric: central differences with step 1e-6, whose
error is truncation O(h²) plus round-off O(u·|f|/h) ≈ 1e-10; allowed 1e-7. Symbolic: sympy's derivative of the same
expression by one weight element, evaluated, against both (its size shows the expression swell). The forward DAG and the backward DAG it implies are returned
for drawing, with which intermediates each backward step needs (the memory training keeps).
"""
from __future__ import annotations

import dataclasses

import torch

from backend.config import Config, setting
from backend.limits import cost
from backend.experiments import define
from backend.graph.autograd import build, graphs, numeric_grad, symbolic_derivative
from backend.graph.dot import to_dot
from backend.result import Check, Result, Schema


@dataclasses.dataclass
class AutodiffConfig(Config):
    expression: str = setting("mlp", choices=("mlp", "softmax", "layernorm"), help="what to differentiate")
    batch: int = setting(4, min=1, max=64, help="rows of x")
    width: int = setting(5, min=1, max=64, help="columns of x / rows of w1")
    hidden: int = setting(6, min=2, max=64, help="columns of w1 / rows of w2")
    seed: int = setting(0, min=0, max=2**31 - 1, help="values")

    cost_drivers = ("batch", "width", "hidden")

    def estimate(self):
        """Our reverse mode walks a graph of batch·width·hidden products; central differences evaluate the
        expression twice per input element, and each element is a table row."""
        elements = self.batch * self.width + self.width * self.hidden + self.hidden * 3
        products = self.batch * self.width * self.hidden
        return cost(data_bytes=elements * 2000 + products * 1000, ops=products * 12 + elements * 2 * 12 + 2000,  # 80.5 s of CPU at 64x64x64 measured
                    seconds=0.6)  # sympy's derivative and the first backward: 0.6 s of CPU at the defaults measured


def run(config: AutodiffConfig, ctx) -> Result:
    g = torch.Generator().manual_seed(config.seed)
    tensors = {"x": torch.randn(config.batch, config.width, generator=g, dtype=torch.float64),
               "w1": torch.randn(config.width, config.hidden, generator=g, dtype=torch.float64),
               "w2": torch.rand(config.hidden, 3, generator=g, dtype=torch.float64) + 0.5}
    loss, leaves, torch_fn = build(config.expression, tensors)
    order = loss.backward()
    ref = {k: v.clone().requires_grad_() for k, v in tensors.items()}
    ref_loss = torch_fn(**ref)
    ref_loss.backward()
    ctx.progress(0.4, "numeric differences")
    rows, checks = [], []
    ours_err = max((leaves[k].grad - ref[k].grad).abs().max().item() for k in tensors)
    numeric = {k: numeric_grad(torch_fn, tensors, k) for k in tensors}
    numeric_err = max((numeric[k] - ref[k].grad).abs().max().item() for k in tensors)
    for k in tensors:
        for i, (a, b, c) in enumerate(zip(leaves[k].grad.reshape(-1).tolist(), ref[k].grad.reshape(-1).tolist(), numeric[k].reshape(-1).tolist())):
            rows.append({"tensor": k, "element": i, "ours": a, "torch": b, "numeric": c})
    errors_against_torch(rows)
    checks.append(Check("forward value equals torch", abs(loss.value.item() - ref_loss.item()), 1e-12, reference="torch"))
    checks.append(Check("our reverse-mode gradients equal torch.autograd", ours_err, 1e-12, reference="torch.autograd, float64"))
    checks.append(Check("central differences equal torch.autograd", numeric_err, 1e-7, reference="torch.autograd, float64",
                        detail="expected ≈ 1e-10: truncation O(h²) + round-off O(u|f|/h), h = 1e-6"))
    ctx.progress(0.7, "symbolic derivative")
    # By a first-layer weight, through the nonlinearity; for layernorm by w2, since by w1 the written-out
    # derivative (mean and variance of every row depend on it) takes sympy minutes: the swell, again.
    wrt = "w2" if config.expression == "layernorm" else "w1"
    sym = symbolic_derivative(config.expression, tensors, wrt)
    ours_0, torch_0 = leaves[wrt].grad[0, 0].item(), ref[wrt].grad[0, 0].item()
    checks.append(Check(f"symbolic (sympy) ∂loss/∂{sym['symbol']} equals ours and torch's",
                        max(abs(sym["value"] - ours_0), abs(sym["value"] - torch_0)), 1e-10,
                        reference="sympy.diff of the same expression, evaluated", detail=f"{sym['value']:.12g}; "
                        f"the derivative has {sym['operations']:,} operations written out (expression swell)"))
    names = {leaves[k].id: k for k in leaves} | {loss.id: "loss"}
    fwd, bwd = graphs(loss, names)
    kept = {}  # the tensors backward rules need: the activation memory training holds between passes
    for n in order:
        for s in n.saved:
            t = n.value if s == "output" else s.value
            kept[id(t)] = t.numel() * t.element_size()
    saved = sum(kept.values())
    return Result(
        metrics={"expression": config.expression, "forward_nodes": fwd.number_of_nodes(), "backward_nodes": bwd.number_of_nodes(),
                 "saved_for_backward_bytes": saved, "symbolic_element": sym["symbol"], "symbolic_value": sym["value"],
                 "symbolic_operations": sym["operations"]},
        tables={"gradients": rows, "forward_dot": [{"dot": to_dot(fwd, "TB")}], "backward_dot": [{"dot": to_dot(bwd, "TB")}]},
        checks=checks)


def errors_against_torch(rows: list[dict]) -> None:
    """Each gradient element's distance from torch.autograd's: ours and the central difference's."""
    for r in rows:
        r["ours_error"], r["numeric_error"] = abs(r["ours"] - r["torch"]), abs(r["numeric"] - r["torch"])


RESULT = Schema(
    metrics=(
        "expression", "forward_nodes", "backward_nodes", "saved_for_backward_bytes", "symbolic_element",
        "symbolic_value", "symbolic_operations",
    ),
    tables={
        "gradients": ("element", "numeric", "ours", "tensor", "torch", "ours_error", "numeric_error"),
        "forward_dot": ("dot",),
        "backward_dot": ("dot",),
    },
    version=2, upgrades={1: lambda result: errors_against_torch(result["tables"]["gradients"])},  # v1: the page's
)

EXPERIMENT = define(__name__, AutodiffConfig,
         "symbolic, numeric and automatic differentiation side by side; the forward and backward DAGs",
         run_fn=run, schema=RESULT)
