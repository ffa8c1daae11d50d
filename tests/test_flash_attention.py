"""FlashAttention: Triton forward/backward in the interpreter vs SDPA (tails, causal), traffic counters vs the
closed form, the tiled PyTorch path, the seed's online-softmax example, the roofline arithmetic, bad inputs."""
import math

import pytest
import torch
import torch.nn.functional as F

import backend.attention.flash as flash_module
from backend import experiments
from backend.attention.flash import online_softmax_example, online_softmax_seed_error, sram_budget, tiled_attention
from backend.config import ConfigError
from backend.hardware.devices import ops_per_datum
from backend.hardware.roofline import attainable, gemm_intensity
from kernels.flash_attention import (TENSORS, closed_form_traffic, flash_attention, flash_backward, flash_forward,
                                     naive_attention, sdpa_reference)


@pytest.mark.parametrize("n, d, causal, bm, bn", [(40, 16, False, 16, 16), (40, 16, True, 16, 32), (33, 32, True, 32, 16)])
def test_triton_forward_backward_and_traffic(n, d, causal, bm, bn):
    g = torch.Generator().manual_seed(n)
    q, k, v, do = (torch.randn(1, 2, n, d, generator=g) for _ in range(4))
    counters = torch.zeros(len(TENSORS), dtype=torch.int64)
    o, lse = flash_forward(q, k, v, causal, bm, bn, counters)
    dq, dk, dv = flash_backward(q, k, v, o, lse, do, causal, bm, bn, counters)
    ref, ref_grads = sdpa_reference(q, k, v, causal, do)
    assert (o - ref).abs().max() < 1e-5
    for mine, theirs in zip((dq, dk, dv), ref_grads):
        assert (mine - theirs).abs().max() < 1e-4
    assert dict(zip(TENSORS, counters.tolist())) == closed_form_traffic(1, 2, n, d, 4, causal, bm, bn, backward=True)


def test_references_agree_and_a_wrong_kernel_is_caught():
    """naive == SDPA; the kernel run on a wrongly scaled input (a deliberate bug) fails the tolerance."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 1, 20, 16, generator=g) for _ in range(3))
    for causal in (False, True):
        naive, traffic = naive_attention(q, k, v, causal)
        assert (naive - sdpa_reference(q, k, v, causal)[0]).abs().max() < 1e-5
        assert traffic["S"] == 2 * 20 * 20 * 4
    wrong, _ = flash_forward(q * 1.01, k, v)
    assert (wrong - sdpa_reference(q, k, v)[0]).abs().max() > 1e-3


def test_autograd_function_in_fp16():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 1, 24, 16, generator=g).half().requires_grad_() for _ in range(3))
    out = flash_attention(q, k, v, True)
    out.float().sum().backward()
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    assert (out.float() - ref).abs().max() < 5e-3
    assert q.grad is not None and torch.isfinite(q.grad).all()


def test_traffic_closed_form_matches_the_io_picture():
    """Non-causal forward: Q and O once, K and V once per query tile."""
    t = closed_form_traffic(1, 1, 64, 16, 2, False, 16, 16)
    assert t["Q"] == t["O"] == 64 * 16 * 2 and t["K"] == t["V"] == 4 * 64 * 16 * 2 and t["dQ"] == 0


def test_tiled_path_equals_sdpa():
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 50, 16, generator=g) for _ in range(3))
    for causal in (False, True):
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        assert (tiled_attention(q, k, v, causal, 16, 32) - ref).abs().max() < 1e-5


def test_online_softmax_example_reproduces_the_seed():
    steps = online_softmax_example()
    assert steps[0]["m"] == 2 and steps[0]["l"] == pytest.approx(math.exp(-1) + 1)
    assert steps[1]["m"] == 4 and steps[1]["rescale_exp(m_old-m)"] == pytest.approx(math.exp(-2))
    final = steps[-1]
    assert final["l"] == pytest.approx(math.exp(-3) + math.exp(-2) + math.exp(-1) + 1)
    assert final["softmax"] == pytest.approx(final["reference_softmax"])
    error, _ = online_softmax_seed_error(steps)
    assert error < 1e-15


def _update_without_rescale(m, l, acc, scores, values):
    """A wrong online softmax: folds a block in under the new max without rescaling what came before."""
    m_new = torch.maximum(m, scores.max(dim=-1).values)
    p = torch.exp(scores - m_new[:, None])
    return m_new, l + p.sum(-1), acc + p @ values, p, torch.ones_like(m)


def test_the_online_softmax_run_check_fails_when_the_update_is_wrong(monkeypatch):
    """The run's seed-000 check is the one that catches a broken update (the kernels do not use it)."""
    name = "seed 000's online-softmax example"
    ok = experiments.run("attention.flash", seq_len=16, heads=1, block_m=16, block_n=16, backward=False)
    assert [c.passed for c in ok.checks if c.name.startswith(name)] == [True]
    monkeypatch.setattr(flash_module, "online_softmax_update", _update_without_rescale)
    error, detail = online_softmax_seed_error(online_softmax_example())
    assert error > 0.1 and "differ: e^(m(x1) - m(x)), f(x), l(x)" in detail
    broken = experiments.run("attention.flash", seq_len=16, heads=1, block_m=16, block_n=16, backward=False)
    assert [c.name for c in broken.checks if not c.passed] == [c.name for c in broken.checks if c.name.startswith(name)]
    assert len([c for c in broken.checks if not c.passed]) == 1


def test_sram_budget_follows_seed_003():
    b = sram_budget(100 * 1024, 64, 2)                 # 51,200 words, d = 64
    assert b["Bc"] == 200 and b["Br"] == 64            # ⌈M / 4d⌉ and min(that, d)
    d, bc = 64, 200
    assert b["steps"][2]["live_words"] == 3 * bc * d + 2 * d * (d + 1)   # the seed's total after computing S
    assert b["steps"][3]["live_words"] == 2 * bc * d + 2 * d * (d + 1) - (d * d + bc * d) + bc * d  # Q_i, K_j released
    assert b["steps"][-1]["live_words"] == 0 and len(b["steps"]) == 11  # the seed's eleven steps, all released
    assert b["peak_words"] == b["steps"][2]["live_words"]                # K, V, Q, O and S all live
    small = sram_budget(48 * 1024, 128, 4)
    assert small["Br"] == small["Bc"] == 24


@pytest.mark.parametrize("sram, d, elem, compared", [(100 * 1024, 64, 2, 9), (64 * 1024, 64, 4, 10), (48 * 1024, 128, 4, 1)])
def test_seed_003_ledger_every_step(sram, d, elem, compared):
    from backend.experiments.attention.flash import seed_003_ledger

    budget = sram_budget(sram, d, elem)  # Bc = 200, 64 (= d: step 4 compared too), 24 (< d: only step 1 applies)
    check, note = seed_003_ledger(budget, d)
    assert check.passed, check
    assert sum(st["seed_delta_words"] is not None for st in budget["steps"]) - (budget["Bc"] != d and budget["Br"] == d) == compared
    assert ("step 4" in note) == (budget["Br"] == d and budget["Bc"] != d)


def test_seed_003_ledger_fails_when_a_step_is_miscounted():
    from backend.experiments.attention.flash import seed_003_ledger

    budget = sram_budget(100 * 1024, 64, 2)
    budget["steps"][7]["delta_words"] -= 2 * budget["Br"]  # forget m_new and l_new at step 8
    assert not seed_003_ledger(budget, 64)[0].passed


def test_roofline_arithmetic_and_seed_ops_per_datum():
    assert attainable(100e12, 1e12, 10) == 10e12 and attainable(100e12, 1e12, 1000) == 100e12
    assert gemm_intensity(1024, 1024, 1024, 2) == pytest.approx(2 * 1024 ** 3 / (3 * 1024 ** 2 * 2))
    opd = ops_per_datum("A100 (80 GB SXM)")
    assert opd["L1 / shared"] == pytest.approx(8, rel=0.01) and opd["PCIe 4"] == pytest.approx(6240)


def test_experiments_pass_their_checks():
    flash = experiments.run("attention.flash", seq_len=48, heads=1, block_m=16, block_n=16, causal=True)
    assert flash.passed, [c for c in flash.checks if not c.passed]
    assert flash.tables["tile_steps"]
    peak = max(row["live_words"] for row in flash.tables["sram_budget"])  # the page's share: the ledger's peak over M
    assert flash.metrics["sram.peak_share"] == pytest.approx(peak / flash.metrics["sram.words"]) and 0 < peak <= flash.metrics["sram.words"]
    tiled = experiments.run("attention.flash", impl="tiled", backward=False, seq_len=300, heads=1)
    assert tiled.passed


@pytest.mark.parametrize("values, field", [
    ({"head_dim": "7"}, "head_dim"), ({"block_m": "24"}, "block_m"), ({"seq_len": "0"}, "seq_len"),
    ({"dtype": "bfloat16"}, "dtype"), ({"block_n": "256"}, "block_n"), ({"seq_len": "4096"}, "seq_len"),
])
def test_bad_inputs(values, field):
    if field == "dtype" and torch.cuda.is_available():
        pytest.skip("bfloat16 is allowed on a GPU")
    with pytest.raises(ConfigError) as info:
        experiments.get("attention.flash").make_config(values)
    assert info.value.field == field


def test_kernel_rejects_bad_shapes_directly():
    q = torch.randn(1, 1, 8, 24)
    with pytest.raises(ValueError, match="head_dim 24"):
        flash_forward(q, q, q)
    with pytest.raises(ValueError, match="bfloat16"):
        x = torch.randn(1, 1, 8, 16, dtype=torch.bfloat16)
        flash_forward(x, x, x)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_fp16_and_bf16_against_sdpa():
    for dtype in (torch.float16, torch.bfloat16):
        q, k, v = (torch.randn(2, 4, 1024, 64, device="cuda", dtype=dtype) for _ in range(3))
        out = flash_attention(q, k, v, True, 64, 64)
        ref32 = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
        same = F.scaled_dot_product_attention(q, k, v, is_causal=True).float()
        assert (out.float() - ref32).abs().max() <= 2 * (same - ref32).abs().max() + 1e-3


def _grid_off(grid: list[dict], n: int, bm: int, bn: int, causal: bool) -> int:
    """Tiles whose step differs from numpy's schedule: a tile is computed when some key in it is at or before some query
    in it (any key without the causal mask), in row-major order (Q tiles outer, K/V tiles inner); None where skipped."""
    import numpy as np

    n_q, n_k = -(-n // bm), -(-n // bn)
    i, j = np.meshgrid(np.arange(n_q), np.arange(n_k), indexing="ij")
    computed = (j * bn <= np.minimum((i + 1) * bm, n) - 1) | (not causal)
    steps = np.where(computed, np.cumsum(computed.ravel()).reshape(computed.shape) - 1, -1)
    want = {(a, b): None if steps[a, b] < 0 else int(steps[a, b]) for a in range(n_q) for b in range(n_k)}
    got = {(t["q_tile"], t["kv_tile"]): t["step"] for t in grid}
    return sum(got.get(key, "absent") != step for key, step in want.items()) + len(set(got) - set(want))


def test_the_tile_grid_comes_from_the_result_and_old_runs_gain_it(monkeypatch):
    """The page's tile grid is the result's (pages only draw), equal to numpy's causal schedule; a version 3 run gains it
    by the upgrade; a grid that skips no tile under the causal mask fails."""
    from backend.experiments.attention import flash as exp_flash
    from backend.result import VERSION_KEY

    settings = dict(seq_len=40, heads=1, block_m=16, block_n=16, causal=True, impl="tiled", backward=False)
    result = experiments.run("attention.flash", **settings)
    assert _grid_off(result.tables["tile_grid"], 40, 16, 16, True) == 0
    assert any(t["step"] is None for t in result.tables["tile_grid"])
    stored = {**result.to_dict(), "config": experiments.get("attention.flash").make_config(settings).to_dict()}
    del stored["tables"]["tile_grid"]
    stored[VERSION_KEY] = 3
    assert _grid_off(exp_flash.RESULT.upgrade(stored)["tables"]["tile_grid"], 40, 16, 16, True) == 0
    right = exp_flash.tile_grid
    monkeypatch.setattr(exp_flash, "tile_grid", lambda steps, n, bm, bn: [
        dict(t, step=t["step"] if t["step"] is not None else 0) for t in right(steps, n, bm, bn)])
    assert _grid_off(exp_flash.RESULT.upgrade(stored)["tables"]["tile_grid"], 40, 16, 16, True) > 0
