"""numerics.int8: INT8 inference on the tiny LLaMA, trained here so its loss means something.

Measured: the weights' bytes in fp32 and INT8 (with their per-channel scales); the held-out loss and the logits of
weight-only INT8 (W8) and INT8 x INT8 -> INT32 (W8A8, per-token activation scales) against fp32; generation with an
INT8 KV cache (per token and head scales) against the fp32 cache: bytes per token and the logits' error. Checks: an
INT32 GEMM of full-range int8 operands equals exact int64 arithmetic (numpy); our per-channel integers equal
torch.quantize_per_channel's; a W8A8 layer equals float64 arithmetic on its dequantised operands; the cache's bytes
per token read off its tensors equal the formula; the quantised losses stay near fp32 and above the corpus's entropy rate.
"""
from __future__ import annotations

import copy
import dataclasses

import numpy as np
import torch
import torch.nn.functional as F

from backend.config import Config, setting
from backend.limits import DYNAMO_IMPORT_S, cost
from backend.experiments import define
from backend.experiments.decoding.speculative import train
from backend.models.corpus import MarkovCorpus, held_out_loss
from backend.numerics.int8 import Int8KVCache, Int8Linear, int8_matmul, quantize_model, quantize_rows, weight_bytes
from backend.result import Check, Result, Schema, error_bars

SHAPE = dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=4, d_head=16, d_ff=128)


@dataclasses.dataclass
class Int8Config(Config):
    steps: int = setting(150, min=10, max=1000, help="training steps of the fp32 model before it is quantised")
    vocab: int = setting(32, min=8, max=256, help="vocabulary of the Markov-chain corpus")
    keep_head: bool = setting(True, help="keep the output head in float (seed 002: the last layer in FP16)")
    gemm_k: int = setting(4096, choices=(256, 1024, 4096, 16384), help="inner dimension of the exact INT32 GEMM check")
    new_tokens: int = setting(48, min=4, max=256, help="tokens generated with the fp32 and the INT8 KV cache")
    loss_tolerance: float = setting(0.02, min=0.001, max=1.0, help="nats the quantised held-out loss may exceed fp32's")
    seed: int = setting(0, min=0, max=2**31 - 1, help="corpus and weights")

    cost_drivers = ("steps", "gemm_k", "new_tokens")

    def estimate(self):
        """`steps` AdamW steps on 8 × 32 tokens (their flops dominate: 5 s of CPU at the defaults, 6.8 s for 200 steps over
        256 tokens measured; AdamW imports torch._dynamo), three
        held-out passes, two generations, and the 64 × k × 256 GEMM with its int64 reference."""
        weights = SHAPE["n_layers"] * (4 * 64 * 64 + 3 * 64 * 128) + 2 * self.vocab * 64
        return cost(data_bytes=(64 + 256) * self.gemm_k * 16 + 8 * 64 * 32 * self.vocab * 4,  # int8, float32 and int64 copies
                    flops=(6 * weights * 256 * self.steps + 2 * 64 * self.gemm_k * 256 * 3) / 2,  # ~1e10 a CPU second measured
                    ops=100 * self.steps + 50 * self.new_tokens * 2 + 2000, seconds=DYNAMO_IMPORT_S)


def exact_gemm_check(k: int, seed: int) -> tuple[Check, dict]:
    """Large int8 operands (64 × k and 256 × k) whose products along k share one random sign per row of b, so the sums
    grow like k·96² (past 2^24, where float32 stops holding every integer, from k ≈ 1,800): torch's INT32 GEMM
    against numpy int64, element by element."""
    g = torch.Generator().manual_seed(seed)
    sign = torch.randint(0, 2, (k,), generator=g) * 2 - 1
    a = (torch.randint(64, 128, (64, k), generator=g) * sign).to(torch.int8)
    b = (torch.randint(64, 128, (256, k), generator=g) * sign * (torch.randint(0, 2, (256, 1), generator=g) * 2 - 1)).to(torch.int8)
    got = int8_matmul(a, b)
    exact = a.numpy().astype(np.int64) @ b.numpy().astype(np.int64).T
    wrong = int((got.numpy().astype(np.int64) != exact).sum())
    f32 = (a.float() @ b.float().t()).double().numpy()
    return (Check(f"INT8 x INT8 -> INT32 GEMM (64 × {k} × 256) = exact integer arithmetic", wrong, 0,
                  reference="numpy int64 matmul of the same int8 arrays",
                  detail=f"{wrong} of {exact.size} elements differ; largest |sum| {np.abs(exact).max():,} "
                         f"(2^31 = {2**31:,}); dtype {got.dtype}"),
            {"gemm_k": k, "largest_abs_sum": int(np.abs(exact).max()), "int32_max": 2**31 - 1,
             "fp32_accumulation_wrong_elements": int((f32 != exact).sum())})


def per_channel_check(model) -> Check:
    """Our INT8 weights against torch.quantize_per_channel with the same scales and zero points of 0."""
    import warnings

    warnings.filterwarnings("ignore", message="torch.quantize_per_tensor, torch.quantize_per_channel")  # deprecated, still the reference
    wrong = total = 0
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            q, scale = quantize_rows(m.weight.detach())
            ref = torch.quantize_per_channel(m.weight.detach(), scale[:, 0].double(), torch.zeros(len(scale), dtype=torch.long),
                                             0, torch.qint8).int_repr()
            wrong, total = wrong + int((q != ref).sum()), total + q.numel()
    return Check("per-channel INT8 weights = torch.quantize_per_channel's", wrong, 0,
                 reference="torch.quantize_per_channel(w, max|w_j|/127, 0, axis 0, qint8).int_repr()",
                 detail=f"{wrong} of {total} integers differ")


def w8a8_layer_check(model, x: torch.Tensor) -> Check:
    """One W8A8 layer against float64 arithmetic on its dequantised operands."""
    linear = model.blocks[0].ffn.up
    layer = Int8Linear(linear, "w8a8")
    x = x.detach()
    qx, sx = quantize_rows(x)
    ref = (qx.double() * sx.double()) @ (layer.qweight.double() * layer.scale.double()[:, None]).t()
    with torch.no_grad():
        got = layer(x).double()
    err = float((got - ref).abs().max() / ref.abs().max())
    return Check("W8A8 layer = float64 on its dequantised operands", err, 1e-6,
                 reference="float64 matmul of qx·s_x and qw·s_w", detail=f"max |Δ| / max |y| = {err:.2e}")


def generate(model, prompt: torch.Tensor, new_tokens: int, caches) -> torch.Tensor:
    """Greedy generation with the given caches; returns the logits of every generated position (new_tokens, vocab)."""
    out, tok = [], None
    with torch.no_grad():
        logits = model(prompt, 0, caches)[-1]
        for i in range(new_tokens):
            out.append(logits)
            tok = logits.argmax()[None]
            logits = model(tok, len(prompt) + i, caches)[-1]
    return torch.stack(out)


def kv_cache_rows(model, prompt: torch.Tensor, new_tokens: int) -> tuple[list[dict], Check, Check]:
    max_len = len(prompt) + new_tokens
    fp32_caches = model.new_caches(max_len)
    int8_caches = [Int8KVCache(max_len, {"k": (b.attn.n_kv_heads, b.attn.d_head), "v": (b.attn.n_kv_heads, b.attn.d_head)},
                               torch.float32) for b in model.blocks]
    ref, got = generate(model, prompt, new_tokens, fp32_caches), generate(model, prompt, new_tokens, int8_caches)
    rel = float((got - ref).abs().max() / ref.abs().max())
    agree = float((got.argmax(-1) == ref.argmax(-1)).float().mean())
    kl = float(F.kl_div(F.log_softmax(got, -1), F.log_softmax(ref, -1), log_target=True, reduction="batchmean"))
    n_kv, d_h, layers = model.shape.n_kv_heads, model.shape.d_head, model.shape.n_layers
    rows = [{"cache": "fp32", "bytes_per_token": sum(c.bytes_per_token() for c in fp32_caches), "formula": 2 * n_kv * d_h * 4 * layers,
             "max_rel_logit_error": 0.0, "greedy_agreement": 1.0, "kl_nats": 0.0},
            {"cache": "int8 (+ fp32 scales)", "bytes_per_token": sum(c.bytes_per_token() for c in int8_caches),
             "formula": (2 * n_kv * d_h * 1 + 2 * n_kv * 4) * layers, "max_rel_logit_error": rel, "greedy_agreement": agree,
             "kl_nats": kl}]
    byte_check = Check("INT8 KV cache bytes per token, read off its tensors = 2·n_kv·d_h·1 + 2·n_kv·4 per layer",
                       max(abs(r["bytes_per_token"] - r["formula"]) for r in rows), 0, reference="the cache tensors' sizes",
                       detail=f"{rows[1]['bytes_per_token']} B vs fp32 {rows[0]['bytes_per_token']} B per token")
    kl_check = Check("INT8 KV cache: generation's next-token distributions near the fp32 cache's (KL, nats)", kl, 1e-6,
                     reference="the same greedy generation with the fp32 cache",
                     detail=f"max relative logit error {rel:.2e}; greedy tokens agree on {agree:.0%}")
    return rows, byte_check, kl_check


def run(config: Int8Config, ctx) -> Result:
    torch.set_num_threads(1)
    corpus = MarkovCorpus(config.vocab, config.seed)
    ctx.progress(0.05, "training the fp32 model")
    model = train(SHAPE, corpus, config.steps, config.seed)
    seqs = corpus.sample(64, 33, torch.Generator().manual_seed(config.seed + 999))
    ctx.progress(0.6, "quantising")
    loss32, se32, logits32 = held_out_loss(model, seqs)
    gemm, gemm_info = exact_gemm_check(config.gemm_k, config.seed)
    checks = [gemm, per_channel_check(model),
              w8a8_layer_check(model, model.blocks[0].ffn_norm(model.embed(seqs[0]).detach()))]
    rows = [{"model": "fp32", "weight_bytes": weight_bytes(model), "held_out_loss": loss32, "stderr": se32,
             "loss_increase": 0.0, "max_rel_logit_error": 0.0, "greedy_agreement": 1.0}]
    for mode in ("w8", "w8a8"):
        q = quantize_model(copy.deepcopy(model), mode, config.keep_head)
        loss, se, logits = held_out_loss(q, seqs)
        rows.append({"model": mode, "weight_bytes": weight_bytes(q), "held_out_loss": loss, "stderr": se, "loss_increase": loss - loss32,
                     "max_rel_logit_error": float((logits - logits32).abs().max() / logits32.abs().max()),
                     "greedy_agreement": float((logits.argmax(-1) == logits32.argmax(-1)).float().mean())})
        checks.append(Check(f"{mode}: held-out loss within {config.loss_tolerance} nats of fp32", max(0.0, loss - loss32),
                            config.loss_tolerance, reference="the fp32 model on the same held-out sequences",
                            detail=f"{loss:.4f} vs {loss32:.4f} ± {se32:.4f} nats"))
        checks.append(Check(f"{mode}: held-out loss not below the corpus's entropy rate", max(0.0, corpus.entropy_rate - loss - 3 * se), 0.0,
                            reference="entropy rate of the Markov chain (information-theoretic floor)",
                            detail=f"{loss:.4f} vs floor {corpus.entropy_rate:.4f}"))
    ctx.progress(0.8, "generating with an INT8 KV cache")
    kv_rows, kv_bytes, kv_kl = kv_cache_rows(model, seqs[0, :16], config.new_tokens)
    checks += [kv_bytes, kv_kl]
    w = {r["model"]: r for r in rows}
    result = Result(
        metrics={"weight_bytes.fp32": w["fp32"]["weight_bytes"], "weight_bytes.int8": w["w8"]["weight_bytes"],
                 "weight_saving_pct": round(100 * (1 - w["w8"]["weight_bytes"] / w["fp32"]["weight_bytes"]), 1),
                 "held_out_loss.fp32": round(loss32, 4), "held_out_loss.w8": round(w["w8"]["held_out_loss"], 4),
                 "held_out_loss.w8a8": round(w["w8a8"]["held_out_loss"], 4), "entropy_rate_nats": corpus.entropy_rate,
                 "kv_bytes_per_token.fp32": kv_rows[0]["bytes_per_token"], "kv_bytes_per_token.int8": kv_rows[1]["bytes_per_token"],
                 **gemm_info},
        tables={"models": loss_bars(rows), "kv_cache": kv_rows},
        checks=checks,
        notes=[f"A {SHAPE['d_model']}-wide, {SHAPE['n_layers']}-layer model trained {config.steps} steps on a synthetic corpus: "
               "a small-scale illustration of INT8's error, not a claim about large models."])
    changes_from_fp32(result.metrics)
    return result


def changes_from_fp32(metrics: dict) -> None:
    """What INT8 changes against fp32, as the page shows it: the KV cache's bytes per token (per cent) and W8A8's
    held-out loss (nats)."""
    metrics["kv_bytes_change_pct"] = round(100 * (metrics["kv_bytes_per_token.int8"] / metrics["kv_bytes_per_token.fp32"] - 1), 1)
    metrics["w8a8_loss_change_nats"] = round(metrics["held_out_loss.w8a8"] - metrics["held_out_loss.fp32"], 4)


def loss_bars(rows: list[dict]) -> list[dict]:
    """Each model's held-out loss one standard error either side (the mean over held-out tokens ± its standard error):
    the bar the page draws."""
    return error_bars(rows, "held_out_loss", "stderr", 1, "loss_low", "loss_high")


def _v2_to_v3(result: dict) -> None:
    """Version 2 -> 3: the error bars, from the stored rows by the experiment's own function (the page computed them)."""
    loss_bars(result["tables"]["models"])


RESULT = Schema(
    metrics=(
        "weight_bytes.fp32", "weight_bytes.int8", "weight_saving_pct", "held_out_loss.fp32", "held_out_loss.w8",
        "held_out_loss.w8a8", "entropy_rate_nats", "kv_bytes_per_token.fp32", "kv_bytes_per_token.int8", "gemm_k",
        "largest_abs_sum", "int32_max", "fp32_accumulation_wrong_elements", "kv_bytes_change_pct", "w8a8_loss_change_nats",
    ),
    tables={
        "models": ("greedy_agreement", "held_out_loss", "loss_increase", "max_rel_logit_error", "model", "stderr",
                   "weight_bytes", "loss_low", "loss_high"),
        "kv_cache": ("bytes_per_token", "cache", "formula", "greedy_agreement", "kl_nats", "max_rel_logit_error"),
    },
    version=3, upgrades={1: lambda result: changes_from_fp32(result["metrics"]), 2: _v2_to_v3},  # v1: the page computed the changes
)

EXPERIMENT = define(__name__, Int8Config,
                    "INT8 weight-only and W8A8 (INT32 accumulate) on the trained tiny LLaMA, and an INT8 KV cache: bytes and error "
                    "against fp32, the GEMM against exact integers",
                    run_fn=run, schema=RESULT)
