"""Training estimates: FLOPs against FlopCounterMode, mixed-precision Adam bytes against (2+2+12)ψ, the per-rank
formula against a real ZeRO-1 run, the seeds' numbers; a wrong formula is caught; bad inputs; the page."""
import pytest
import torch

from backend import experiments
from backend.estimate.training import (counted_flops, decoder_flops, memory_per_rank, seed_004_rows, seed_175b,
                                       training_seconds)
from backend.experiments.estimate.training import TrainingEstimateConfig
from backend.models.llama import ModelShape, TinyDecoder
from tests.sweep import assert_refused, one_at_a_time, render_recorded


@pytest.mark.parametrize("settings_", one_at_a_time(TrainingEstimateConfig))
def test_defaults_and_each_choice_pass(settings_):
    result = experiments.run("estimate.training", **settings_)
    assert result.passed, [c for c in result.checks if not c.passed]
    if settings_.get("zero_run"):
        assert result.tables["zero_memory"] and all(r["measured_bytes"] == r["formula_bytes"] for r in result.tables["zero_memory"])


@pytest.mark.parametrize("shape", [ModelShape(), ModelShape(d_model=32, n_heads=2, d_head=16, n_layers=3, d_ff=48, vocab=40)])
@pytest.mark.parametrize("batch, seq", [(1, 8), (3, 20)])
def test_flop_formula_equals_flopcounter(shape, batch, seq):
    torch.manual_seed(0)
    model = TinyDecoder(shape)
    counted = counted_flops(model, torch.randint(0, shape.vocab, (batch, seq + 1)))
    f = decoder_flops(model, batch, seq)
    assert counted == f["exact"]
    assert counted != f["six_n_linear"]  # leaving out attention is caught


def test_memory_per_rank_stages():
    assert sum(memory_per_rank(100, 4, 0).values()) == 1600
    assert memory_per_rank(100, 4, 1) == {"weights": 200, "gradients": 200, "optimizer states": 300}
    assert memory_per_rank(100, 4, 2) == {"weights": 200, "gradients": 50, "optimizer states": 300}
    assert sum(memory_per_rank(100, 4, 3).values()) == 400


def test_seed_figures():
    rows = {r["quantity"]: r for r in seed_175b(64e9)}
    assert rows["fp32 weights (in memory)"]["bytes"] == 700e9
    assert rows["cards of 64 GB for that"]["cards"] == pytest.approx(87.5)
    gpt3 = [r for r in seed_004_rows(4.0, 0.4) if r["model"] == "GPT-3"][0]
    assert gpt3["flops_6nd"] == pytest.approx(3.15e23)
    assert training_seconds(3.15e23, 125e12, 1.0, 1, 1.0) / 86400 / 365.25 == pytest.approx(79.9, abs=0.1)


@pytest.mark.parametrize("values, field", [({"device": "TPU"}, "device"), ({"mfu": "0"}, "mfu"), ({"mfu": "1.5"}, "mfu"),
                                           ({"devices": "0"}, "devices"), ({"measure_seq_len": "100000"}, "measure_seq_len")])
def test_bad_inputs_name_the_field(values, field):
    assert_refused(TrainingEstimateConfig, values, field)


def test_page_draws_a_run():
    render_recorded("pages/training_estimates.py", "estimate.training", measure_seq_len="8")


# --- the seeds' printed figures as run checks (seed 002's 175B example, seed 004's table), and each failing when broken
def test_seed_figures_are_run_checks():
    result = experiments.run("estimate.training", measure_seq_len=8)
    names = [c.name for c in result.checks]
    assert any("700 GB" in n for n in names) and any("87 cards" in n for n in names)
    assert any("GPT-3 row" in n for n in names) and any("V100's peak" in n for n in names)
    assert result.passed, [c for c in result.checks if not c.passed]


def test_175b_checks_fail_when_fp32_is_counted_at_two_bytes(monkeypatch):
    from backend.experiments.estimate import training as exp

    real = exp.seed_175b
    monkeypatch.setattr(exp, "seed_175b", lambda card: [dict(r, bytes=r["bytes"] / 2 if r["bytes"] else None,
                                                             cards=r.get("cards", 0) / 2) for r in real(card)])
    failed = [c.name for c in exp.seed_checks(TrainingEstimateConfig()) if not c.passed]
    assert any("700 GB" in n for n in failed) and any("87 cards" in n for n in failed)


def test_gpt3_check_fails_with_2nd_flops(monkeypatch):
    from backend.estimate import training as est
    from backend.experiments.estimate import training as exp

    monkeypatch.setattr(est, "training_flops", lambda params, tokens: 2.0 * params * tokens)  # forward only
    failed = [c.name for c in exp.seed_checks(TrainingEstimateConfig()) if not c.passed]
    assert any("GPT-3 row" in n for n in failed)


def test_table_check_fails_at_the_v100_fp32_rate(monkeypatch):
    from backend.estimate import training as est
    from backend.experiments.estimate import training as exp

    monkeypatch.setitem(est.ACCELERATORS, "V100 (32 GB)", (15.7e12, 32e9))  # fp32 CUDA cores, not tensor cores
    failed = [c.name for c in exp.seed_checks(TrainingEstimateConfig()) if not c.passed]
    assert failed == ["seed 004's table: no training time is shorter than 6·N·D at the V100's peak"]


@pytest.mark.parametrize("broken, why", [({"stage": 2}, "gradients sharded where ZeRO-1 keeps them whole"),
                                         ({"precision": "fp64"}, "fp64 weights, not the bf16 the formula counts")])
def test_zero_run_check_fails_when_the_run_breaks_the_rule(monkeypatch, broken, why):
    """The ZeRO-1 check compares the tiny LLaMA run's bytes with the seed's formula at the run's fp32 gradients (the
    seed's 2ψ beside them); a run that does not hold what ZeRO-1 in bf16 holds fails it."""
    from backend.experiments.estimate import training as module

    rows, check = module.zero_memory(TrainingEstimateConfig(zero_run=True))
    assert check.passed and all(r["formula_bytes"] == 2 * r["seed_formula_bytes"] for r in rows if r["category"] == "gradients")
    monkeypatch.setattr(module, "ZERO_RUN", {**module.ZERO_RUN, **broken})
    assert not module.zero_memory(TrainingEstimateConfig(zero_run=True))[1].passed, why
