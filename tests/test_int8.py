"""numerics.int8: INT8 weights, W8A8 with INT32 accumulation and an INT8 KV cache on the trained tiny LLaMA; each check
against an independent reference, and each failing when its rule is broken."""
import numpy as np
import pytest
import torch

from backend import experiments
from backend.experiments.numerics import int8 as exp_int8
from backend.numerics import int8
from tests.sweep import assert_refused, one_at_a_time

FAST = {"steps": 30, "gemm_k": 4096, "new_tokens": 8}


def _failed(result, words: str) -> bool:
    hits = [c for c in result.checks if words in c.name]
    assert hits, words
    return any(not c.passed for c in hits)


def test_defaults_and_every_choice_pass():
    cls = experiments.get("numerics.int8").config_cls
    for change in one_at_a_time(cls):
        result = experiments.run("numerics.int8", **{**FAST, **change})
        assert result.passed, (change, [c for c in result.checks if not c.passed])


def test_figures():
    r = experiments.run("numerics.int8", **FAST)
    m = r.metrics
    assert m["weight_bytes.int8"] < 0.35 * m["weight_bytes.fp32"]
    assert m["kv_bytes_per_token.int8"] / m["kv_bytes_per_token.fp32"] == pytest.approx((16 + 4) / 64)
    assert m["kv_bytes_change_pct"] == pytest.approx(100 * ((16 + 4) / 64 - 1), abs=0.05)  # the page's delta, from the result
    w8a8 = next(row for row in r.tables["models"] if row["model"] == "w8a8")
    assert m["w8a8_loss_change_nats"] == pytest.approx(w8a8["loss_increase"], abs=1e-4)
    assert m["largest_abs_sum"] > 2 ** 24 and m["fp32_accumulation_wrong_elements"] > 0  # the GEMM check can tell


def test_int32_gemm_is_exact_small():
    a = torch.tensor([[127, -128 + 1], [5, 7]], dtype=torch.int8)
    b = torch.tensor([[127, 127], [-3, 2]], dtype=torch.int8)
    got = int8.int8_matmul(a, b)
    exact = [[sum(int(x) * int(y) for x, y in zip(row, col)) for col in b.tolist()] for row in a.tolist()]
    assert got.dtype == torch.int32 and got.tolist() == exact


def test_gemm_check_fails_with_float32_accumulation(monkeypatch):
    monkeypatch.setattr(exp_int8, "int8_matmul", lambda a, b: (a.float() @ b.float().t()).to(torch.int32))
    result = experiments.run("numerics.int8", **FAST)
    assert _failed(result, "exact integer arithmetic")


def test_per_channel_check_fails_with_truncation(monkeypatch):
    def truncating(x):
        scale = (x.abs().amax(dim=-1, keepdim=True).float() / 127).clamp(min=1e-30)
        return torch.trunc(x / scale).clamp(-127, 127).to(torch.int8), scale

    monkeypatch.setattr(exp_int8, "quantize_rows", truncating)
    result = experiments.run("numerics.int8", **FAST)
    assert _failed(result, "torch.quantize_per_channel")


def test_loss_check_fails_with_a_wrong_scale(monkeypatch):
    real = int8.Int8Linear.__init__

    def skewed(self, linear, mode):
        real(self, linear, mode)
        self.scale *= 1.3

    monkeypatch.setattr(int8.Int8Linear, "__init__", skewed)
    result = experiments.run("numerics.int8", **FAST)
    assert _failed(result, "held-out loss within")


def test_kv_byte_check_fails_without_the_scales(monkeypatch):
    monkeypatch.setattr(int8.Int8KVCache, "bytes_per_token",
                        lambda self: sum(self.tensors[n][0].nbytes for n in self.names))
    result = experiments.run("numerics.int8", **FAST)
    assert _failed(result, "KV cache bytes per token")


def test_kv_error_check_fails_when_the_cache_keeps_4_bits(monkeypatch):
    real = int8.quantize_rows

    def four_bits(x):
        q, s = real(x)
        return (torch.round(q.float() / 16) * 16).clamp(-127, 127).to(torch.int8), s

    monkeypatch.setattr(int8, "quantize_rows", four_bits)
    result = experiments.run("numerics.int8", **FAST)
    assert _failed(result, "INT8 KV cache: generation")


def test_rounding_bound_and_range():
    w = torch.randn(32, 48, dtype=torch.float64)
    q, s = int8.quantize_rows(w)
    assert q.abs().max() <= 127 and (q.abs().amax(dim=1) == 127).all()
    assert np.all(np.abs(w.numpy() - q.double().numpy() * s.double().numpy()) <= s.double().numpy() / 2 * (1 + 1e-6))


def test_bad_input_is_refused_by_name():
    cls = experiments.get("numerics.int8").config_cls
    assert_refused(cls, {"gemm_k": 100}, "gemm_k")
    assert_refused(cls, {"steps": 0}, "steps")


def _error_bars_off(rows: list[dict]) -> float:
    """The largest gap between the models table's error bar and pandas' held-out loss ∓ one standard error."""
    import pandas as pd

    t = pd.DataFrame(rows)
    return float(max((t["loss_low"] - (t["held_out_loss"] - t["stderr"])).abs().max(),
                     (t["loss_high"] - (t["held_out_loss"] + t["stderr"])).abs().max()))


def test_the_loss_error_bars_come_from_the_result_and_old_runs_gain_them(monkeypatch):
    """The page draws loss ± one standard error from the result (pages only draw): equal to pandas' sums, the standard
    error itself equal to numpy's (float64, ddof 1) over the held-out tokens; a version 2 run gains the bars by the
    upgrade; bars of two standard errors fail."""
    from backend.models.corpus import MarkovCorpus, held_out_loss
    from backend.result import VERSION_KEY

    corpus = MarkovCorpus(32, 0)
    model = exp_int8.train(exp_int8.SHAPE, corpus, 3, 0)
    seqs = corpus.sample(8, 17, torch.Generator().manual_seed(1))
    loss, se, logits = held_out_loss(model, seqs)
    z = logits.double().numpy()
    logp = z - z.max(-1, keepdims=True) - np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True))
    nll = -np.take_along_axis(logp, seqs[:, 1:].numpy()[..., None], -1).ravel()
    assert loss == pytest.approx(nll.mean(), rel=1e-5) and se == pytest.approx(nll.std(ddof=1) / np.sqrt(nll.size), rel=1e-4)

    result = experiments.run("numerics.int8", **FAST)
    assert _error_bars_off(result.tables["models"]) < 1e-12
    stored = result.to_dict()
    for row in stored["tables"]["models"]:
        del row["loss_low"], row["loss_high"]
    stored[VERSION_KEY] = 2
    assert _error_bars_off(exp_int8.RESULT.upgrade(stored)["tables"]["models"]) < 1e-12

    def two_errors(rows):
        for r in rows:
            r["loss_low"], r["loss_high"] = r["held_out_loss"] - 2 * r["stderr"], r["held_out_loss"] + 2 * r["stderr"]
        return rows
    monkeypatch.setattr(exp_int8, "loss_bars", two_errors)
    assert _error_bars_off(exp_int8.RESULT.upgrade(stored)["tables"]["models"]) > 1e-4
    assert _error_bars_off(experiments.run("numerics.int8", **FAST).tables["models"]) > 1e-4
