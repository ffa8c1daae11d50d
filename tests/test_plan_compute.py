"""The planner's compute model (backend/plan/compute.py): the GEMM list against the FLOP formula FlopCounterMode
confirms, the wave share against a tile-by-tile enumeration, the eager elementwise bytes against torch's own
dispatched ops on torchtitan's eager Llama block, and the published rows the model moved (each check with a test
that fails when its rule is broken)."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from backend.plan import compute as C
from backend.plan import models as M
from backend.plan import published
from backend.plan.clusters import GPUS


# ---- the GEMM list carries exactly the FLOPs of the formula -------------------------------------------------------
def _gemm_flops(model, tokens, t, ep):
    share = model.moe_layers / model.layers
    def one(moe):
        return sum(2 * m * n * k * c for m, n, k, c in C.layer_gemms(model, tokens, t, ep, moe))
    return (1 - share) * one(False) + share * (one(True) if share else 0.0)


@pytest.mark.parametrize("name, t, ep", [("llama-3-8b", 1, 1), ("llama-3-70b", 8, 1), ("megatron-gpt-175b", 8, 1),
                                         ("mixtral-8x7b", 2, 4), ("deepseek-v3", 1, 8)])
def test_layer_gemms_carry_the_formulas_flops(name, t, ep):
    """Σ 2·M·N·K over a layer's forward GEMMs on one GPU × t = a third of the formula's linear FLOPs per layer (head
    apart) × tokens: the formula models.training_flops_per_token, itself checked against FlopCounterMode."""
    model, tokens = M.load(name), 8192
    per_tok = M.training_flops_per_token(model, 8192)["linear"] - 6.0 * model.vocab * model.hidden
    want = tokens * per_tok / model.layers / 3
    assert _gemm_flops(model, tokens, t, ep) * t == pytest.approx(want, rel=2e-3 if model.experts else 1e-12)


def test_gemm_flops_check_fails_without_the_kv_projections(monkeypatch):
    model = M.load("llama-3-8b")
    want = 8192 * (M.training_flops_per_token(model, 8192)["linear"] - 6.0 * model.vocab * model.hidden) / model.layers / 3
    real = C.layer_gemms
    monkeypatch.setattr(C, "layer_gemms", lambda *a: [g for g in real(*a) if g[3] != 2 or g[1] == model.ffn])  # k, v dropped
    assert _gemm_flops(model, 8192, 1, 1) != pytest.approx(want, rel=1e-3)


# ---- the wave share against an enumeration of tiles ---------------------------------------------------------------
def _enumerated_share(M_, N, sms, tm, tn):
    """Hand the tiles to the SMs one at a time in rounds: useful multiply-adds over the rounds' SM-slots."""
    tiles = [(min(tm, M_ - i), min(tn, N - j)) for i in range(0, M_, tm) for j in range(0, N, tn)]
    rounds = [tiles[i:i + sms] for i in range(0, len(tiles), sms)]
    useful = sum(a * b for r in rounds for a, b in r)
    return useful / (len(rounds) * sms * tm * tn)


@pytest.mark.parametrize("M_, N, sms", [(8192, 1024, 108), (8192, 4096, 132), (2048, 4608, 108), (16384, 14336, 132), (300, 700, 108)])
def test_wave_share_equals_an_enumeration(M_, N, sms):
    for tm, tn in C.TILES:
        assert C.wave_share(M_, N, sms, tm, tn) == pytest.approx(_enumerated_share(M_, N, sms, tm, tn), rel=1e-12)


def test_wave_share_check_fails_without_the_last_waves_padding(monkeypatch):
    monkeypatch.setattr(math, "ceil", lambda x: x)   # fractional waves: the last wave's empty SMs forgotten
    assert C.wave_share(8192, 1024, 108, 256, 128) != pytest.approx(_enumerated_share(8192, 1024, 108, 256, 128), rel=1e-3)


def test_whole_waves_of_large_tiles_run_at_the_fitted_share_and_skinny_gemms_at_hbm():
    """A GEMM that 256×128 tiles fill in whole waves runs at peak × efficiency (its L2 feed above that roof); a
    16-row one is memory-bound: its bytes over HBM (the roofline)."""
    gpu = GPUS["H100 SXM 80GB"]
    M_, N = 256 * gpu.sms, 128 * 64                                 # 132 × 64 tiles: 64 whole waves
    assert 2 * 256 * 128 / (2 * (256 + 128)) * gpu.l2_bw > 0.7 * gpu.bf16_flops
    wide = C.gemm_seconds(M_, N, 8192, gpu.sms, gpu.bf16_flops, gpu.hbm_bw, 0.7, gpu.l2_bw)
    assert wide == pytest.approx(2 * M_ * N * 8192 / (gpu.bf16_flops * 0.7), rel=1e-12)
    skinny = C.gemm_seconds(16, 8192, 8192, gpu.sms, gpu.bf16_flops, gpu.hbm_bw, 0.7, gpu.l2_bw)
    assert skinny == pytest.approx((16 * 8192 + 8192 * 8192 + 16 * 8192) * 2 / gpu.hbm_bw, rel=1e-12)


def test_small_tiles_are_fed_slower_than_large_ones():
    """The tile roof: 64×64 tiles (32 FLOP per L2 byte) run below the fitted share on an A100, 256×128 (85) do not;
    with the L2 roof removed the small tile would win the 8B's 8192×1024 GEMM outright."""
    gpu = GPUS["A100 80GB SXM"]
    peak_eff = 0.6 * gpu.bf16_flops
    assert gpu.l2_bw * 32 < peak_eff < gpu.l2_bw * 2 * 256 * 128 / (2 * 384)
    with_roof = C.tile_rate(8192, 1024, gpu.sms, peak_eff, gpu.l2_bw)
    without = C.tile_rate(8192, 1024, gpu.sms, peak_eff, 1e30)
    assert with_roof < without


# ---- eager elementwise bytes against torch's dispatched ops ------------------------------------------------------
_VIEWS = {"view", "_unsafe_view", "expand", "transpose", "t", "unsqueeze", "view_as_complex", "view_as_real", "reshape",
          "permute", "detach", "alias", "slice", "select", "squeeze", "as_strided", "_reshape_alias"}


class _Bytes(TorchDispatchMode):
    """Bytes every non-matmul, non-attention, non-view aten op reads and writes (its tensors' sizes)."""
    def __init__(self):
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func._schema.name.split("::")[1]
        if name in _VIEWS or name in ("mm", "addmm", "bmm", "randn_like") or "dot_product" in name:
            return out
        tensors = [a for a in tree_flatten((args, kwargs))[0] + tree_flatten(out)[0] if isinstance(a, torch.Tensor)]
        self.total += sum(a.numel() * a.element_size() for a in tensors)
        return out


def _rmsnorm(x, w, eps=1e-6):
    """torchtitan's RMSNorm (torchtitan/models/norms.py at 9dec370, the Dec 2024 benchmark's commit)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).type_as(x) * w


def _rope(xq, xk, freqs):
    """torchtitan's apply_rotary_emb (torchtitan/models/llama/model.py at 9dec370)."""
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs = freqs.view(1, xq_.shape[1], 1, xq_.shape[-1])
    return torch.view_as_real(xq_ * freqs).flatten(3).type_as(xq), torch.view_as_real(xk_ * freqs).flatten(3).type_as(xk)


def _eager_block(x, w, freqs, a, kv, d):
    """torchtitan's TransformerBlock.forward in eager PyTorch: norm, q/k/v, RoPE, repeat_kv, SDPA, o, residual, norm,
    SwiGLU, residual."""
    b, s, _ = x.shape
    n = _rmsnorm(x, w["n1"])
    xq, xk, xv = (n @ w["q"]).view(b, s, a, d), (n @ w["k"]).view(b, s, kv, d), (n @ w["v"]).view(b, s, kv, d)
    xq, xk = _rope(xq, xk, freqs)
    rep = a // kv
    k, v = (z.unsqueeze(3).expand(b, s, kv, rep, d).reshape(b, s, a, d) for z in (xk, xv))
    o = F.scaled_dot_product_attention(xq.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
    h = x + o.transpose(1, 2).contiguous().view(b, s, -1) @ w["o"]
    n2 = _rmsnorm(h, w["n2"])
    return h + (F.silu(n2 @ w["w1"]) * (n2 @ w["w3"])) @ w["w2"]


def _measured(h=256, a=8, kv=2, f=512, s=64):
    torch.manual_seed(0)
    d, dt = h // a, torch.bfloat16
    shapes = {"n1": (h,), "n2": (h,), "q": (h, a * d), "k": (h, kv * d), "v": (h, kv * d), "o": (a * d, h),
              "w1": (h, f), "w3": (h, f), "w2": (f, h)}
    w = {k: torch.randn(*sh, dtype=dt, requires_grad=True) for k, sh in shapes.items()}
    freqs = torch.polar(torch.ones(s, d // 2), torch.randn(s, d // 2))
    x = torch.randn(1, s, h, dtype=dt, requires_grad=True)
    with _Bytes() as fwd:
        y = _eager_block(x, w, freqs, a, kv, d)
    grad = torch.randn_like(y)
    with _Bytes() as bwd:
        y.backward(grad)
    spec = M.ModelSpec("tiny", hidden=h, layers=1, heads=a, kv_heads=kv, head_dim=d, ffn=f, vocab=8)
    return fwd.total / s, bwd.total / s, spec


def test_eager_elementwise_bytes_equal_torchs_dispatched_ops():
    """Per token: the model's eager bytes within 5% of what torch's ops on torchtitan's eager block read and write
    (the rest: the norm weights and RoPE's table, read per call); the backward about twice the forward."""
    fwd, bwd, spec = _measured()
    assert C.elementwise_bytes(spec, 1, False, fused=False) == pytest.approx(fwd, rel=0.05)
    assert bwd / fwd == pytest.approx(C.BACKWARD_FACTOR, rel=0.1)


def test_elementwise_check_fails_for_a_bf16_rmsnorm_rule(monkeypatch):
    """Count the RMSNorm as one bf16 read and write (4 bytes, not 36) and the eager count no longer matches."""
    fwd, _, spec = _measured()
    real = C.elementwise_bytes
    monkeypatch.setattr(C, "elementwise_bytes", lambda m, t, sp, fused: real(m, t, sp, fused) - 2 * (36 - 4) * m.hidden)
    assert C.elementwise_bytes(spec, 1, False, fused=False) != pytest.approx(fwd, rel=0.05)


# ---- what the model moved on the published rows --------------------------------------------------------------------
def _rows():
    return {r["row"]: r for r in published.errors(published.fit())}


def test_torch_compile_rows_predicted_from_the_eager_fit():
    """torchtitan's FSDP + torch.compile rows (Tables 1 and 3) are validation: the constants fitted on the eager
    8-GPU row, only the elementwise bytes fused; the predicted speed-up is the published one within 10%."""
    by = _rows()
    for n in (1, 128):
        eager = by[f"torchtitan 8B, {n if n > 1 else 8} H100: tokens/s/GPU"]
        comp = by[f"torchtitan 8B, {n if n > 1 else 8} H100, torch.compile: tokens/s/GPU"]
        assert comp["role"] == "validation" and comp["within"]
        assert comp["predicted"] / eager["predicted"] == pytest.approx(comp["published"] / eager["published"], rel=0.1)


def test_compile_rows_miss_when_the_elementwise_ops_cost_nothing(monkeypatch):
    """Without the elementwise term, eager and compiled predict the same speed: the 15.7% published gap is lost."""
    published.fit.cache_clear()
    monkeypatch.setattr(C, "elementwise_bytes", lambda *a: 0.0)
    try:
        by = _rows()
    finally:
        published.fit.cache_clear()
    comp, eager = by["torchtitan 8B, 8 H100, torch.compile: tokens/s/GPU"], by["torchtitan 8B, 8 H100: tokens/s/GPU"]
    assert comp["predicted"] / eager["predicted"] != pytest.approx(comp["published"] / eager["published"], rel=0.1)


def test_70b_a100_rows_within_ten_percent_and_wider_gemms_run_nearer_the_roof():
    """Issue #28's two 70B rows on 64 A100 (-11.5% and -10.8% with one efficiency per family) are within 10% once each
    GEMM's tiles, waves and L2 feed are modelled: the 70B's GEMMs run nearer the fitted roof than the 8B's, and the
    calibration row's (GPT-3, TP-8 shards of 2,048 tokens) farthest from it, so the fitted roof itself rises."""
    by = _rows()
    for name in ("torchtitan Llama 3 70B, 64 A100: tokens/s/GPU", "torchtitan Llama 2 70B, 64 A100: tokens/s/GPU"):
        assert by[name]["role"] == "validation" and by[name]["within"], by[name]
    gpu = GPUS["A100 80GB SXM"]

    def share(name, tokens=8192, t=1):
        m = M.load(name)
        fwd, bwd = C.linear_seconds(m, tokens, t, 1, gpu, gpu.bf16_flops, 0.6)
        flops = 3 * sum(2 * a * b * c * k for a, b, c, k in C.layer_gemms(m, tokens, t, 1, False))
        return flops / (fwd + bwd) / (0.6 * gpu.bf16_flops)
    assert share("llama-3-70b") > share("llama-3-8b") > share("gpt-3-175b", 2048, 8) + 0.03


def test_dp128_row_tests_the_bubble_not_the_fitted_constant():
    """The DP-128 row against the 8,192-GPU calibration row: the Hopper constant cancels (±20% of it moves the
    prediction by about 1%, the published rows differ by 7%); v, which the paper does not print, moves it (v = 2 misses
    by more than 10%)."""
    import dataclasses
    eff = published.fit()
    rows = {r.name: r for r in published.ROWS}
    cal, val = rows[published._CAL_L3], rows[published.DP128]
    ratios = [published.predict_row(val, dataclasses.replace(eff, hopper=h)) / published.predict_row(cal, dataclasses.replace(eff, hopper=h))
              for h in (0.8 * eff.hopper, 1.2 * eff.hopper)]
    assert ratios[0] == pytest.approx(ratios[1], rel=0.02)
    by_v = {r["virtual stages"]: r["error"] for r in published.dp128_by_virtual_stages(eff)}
    assert abs(by_v[8]) < 0.10 < abs(by_v[2])


def test_500w_account_bounds_the_power_cap_by_the_nvl_peak():
    acc = published.hopper_500w_account(published.fit())
    assert acc["power cap at most (NVL ÷ SXM peak)"] == pytest.approx(835.5 / 989, rel=1e-3)
    assert acc["unexplained factor"] == pytest.approx(acc["fitted 500 W ÷ 700 W"] / acc["power cap at most (NVL ÷ SXM peak)"])
