"""MoE routing against the one-token-at-a-time implementation; a wrong gate is caught; the layer splits by expert
range (for expert parallelism); bad inputs; the page."""
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from backend import experiments
from backend.experiments.models.moe_routing import RoutingConfig, as_routes, route_error
from backend.models import moe, moe_reference as ref
from tests.sweep import assert_refused, one_at_a_time, render_recorded


@pytest.mark.parametrize("settings_", one_at_a_time(RoutingConfig))
def test_defaults_and_each_choice_pass(settings_):
    result = experiments.run("models.moe_routing", **settings_)
    assert result.passed, [c for c in result.checks if not c.passed]


@settings(max_examples=40, deadline=None)
@given(groups=st.sampled_from([1, 2, 4]), per_group=st.integers(2, 5), data=st.data())
def test_deepseek_gate_equals_direct_implementation(groups, per_group, data):
    n = groups * per_group
    kept = data.draw(st.integers(1, groups))
    k = data.draw(st.integers(1, kept * per_group))
    seed = data.draw(st.integers(0, 1000))
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(12, n, generator=g, dtype=torch.float64)
    bias = 0.1 * torch.randn(n, generator=g, dtype=torch.float64)
    got = as_routes(moe.deepseek_v3(logits, bias, k, groups, kept, 2.5))
    err, differ = route_error(got, ref.deepseek_v3(logits.tolist(), bias.tolist(), k, groups, kept, 2.5))
    assert differ == 0 and err < 1e-12
    assert all(abs(sum(r.values()) - 2.5) < 1e-12 for r in got)


def _biased_weights_gate(logits, bias, k, n_groups, topk_groups, scale):
    """A wrong gate: the bias leaks into the weights (it must only steer the choice)."""
    r = moe.deepseek_v3(logits, bias, k, n_groups, topk_groups, scale)
    w = (logits.sigmoid() + bias).gather(1, r.indices)
    return moe.Routing(r.indices, w / w.sum(-1, keepdim=True) * scale, r.kept, r.probs)


def _max_group_gate(logits, bias, k, n_groups, topk_groups, scale):
    """A wrong gate: groups ranked by their best expert instead of the sum of their top two."""
    s = logits.sigmoid()
    choice = (s + bias).view(s.shape[0], n_groups, -1)
    top = choice.amax(-1).topk(topk_groups, dim=-1)[1]
    mask = torch.ones(s.shape[0], n_groups, dtype=torch.bool).scatter_(1, top, False)
    idx = choice.masked_fill(mask[..., None], -math.inf).flatten(1).topk(k, dim=-1)[1]
    w = s.gather(1, idx)
    return moe.Routing(idx, w / w.sum(-1, keepdim=True) * scale, torch.ones_like(idx, dtype=torch.bool), s)


@pytest.mark.parametrize("wrong", [_biased_weights_gate, _max_group_gate])
def test_a_wrong_gate_fails_the_check(wrong):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 16, generator=g, dtype=torch.float64)
    bias = 0.2 * torch.randn(16, generator=g, dtype=torch.float64)
    err, _ = route_error(as_routes(wrong(logits, bias, 4, 4, 2, 2.5)), ref.deepseek_v3(logits.tolist(), bias.tolist(), 4, 4, 2, 2.5))
    assert err > 1e-6


def test_switch_drops_exactly_the_overflow():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(40, 4, generator=g, dtype=torch.float64) + torch.tensor([1.0, 0, 0, -1], dtype=torch.float64)
    r = moe.switch_top1(logits, 1.0)
    cap = moe.expert_capacity(40, 1, 4, 1.0)
    chosen = torch.bincount(r.indices.flatten(), minlength=4)
    assert int((~r.kept).sum()) == int((chosen - cap).clamp(min=0).sum())
    assert int(r.load(4).max()) <= cap


def test_layer_split_by_expert_range_sums_to_the_whole():
    """What expert parallelism relies on: each rank's experts give a partial output; the partials sum to the layer."""
    torch.manual_seed(0)
    layer = moe.MoELayer(8, 16, 6, 1).double()
    x = torch.randn(10, 8, dtype=torch.float64)
    with torch.no_grad():
        r = moe.softmax_topk(layer.router(x), 2, True)
        parts = layer.routed(x, r, range(0, 3)) + layer.routed(x, r, range(3, 6))
        assert torch.allclose(parts, layer.routed(x, r), atol=1e-14, rtol=0)


def test_balance_loss_is_one_when_uniform():
    r = moe.softmax_topk(torch.zeros(8, 4, dtype=torch.float64), 1, False)
    r.indices = torch.arange(8)[:, None] % 4  # each expert chosen equally often, probabilities uniform
    assert float(moe.balance_loss(r, 4)) == pytest.approx(1.0)


def test_bias_balancing_reduces_imbalance():
    result = experiments.run("models.moe_routing")
    m, cfg = result.metrics, RoutingConfig()
    assert m["imbalance_after_bias"] < m["imbalance_before_bias"]
    # the balanced load drawn beside each router's: its routes per token (Switch: one; the others: top_k) over the experts
    for row in result.tables["loads"]:
        assert row["balanced"] == cfg.tokens * (1 if row["router"] == "Switch top-1" else cfg.top_k) / cfg.n_experts
    kept = {r["router"]: r["dropped_tokens"] for r in result.tables["summary"]}
    for router, dropped in kept.items():  # without drops the loads' mean is the balanced load
        rows = [r for r in result.tables["loads"] if r["router"] == router]
        if not dropped:
            assert sum(r["tokens"] for r in rows) / len(rows) == pytest.approx(rows[0]["balanced"])


@pytest.mark.parametrize("values, field", [
    ({"n_experts": "10", "n_groups": "4"}, "n_groups"), ({"n_experts": "8", "n_groups": "8"}, "n_groups"),
    ({"topk_groups": "5"}, "topk_groups"), ({"top_k": "9"}, "top_k"), ({"tokens": "100000"}, "tokens"),
    ({"capacity_factor": "0"}, "capacity_factor"),
])
def test_bad_inputs_name_the_field(values, field):
    assert_refused(RoutingConfig, values, field)


def test_page_draws_a_run():
    render_recorded("pages/moe_routing.py", "models.moe_routing", tokens="16", bias_steps="3")


def _float_capacity(tokens, k, n_experts, capacity_factor):
    """The broken rule: ceil in floating point (1.1 · 100 / 10 = 11.000000000000002 -> 12)."""
    return math.ceil(capacity_factor * tokens * k / n_experts)


def test_capacity_is_exact_over_the_grid():
    """cf 0.25..3.3 by 0.05, T 4..512, E 2..64: expert_capacity equals the integers-only least C with C·E >= cf·T;
    the floating-point rule gets 570 of these 1,988,154 wrong (1.1, 100, 10 among them)."""
    cfs = [round(0.25 + 0.05 * i, 2) for i in range(62)]
    wrong = old_wrong = 0
    for cf in cfs:
        for tokens in range(4, 513):
            for n in range(2, 65):
                exact = ref.capacity(tokens, 1, n, cf)
                wrong += moe.expert_capacity(tokens, 1, n, cf) != exact
                old_wrong += _float_capacity(tokens, 1, n, cf) != exact
    assert wrong == 0
    assert old_wrong == 570
    assert moe.expert_capacity(100, 1, 10, 1.1) == 11 == ref.capacity(100, 1, 10, 1.1)
    assert moe.expert_capacity(50, 2, 10, 1.1) == 11 and moe.expert_capacity(101, 1, 10, 1.1) == 12


def test_capacity_check_fails_for_the_float_rule(monkeypatch):
    """cf 1.1, 100 tokens, 10 experts: the exact capacity is 11; the float rule's 12 fails the run's capacity check."""
    cfg = dict(capacity_factor=1.1, tokens=100, n_experts=10, n_groups=2, bias_steps=0, d_ff=8, top_k=2)
    good = experiments.run("models.moe_routing", **cfg)
    assert good.passed and good.metrics["switch_capacity"] == 11
    assert "ceil(1.1 · 100 / 10) = 11" in good.notes[0]
    monkeypatch.setattr(moe, "expert_capacity", _float_capacity)
    bad = experiments.run("models.moe_routing", **cfg)
    failed = [c.name for c in bad.checks if not c.passed]
    assert "Switch capacity equals the exact ceil(cf · tokens / N)" in failed


def test_capacity_topk_renormalises_like_gshard():
    """GShard's Algorithm 1 divides the top-2 gates by their sum; Switch's single gate stays the probability."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 0.5, 3.0, 0.1]], dtype=torch.float64)
    p = logits.softmax(-1)
    r2 = moe.capacity_topk(logits, 2, None)
    top = p.topk(2, dim=-1)[0]
    assert torch.allclose(r2.weights, top / top.sum(-1, keepdim=True), atol=1e-15, rtol=0)
    assert torch.allclose(r2.weights.sum(-1), torch.ones(2, dtype=torch.float64), atol=1e-15, rtol=0)
    r1 = moe.switch_top1(logits, 1.0)
    assert torch.equal(r1.weights[:, 0], p.max(-1)[0])
    assert torch.allclose(moe.capacity_topk(logits, 2, None, renormalize=False).weights, top, atol=0, rtol=0)
