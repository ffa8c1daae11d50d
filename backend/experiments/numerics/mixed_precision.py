"""numerics.mixed_precision: train the tiny LLaMA with fp32 master weights and fp16 compute, with no loss scaling,
a static scale and dynamic scaling, beside plain fp32 training and beside torch.amp.GradScaler (the peer).

Measured: the loss curves, the loss scale per step with its overflow skips, the gradient elements FP16 flushes to
zero in each case (against an fp32 backward of the same weights), and where the gradients' magnitudes sit in
FP16's range. Checked: the dynamic scale sequence and the trained weights equal GradScaler's; no underflow with
scaling; unscaled fp16 gradients equal the fp32 ones to FP16 precision.
"""
from __future__ import annotations

import dataclasses
import math

import torch

from backend.config import Config, setting
from backend.limits import DYNAMO_IMPORT_S, cost
from backend.experiments import define
from backend.models.corpus import MarkovCorpus
from backend.models.llama import ModelShape, TinyDecoder
from backend.numerics.mixed_precision import MODES, Settings, gradient_magnitudes, train
from backend.result import Check, Result, Schema

SHAPE = dict(d_model=32, n_layers=2, n_heads=2, n_kv_heads=2, d_head=16, d_ff=64)


@dataclasses.dataclass
class MixedPrecisionConfig(Config):
    steps: int = setting(30, min=2, max=300, help="optimizer steps per run")
    batch: int = setting(8, min=1, max=64, help="sequences per step")
    seq_len: int = setting(32, min=8, max=128, help="tokens per sequence")
    lr: float = setting(1e-2, min=1e-5, max=1e-1, help="AdamW learning rate on the fp32 master weights")
    static_scale_log2: int = setting(16, min=0, max=24, help="static loss scale 2^k")
    init_scale_log2: int = setting(30, min=0, max=40, help="dynamic scaling's first scale 2^k (GradScaler's default: 16)")
    growth_interval: int = setting(8, min=1, max=2000, help="clean steps before the dynamic scale doubles (GradScaler: 2000)")
    global_batch_log2: int = setting(20, min=0, max=24, help="tokens in the global batch the loss is averaged over, 2^k (LLaMA: ~2^22)")
    count_every: int = setting(3, min=1, max=50, help="count underflow every n steps (an extra fp32 backward)")
    vocab: int = setting(16, min=4, max=2048, help="vocabulary of the Markov-chain corpus")
    seed: int = setting(0, min=0, max=2**31 - 1, help="corpus and weights")

    cost_drivers = ("steps", "batch", "seq_len", "vocab", "count_every")

    def estimate(self):
        """Five trainings of `steps` steps, plus an fp32 backward on every count_every-th step of four of them. CPU fp16
        is slow on elementwise work, which the logits (tokens × vocab) and attention scores (T² per head) dominate:
        about 80 bytes moved per element per step, and ~8 ms of CPU a small step (bench/limits.py: 5 s of CPU at the
        defaults, ~18 s for 2 steps of 64×128 tokens over a 2,048-token vocabulary)."""
        steps = 5 * self.steps + 4 * -(-self.steps // self.count_every) + 1
        tokens = self.batch * self.seq_len
        L, H, d = SHAPE["n_layers"], SHAPE["n_heads"], SHAPE["d_model"]
        weights = L * (4 * d * d + 3 * d * SHAPE["d_ff"]) + self.vocab * d
        elements = tokens * self.vocab + L * self.batch * H * self.seq_len ** 2
        return cost(data_bytes=elements * 60 + self.steps * tokens * 8, flops=steps * tokens * (6 * weights + 12 * L * self.seq_len * d),
                    moved_bytes=steps * elements * 80, ops=steps * 300, seconds=DYNAMO_IMPORT_S)


def histogram(magnitudes: dict[str, torch.Tensor]) -> list[dict]:
    rows = []
    for name, m in magnitudes.items():
        exponents = torch.floor(torch.log2(m[m > 0])).long()
        for e, n in zip(*torch.unique(exponents, return_counts=True)):
            rows.append({"gradient": name, "log2_magnitude": int(e), "elements": int(n), "share": int(n) / m.numel()})
    return rows


def run(config: MixedPrecisionConfig, ctx) -> Result:
    torch.set_num_threads(1)
    c = config
    corpus = MarkovCorpus(c.vocab, c.seed)
    torch.manual_seed(c.seed)
    model = TinyDecoder(ModelShape(vocab=c.vocab, **SHAPE))
    g = torch.Generator().manual_seed(c.seed + 1)
    batches = [corpus.sample(c.batch, c.seq_len + 1, g) for _ in range(c.steps)]
    loss_weight = min(1.0, c.batch * c.seq_len / 2.0 ** c.global_batch_log2)
    s = Settings(c.steps, c.lr, loss_weight, 2.0 ** c.static_scale_log2, 2.0 ** c.init_scale_log2, c.growth_interval, c.count_every)
    runs, masters = {}, {}
    for i, mode in enumerate(MODES):
        ctx.progress(i / len(MODES), mode)
        runs[mode], masters[mode] = train(model, batches, mode, s)

    summary = []
    for mode, rows in runs.items():
        counted = [r for r in rows if "param_underflow" in r]
        summary.append({"mode": mode, "final_loss": rows[-1]["loss"], "skipped_steps": sum(r["skipped"] for r in rows),
                        "final_scale": rows[-1]["scale"],
                        "activation_underflow": sum(r["activation_underflow"] for r in counted) if counted else None,
                        "activation_underflow_share": sum(r["activation_underflow"] for r in counted) / max(1, sum(r["activation_nonzero"] for r in counted)) if counted else None,
                        "param_underflow": sum(r["param_underflow"] for r in counted) if counted else None,
                        "param_underflow_share": sum(r["param_underflow"] for r in counted) / max(1, sum(r["param_nonzero"] for r in counted)) if counted else None,
                        "max_grad_relative_error": max((r["grad_relative_error"] for r in counted if not r["skipped"]), default=None)})
    by_mode = {row["mode"]: row for row in summary}
    ours, peer = runs["fp16 dynamic scaling"], runs["fp16 GradScaler"]
    scale_mismatch = sum(a["scale"] != b["scale"] for a, b in zip(ours, peer))
    weight_diff = max(float((a - b).detach().abs().max()) for a, b in zip(masters["fp16 dynamic scaling"].parameters(),
                                                                 masters["fp16 GradScaler"].parameters()))
    fp32_losses = [r["loss"] for r in runs["fp32"]]
    static_gap = max(abs(r["loss"] - f) for r, f in zip(runs["fp16 static scaling"], fp32_losses))
    checks = [
        Check("dynamic loss scale equals torch.amp.GradScaler's at every step", scale_mismatch, 0,
              reference="torch.amp.GradScaler('cpu') driving the same training", detail=f"steps with another scale, of {c.steps}"),
        Check("trained master weights equal GradScaler's run", weight_diff, 0.0, reference="GradScaler's run, same batches",
              detail="max |difference| (same arithmetic, so exactly equal)"),
        Check("static scaling: no gradient element flushed to zero", by_mode["fp16 static scaling"]["activation_underflow"]
              + by_mode["fp16 static scaling"]["param_underflow"], 0, reference="fp32 backward of the same weights and scale"),
        Check("dynamic scaling: no gradient element flushed to zero", by_mode["fp16 dynamic scaling"]["activation_underflow"]
              + by_mode["fp16 dynamic scaling"]["param_underflow"], 0, reference="fp32 backward of the same weights and scale"),
        Check("static scaling: unscaled fp16 gradients equal fp32's to FP16 precision",
              by_mode["fp16 static scaling"]["max_grad_relative_error"], 0.01,
              reference="fp32 backward of the same master weights", detail="largest ||g16 - g32|| / ||g32|| over counted steps"),
        Check("static scaling: loss curve follows fp32 training", static_gap, 0.05, reference="the fp32 run on the same batches",
              detail="largest |loss difference| over the steps (nats)"),
    ]
    magnitudes = gradient_magnitudes(masters["fp32"], batches[-1], loss_weight)
    return Result(
        metrics={**{f"final_loss.{r['mode']}": r["final_loss"] for r in summary},
                 "underflow_no_scaling": by_mode["fp16 no scaling"]["activation_underflow"] + by_mode["fp16 no scaling"]["param_underflow"],
                 "skipped_steps_dynamic": by_mode["fp16 dynamic scaling"]["skipped_steps"],
                 "share_below_fp16_subnormal": float(sum(((m > 0) & (m < 2.0 ** -24)).sum() for m in magnitudes.values())
                                                     / sum((m > 0).sum() for m in magnitudes.values())),
                 "loss_weight": loss_weight, "static_scale_keeps_from_log2": static_scale_keeps_from_log2(c.static_scale_log2)},
        tables={"summary": summary, "curves": [r for rows in runs.values() for r in rows], "gradient_histogram": histogram(magnitudes)},
        checks=checks,
        notes=["Underflow is counted where the fp16 gradient is exactly 0 and the fp32 gradient of the same weights is "
               "nonzero but below FP16's smallest subnormal 2^-24; counts are summed over the counted steps.",
               f"The loss of each {c.batch}×{c.seq_len}-token batch is weighted by {loss_weight:.3g} = batch tokens / 2^{c.global_batch_log2}, "
               "the share it has in a large run's global-batch mean, so the gradients have a large run's size; Adam's "
               "step is invariant to that weight (up to eps), FP16's range is not.",
               "CPU fp16: torch runs fp16 matmuls on the CPU (accumulating in fp32 inside the kernel)."])


def static_scale_keeps_from_log2(scale_log2: int) -> float:
    """The smallest |gradient| (log₂) that a static loss scale 2^k keeps from flushing to zero in FP16: scaled by 2^k it
    reaches FP16's smallest subnormal (the smallest normal times ε: 2⁻¹⁴·2⁻¹⁰), so log₂(subnormal) − k."""
    fp16 = torch.finfo(torch.float16)
    return math.log2(fp16.tiny * fp16.eps) - scale_log2


RESULT = Schema(
    metrics=(
        "final_loss.fp32", "final_loss.fp16 no scaling", "final_loss.fp16 static scaling",
        "final_loss.fp16 dynamic scaling", "final_loss.fp16 GradScaler", "underflow_no_scaling",
        "skipped_steps_dynamic", "share_below_fp16_subnormal", "loss_weight", "static_scale_keeps_from_log2",
    ),
    tables={
        "summary": ("activation_underflow", "activation_underflow_share", "final_loss", "final_scale",
                    "max_grad_relative_error", "mode", "param_underflow", "param_underflow_share", "skipped_steps"),
        "curves": ("activation_nonzero", "activation_underflow", "grad_relative_error", "loss", "mode",
                   "param_nonzero", "param_underflow", "scale", "skipped", "step"),
        "gradient_histogram": ("elements", "gradient", "log2_magnitude", "share"),
    },
    version=2, upgrades={1: lambda result: result["metrics"].setdefault(  # v1: the page subtracted the scale
        "static_scale_keeps_from_log2", static_scale_keeps_from_log2(result["config"]["static_scale_log2"]))},
)

EXPERIMENT = define(__name__, MixedPrecisionConfig,
                    "tiny LLaMA in fp16 with fp32 master weights: no/static/dynamic loss scaling, underflow counted, GradScaler as the peer",
                    run_fn=run, schema=RESULT)
