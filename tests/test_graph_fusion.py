"""Passes on hand-built graphs with known results, and the captured graphs of real models."""
import networkx as nx
import pytest

from backend import experiments
from backend.config import ConfigError
from backend.graph.passes import cse, dce, fuse, kernel_stats


def graph(nodes, edges):
    g = nx.DiGraph()
    for name, kind, numel, target, args in nodes:
        g.add_node(name, kind=kind, numel=numel, bytes=4 * numel, op=target, target=target, args=args, shape=(numel,))
    g.add_edges_from(edges)
    return g


def test_dce_removes_only_unused_compute():
    g = graph([("x", "input", 8, "input", ""), ("a", "pointwise", 8, "exp", "['x']"), ("dead", "pointwise", 8, "neg", "['x']"),
               ("out", "output", 0, "output", "['a']")], [("x", "a"), ("x", "dead"), ("a", "out")])
    g2, log = dce(g)
    assert "dead" not in g2 and "a" in g2 and len(log) == 1


def test_cse_merges_identical_ops():
    g = graph([("x", "input", 8, "input", ""), ("a", "pointwise", 8, "exp", "['x']"), ("b", "pointwise", 8, "exp", "['x']"),
               ("c", "pointwise", 8, "add", "['a', 'b']"), ("out", "output", 0, "output", "['c']")],
              [("x", "a"), ("x", "b"), ("a", "c"), ("b", "c"), ("c", "out")])
    g2, log = cse(g)
    assert "b" not in g2 and ("a", "c") in g2.edges and len(log) == 1


def test_vertical_fusion_and_why_not():
    # x -> exp -> sum (row reduction) -> mul(broadcast back over the row) ; mm stays extern
    g = graph([("x", "input", 32, "input", ""), ("e", "pointwise", 32, "exp", "['x']"), ("s", "reduction", 4, "sum", "['e']"),
               ("m", "pointwise", 32, "mul", "['e', 's']"), ("w", "input", 64, "input", ""), ("mm", "opaque", 16, "mm", "['m', 'w']"),
               ("out", "output", 0, "output", "['mm']")],
              [("x", "e"), ("e", "s"), ("e", "m"), ("s", "m"), ("m", "mm"), ("w", "mm"), ("mm", "out")])
    group, rejected, log = fuse(g)
    assert group["e"] == group["s"]                 # pointwise into the reduction over its rows
    reasons = {(r["producer"], r["consumer"]): r["why not"] for r in rejected}
    assert "reduction" in reasons[("s", "m")]       # a reduction's result broadcast into its consumer
    assert "extern" in reasons[("m", "mm")]
    assert kernel_stats(g, group)["kernels"] == 3
    assert kernel_stats(g, None)["kernels"] == 4


@pytest.mark.parametrize("model", ["ln_gelu", "mlp", "attention"])
def test_models_capture_and_fuse(model):
    result = experiments.run("graph.fusion", model=model)
    assert result.passed, [c for c in result.checks if not c.passed]
    m = result.metrics
    assert m["kernels_fused"] < m["kernels_unfused"] and m["ideal_unique_bytes"] <= m["bytes_fused"] < m["bytes_unfused"]


def test_bad_model_name():
    with pytest.raises(ConfigError) as info:
        experiments.get("graph.fusion").make_config({"model": "resnet"})
    assert info.value.field == "model"
