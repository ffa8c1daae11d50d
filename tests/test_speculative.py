"""Speculative sampling: the output distribution test passes for the correct rule and fails for a broken one
(on Markov 'models' whose distributions are known exactly, and in the experiment on trained tiny LLaMAs);
tokens per call against the formula; bad inputs; the page."""
import math

import pytest
import torch

from backend import experiments
from backend.decoding.speculative import chi_square, expected_tokens_per_call, speculative_decode
from backend.experiments.decoding.speculative import SpeculativeConfig
from tests.sweep import assert_refused, one_at_a_time, render_recorded


class MarkovModel(torch.nn.Module):
    """Logits that depend only on the previous token: next-token distributions known exactly."""

    def __init__(self, logits: torch.Tensor):
        super().__init__()
        self.table = logits

    def forward(self, tokens):
        return self.table[tokens]


def _models(vocab=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    p_logits = 2 * torch.randn(vocab, vocab, generator=g)
    q_logits = p_logits + 1.5 * torch.randn(vocab, vocab, generator=g)  # a draft that disagrees often
    return MarkovModel(p_logits), MarkovModel(q_logits)


def _first_two_tokens_test(rule, gamma, samples=6000, seed=1):
    target, draft = _models()
    prefix = torch.tensor([[2]]).expand(samples, -1)
    buf, _, _ = speculative_decode(target, draft, prefix, 2, gamma, torch.Generator().manual_seed(seed), rule)
    P = target.table.softmax(-1)
    joint = (P[2][:, None] * P).flatten()
    counts = torch.bincount(buf[:, 1] * 6 + buf[:, 2], minlength=36)
    return chi_square(counts, joint)


@pytest.mark.parametrize("gamma", [1, 3])
def test_correct_rule_passes_the_distribution_test(gamma):
    _, _, p_value = _first_two_tokens_test("correct", gamma)
    assert p_value > 1e-3


@pytest.mark.parametrize("gamma", [1, 3])
def test_broken_rule_fails_the_distribution_test(gamma):
    _, _, p_value = _first_two_tokens_test("resample_from_p", gamma)
    assert p_value < 1e-3


def test_tokens_per_call_follow_the_formula_for_a_constant_acceptance():
    """Draft equal to the target accepts every token: gamma + 1 tokens per call, the formula at alpha = 1."""
    target, _ = _models()
    _, _, s = speculative_decode(target, target, torch.tensor([[0]]).expand(50, -1), 20, 3, torch.Generator().manual_seed(0))
    assert s.accepted == s.drafted and s.emitted / s.target_calls == pytest.approx(expected_tokens_per_call(1.0, 3), rel=0.1)
    assert expected_tokens_per_call(0.0, 5) == 1.0


def test_chi_square_pvalue():
    probs = torch.full((10,), 0.1, dtype=torch.float64)
    assert chi_square(torch.full((10,), 100), probs)[2] == pytest.approx(1.0)
    stat, dof, p = chi_square(torch.tensor([120, 80] + [100] * 9), torch.full((11,), 1 / 11, dtype=torch.float64))
    # 8.0 on 10 degrees of freedom; for even dof 2k the tail is e^(-x/2) Σ_(i<k) (x/2)^i / i!
    assert stat == pytest.approx(8.0) and dof == 10
    assert p == pytest.approx(math.exp(-4) * sum(4**i / math.factorial(i) for i in range(5)), rel=1e-9)


@pytest.mark.parametrize("settings_", one_at_a_time(SpeculativeConfig))
def test_defaults_pass_and_the_broken_rule_is_rejected(settings_):
    result = experiments.run("decoding.speculative", **settings_)
    assert result.passed, [c for c in result.checks if not c.passed]
    assert result.metrics["p_value.broken"] < 1e-3


@pytest.mark.parametrize("values, field", [
    ({"gamma": "0"}, "gamma"), ({"gamma": "20"}, "gamma"), ({"test_samples": "10"}, "test_samples"),
    ({"vocab": "1000"}, "vocab"),
])
def test_bad_inputs_name_the_field(values, field):
    assert_refused(SpeculativeConfig, values, field)


def test_page_draws_a_run():
    render_recorded("pages/speculative.py", "decoding.speculative", gamma="2", new_tokens="8", sequences="2",
                         test_samples="300", target_steps="5", draft_steps="5", timing_repeats="1")
