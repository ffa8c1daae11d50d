"""attention.variants_train: train MHA, MQA, GQA and MLA decoders on the same generated corpus, same budget.

The corpus is a Markov chain over a small vocabulary with a random (seeded) transition matrix P.
Its entropy rate H = -Σ_i π_i Σ_j P_ij ln P_ij (π the stationary distribution) is the lowest
next-token loss any model can reach on fresh samples, so it is an independent floor: a held-out
loss below it would mean the model sees the future (a broken causal mask). A small-scale
illustration of the variants' trade-off, not a claim about large models.
"""
from __future__ import annotations

import dataclasses
import math

import torch

from backend.config import Config, setting
from backend.limits import cost
from backend.experiments import define
from backend.models.corpus import MarkovCorpus, held_out_loss
from backend.models.llama import ModelShape, TinyDecoder
from backend.result import Check, Result, Schema

VARIANTS = ("mha", "mqa", "gqa", "mla")


@dataclasses.dataclass
class TrainConfig(Config):
    steps: int = setting(30, min=1, max=500, help="optimizer steps per variant")
    batch: int = setting(4, min=1, max=64, help="sequences per step")
    seq_len: int = setting(32, min=8, max=128, help="tokens per sequence")
    vocab: int = setting(16, min=4, max=64, help="vocabulary of the Markov chain")
    lr: float = setting(3e-3, min=1e-5, max=1e-1, help="AdamW learning rate")
    seed: int = setting(0, min=0, max=2**31 - 1, help="corpus and weights")

    cost_drivers = ("steps", "batch", "seq_len")

    def estimate(self):
        """Four tiny decoders (d_model 64, 2 layers), each trained `steps` steps on batch × seq_len tokens."""
        params = 2 * 12 * 64 * 64 + 2 * self.vocab * 64
        per_token = 6 * params + 2 * 12 * self.seq_len * 64  # weights, then attention over the sequence
        return cost(data_bytes=self.batch * self.seq_len * (self.seq_len * 4 + 64 * 60) * 10,  # 537 MiB peak at 64 x 128 measured
                    flops=4 * self.steps * self.batch * self.seq_len * per_token / 2,  # 1e10 a CPU second (2x FLOPS) measured at 8192 tokens
                    ops=4 * (self.steps * 800 + 64 * 50))  # ~20 ms of CPU a small step measured (30 steps of 128 tokens)


def shape_for(variant: str, vocab: int) -> ModelShape:
    return ModelShape(vocab=vocab, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_head=16, d_c=16, d_rope=8,
                      d_cq=32, d_ff=128, variant=variant)


def run(config: TrainConfig, ctx) -> Result:
    torch.set_num_threads(1)
    corpus = MarkovCorpus(config.vocab, config.seed)
    held_out = corpus.sample(64, config.seq_len, torch.Generator().manual_seed(config.seed + 999))
    curves, rows, checks = [], [], []
    for i, variant in enumerate(VARIANTS):
        torch.manual_seed(config.seed)
        model = TinyDecoder(shape_for(variant, config.vocab))
        opt = torch.optim.AdamW(model.parameters(), lr=config.lr)
        g = torch.Generator().manual_seed(config.seed + 1)  # every variant sees the same batches
        for step in range(config.steps):
            loss = model.loss(corpus.sample(config.batch, config.seq_len, g))
            opt.zero_grad()
            loss.backward()
            opt.step()
            curves.append({"variant": variant, "step": step, "loss": loss.item()})
            if step % 10 == 0:
                ctx.progress((i + step / config.steps) / len(VARIANTS), f"{variant} step {step}")
                ctx.partial(f"Training curves so far, to {variant} step {step}; held-out losses of the variants "
                            "that finished.", metrics={"entropy_rate_nats": corpus.entropy_rate},
                            tables={"curves": curves, "variants": rows})
        held, stderr, _ = held_out_loss(model, held_out)
        rows.append({"variant": variant, "held_out_loss": held, "stderr": stderr,
                     "final_train_loss": sum(c["loss"] for c in curves[-5:]) / min(5, config.steps),
                     "parameters": sum(p.numel() for p in model.parameters()),
                     "kv_cache_elements_per_token": model.blocks[0].attn.cache_elements() * len(model.blocks)})
        checks.append(Check(f"{variant}: held-out loss is not below the corpus entropy rate",
                            max(0.0, corpus.entropy_rate - held - 3 * stderr), 0.0,
                            reference="entropy rate of the Markov chain (information-theoretic floor)",
                            detail=f"held-out {held:.3f} ± {stderr:.3f} nats, floor {corpus.entropy_rate:.3f}"))
    return Result(
        metrics={"entropy_rate_nats": corpus.entropy_rate, "uniform_loss_nats": math.log(config.vocab),
                 **{f"held_out_loss.{r['variant']}": round(r["held_out_loss"], 4) for r in rows}},
        tables={"variants": rows, "curves": curves}, checks=checks,
        notes=["A small-scale illustration on a synthetic corpus with one budget; not a claim about large models."])


RESULT = Schema(
    metrics=("entropy_rate_nats", "uniform_loss_nats", "held_out_loss.*"),  # one held-out loss per variant trained
    tables={
        "variants": ("final_train_loss", "held_out_loss", "kv_cache_elements_per_token", "parameters", "stderr",
                     "variant"),
        "curves": ("loss", "step", "variant"),
    },
)

EXPERIMENT = define(__name__, TrainConfig,
         "train MHA/MQA/GQA/MLA decoders on the same Markov corpus; held-out loss against the entropy-rate floor",
         run_fn=run, schema=RESULT)
