"""Number formats: torch's rounding, bits and gaps against exact rational formulas; ranges against torch.finfo;
the swamping example; summation bounds; bad inputs; the page."""
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from backend import experiments
from backend.experiments.numerics.formats import FormatsConfig
from backend.numerics.formats import (FORMATS, Format, add_in, describe, range_formula, round_exact, running_sums,
                                      stall_prediction, torch_range)
from tests.sweep import assert_refused, one_at_a_time, render_recorded


@pytest.mark.parametrize("name", [n for n, f in FORMATS.items() if f.dtype is not None])
def test_ranges_equal_finfo(name):
    assert range_formula(FORMATS[name]) == torch_range(FORMATS[name])


def test_a_wrong_layout_disagrees_with_finfo():
    wrong = Format("fp16", 5, 9, torch.float16)  # one mantissa bit short
    assert range_formula(wrong) != torch_range(wrong)


@settings(max_examples=300, deadline=None)
@given(x=st.floats(allow_nan=False, width=64), name=st.sampled_from(sorted(FORMATS)))
def test_torch_rounding_bits_and_gap_equal_the_formulas(x, name):
    d = describe(x, FORMATS[name])
    assert d["stored_value"] == d["reference_value"]
    if d["kind"] != "inf/nan":
        assert d["stored_value"] == d["value_from_bits"]
    assert (math.isnan(d["gap_to_next"]) and math.isnan(d["gap_formula"])) or d["gap_to_next"] == d["gap_formula"]


def test_ties_go_to_even():
    fp16 = FORMATS["fp16"]
    assert round_exact(1 + 2**-11, fp16) == 1.0              # tie, 1.0 has an even mantissa
    assert round_exact(1 + 3 * 2**-11, fp16) == 1 + 2**-9     # tie, rounds up to the even neighbour


def test_swamping_example():
    assert add_in(2**-3, 2**-14, FORMATS["fp16"]) == 2**-3
    assert add_in(2**-3, 2**-14, FORMATS["fp32"]) == 2**-3 + 2**-14
    assert add_in(2**-3, 2**-13, FORMATS["fp16"]) == 2**-3 + 2**-13  # a whole gap survives


@pytest.mark.parametrize("value", [1e-4, 3e-3, 0.01, 0.3])
def test_fp16_plain_sum_stalls_where_predicted(value):
    v16 = round_exact(value, FORMATS["fp16"])
    stall = stall_prediction(v16, FORMATS["fp16"])
    n = int(2.5 * stall / v16)
    assert running_sums([value] * n, torch.float16, kahan=False)[-1] == stall
    assert abs(running_sums([value] * n, torch.float16, kahan=True)[-1] - n * v16) <= 2 * describe(n * v16, FORMATS["fp16"])["gap_to_next"]


@pytest.mark.parametrize("settings_", one_at_a_time(FormatsConfig))
def test_defaults_and_each_choice_pass(settings_):
    result = experiments.run("numerics.formats", **settings_)
    assert result.passed, [c for c in result.checks if not c.passed]


def test_default_run_reproduces_the_seed_figures():
    m = experiments.run("numerics.formats").metrics
    assert m["swamping_fp16_result"] == 0.125 and m["fp16_plain_sum"] == 32.0 and m["fp16_kahan_sum"] == 100.0


@pytest.mark.parametrize("values, field", [
    ({"values": "1, 2, 3, 4, 5, 6, 7, 8, 9"}, "values"), ({"values": "1," * 150}, "values"),
    ({"values": "1, two"}, "values"), ({"values": " , "}, "values"), ({"n_terms": "100000"}, "n_terms"),
    ({"sum_values": "gaussian"}, "sum_values"), ({"small_value": "0"}, "small_value"),
])
def test_bad_inputs_name_the_field(values, field):
    assert_refused(FormatsConfig, values, field)


def test_page_draws_a_run():
    render_recorded("pages/number_formats.py", "numerics.formats", n_terms="200")


# --- mixed precision -------------------------------------------------------------------------------
from backend.experiments.numerics.mixed_precision import MixedPrecisionConfig  # noqa: E402
from backend.numerics.mixed_precision import DynamicLossScaler  # noqa: E402

SMALL_MP = dict(steps="12", batch="4", seq_len="16", count_every="2")


def test_loss_scaling_recovers_the_gradients_that_underflow_without_it():
    result = experiments.run("numerics.mixed_precision", **SMALL_MP)
    assert result.passed, [c for c in result.checks if not c.passed]
    summary = {r["mode"]: r for r in result.tables["summary"]}
    assert summary["fp16 no scaling"]["activation_underflow"] + summary["fp16 no scaling"]["param_underflow"] > 0
    for mode in ("fp16 static scaling", "fp16 dynamic scaling"):
        assert summary[mode]["activation_underflow"] + summary[mode]["param_underflow"] == 0


def test_dynamic_scaler_follows_gradscaler_on_a_given_overflow_pattern():
    """Feed GradScaler and ours the same inf/finite gradients; their scales agree step by step."""
    pattern = [True, True, False, False, False, True, False, False, False, False, False, True, False]
    ours = DynamicLossScaler(2.0 ** 10, growth_interval=3)
    peer = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=3)
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.0)
    for inf in pattern:
        peer.scale(torch.ones(()))  # GradScaler sets itself up on its first scale()
        p.grad = torch.tensor([math.inf if inf else 1.0])
        assert ours.scale == peer.get_scale()
        peer.step(opt)
        peer.update()
        ours.update(inf)
    assert ours.scale == peer.get_scale()


def test_a_wrong_scaler_is_caught():
    """Growing after growth_interval + 1 clean steps (an off-by-one) departs from GradScaler."""
    ours = DynamicLossScaler(2.0 ** 10, growth_interval=2)
    ours.growth_interval += 1
    peer = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=2)
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.0)
    scales = []
    for _ in range(4):
        peer.scale(torch.ones(()))
        p.grad = torch.ones(1)
        peer.step(opt)
        peer.update()
        ours.update(False)
        scales.append((ours.scale, peer.get_scale()))
    assert any(a != b for a, b in scales)


@pytest.mark.parametrize("settings_", one_at_a_time(MixedPrecisionConfig))
def test_mixed_precision_defaults_pass(settings_):
    result = experiments.run("numerics.mixed_precision", **settings_)
    assert result.passed, [c for c in result.checks if not c.passed]


@pytest.mark.parametrize("values, field", [({"steps": "1"}, "steps"), ({"init_scale_log2": "64"}, "init_scale_log2"),
                                           ({"growth_interval": "0"}, "growth_interval")])
def test_mixed_precision_bad_inputs_name_the_field(values, field):
    assert_refused(MixedPrecisionConfig, values, field)


def test_mixed_precision_page_draws_a_run():
    render_recorded("pages/mixed_precision.py", "numerics.mixed_precision", **SMALL_MP)


def _keeps_from_wrong(keeps_log2: float, scale_log2: int) -> bool:
    """Whether numpy's float16 disagrees that a gradient of 2^keeps survives the static scale 2^k and half of it does
    not (the cast rounds to nearest even: half the smallest subnormal rounds to zero)."""
    import numpy as np

    survives = np.float16(2.0 ** keeps_log2 * 2.0 ** scale_log2) != 0
    half_flushes = np.float16(2.0 ** (keeps_log2 - 1) * 2.0 ** scale_log2) == 0
    return not (survives and half_flushes)


def test_the_static_scales_survival_line_comes_from_the_result_and_old_runs_gain_it(monkeypatch):
    """The page's green line is the result's (pages only draw): numpy's float16 keeps a gradient there under the
    static scale and flushes half of it; a version 1 run gains it by the upgrade; a line at FP16's smallest normal fails."""
    from backend.experiments.numerics import mixed_precision as exp_mp
    from backend.result import VERSION_KEY

    result = experiments.run("numerics.mixed_precision", **SMALL_MP, static_scale_log2="10")
    assert not _keeps_from_wrong(result.metrics["static_scale_keeps_from_log2"], 10)
    stored = {**result.to_dict(), "config": {"static_scale_log2": 10}}
    del stored["metrics"]["static_scale_keeps_from_log2"], stored[VERSION_KEY]
    assert not _keeps_from_wrong(exp_mp.RESULT.upgrade(stored)["metrics"]["static_scale_keeps_from_log2"], 10)
    monkeypatch.setattr(exp_mp, "static_scale_keeps_from_log2", lambda k: math.log2(torch.finfo(torch.float16).tiny) - k)
    assert _keeps_from_wrong(exp_mp.RESULT.upgrade(stored)["metrics"]["static_scale_keeps_from_log2"], 10)
