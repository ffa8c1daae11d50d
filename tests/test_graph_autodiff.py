"""Our autograd against torch.autograd and central differences; the symbolic example; the DAGs."""
import pytest
import torch

from backend import experiments
from backend.config import ConfigError
from backend.graph.autograd import Node, build, graphs, numeric_grad, symbolic_derivative


@pytest.mark.parametrize("expression", ["mlp", "softmax", "layernorm"])
def test_three_ways_agree(expression):
    result = experiments.run("graph.autodiff", expression=expression)
    assert result.passed, [c for c in result.checks if not c.passed]
    assert "digraph" in result.tables["forward_dot"][0]["dot"]


def test_a_wrong_backward_rule_is_caught():
    g = torch.Generator().manual_seed(1)
    t = {"x": torch.randn(3, 4, generator=g, dtype=torch.float64), "w1": torch.randn(4, 5, generator=g, dtype=torch.float64),
         "w2": torch.rand(5, 3, generator=g, dtype=torch.float64) + 0.5}
    original = Node.tanh

    def wrong_tanh(self):  # forgets the chain rule's (1 - tanh²)
        return Node(torch.tanh(self.value), (self,), "tanh", lambda grad: (grad,))
    Node.tanh = wrong_tanh
    try:
        loss, leaves, fn = build("mlp", t)
        loss.backward()
    finally:
        Node.tanh = original
    assert (leaves["w1"].grad - numeric_grad(fn, t, "w1")).abs().max() > 1e-3


def test_backward_graph_mirrors_forward():
    t = {"x": torch.ones(2, 2, dtype=torch.float64), "w1": torch.eye(2, dtype=torch.float64), "w2": torch.ones(2, 3, dtype=torch.float64)}
    loss, leaves, _ = build("mlp", t)
    loss.backward()
    fwd, bwd = graphs(loss, {leaves[k].id: k for k in leaves})
    assert fwd.number_of_nodes() >= 6 and bwd.number_of_edges() >= 4


@pytest.mark.parametrize("expression, wrt", [("mlp", "w1"), ("softmax", "w1"), ("layernorm", "w2")])
def test_symbolic_derivative_is_of_the_chosen_expression(expression, wrt):
    """sympy differentiates the expression the user chose, so it agrees with torch on it, and not on another."""
    g = torch.Generator().manual_seed(1)
    t = {"x": torch.randn(2, 3, generator=g, dtype=torch.float64), "w1": torch.randn(3, 4, generator=g, dtype=torch.float64),
         "w2": torch.rand(4, 2, generator=g, dtype=torch.float64) + 0.5}
    grads = {}
    for e in ("mlp", "softmax", "layernorm"):
        ref = {k: v.clone().requires_grad_() for k, v in t.items()}
        build(e, t)[2](**ref).backward()
        grads[e] = ref[wrt].grad[0, 0].item()
    value = symbolic_derivative(expression, t, wrt)["value"]
    assert value == pytest.approx(grads[expression], abs=1e-12)
    assert all(value != pytest.approx(v, abs=1e-6) for e, v in grads.items() if e != expression)


def test_bad_expression():
    with pytest.raises(ConfigError) as info:
        experiments.get("graph.autodiff").make_config({"expression": "conv"})
    assert info.value.field == "expression"
