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
