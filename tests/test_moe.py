"""MoE routing against the one-token-at-a-time implementation; a wrong gate is caught; the layer splits by expert
range (for expert parallelism); bad inputs; the page."""
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from backend import experiments
from backend.experiments.moe.routing import RoutingConfig, as_routes, route_error
from backend.models import moe, moe_reference as ref
from tests.sweep import assert_refused, one_at_a_time, render_recorded


@pytest.mark.parametrize("settings_", one_at_a_time(RoutingConfig))
def test_defaults_and_each_choice_pass(settings_):
    result = experiments.run("moe.routing", **settings_)
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
    m = experiments.run("moe.routing").metrics
    assert m["imbalance_after_bias"] < m["imbalance_before_bias"]


@pytest.mark.parametrize("values, field", [
    ({"n_experts": "10", "n_groups": "4"}, "n_groups"), ({"n_experts": "8", "n_groups": "8"}, "n_groups"),
    ({"topk_groups": "5"}, "topk_groups"), ({"top_k": "9"}, "top_k"), ({"tokens": "100000"}, "tokens"),
    ({"capacity_factor": "0"}, "capacity_factor"),
])
def test_bad_inputs_name_the_field(values, field):
    assert_refused(RoutingConfig, values, field)


def test_page_draws_a_run():
    render_recorded("pages/moe_routing.py", "moe.routing", tokens="16", bias_steps="3")
