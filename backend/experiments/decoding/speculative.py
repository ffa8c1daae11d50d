"""decoding.speculative: a draft and a target tiny LLaMA trained here on one Markov-chain corpus; speculative
sampling with gamma draft tokens per target call against plain sampling from the target.

Measured: the acceptance rate alpha, tokens per target call for gamma = 1..gamma beside (1 - alpha^(gamma+1)) /
(1 - alpha), and wall time against plain decoding beside the predicted speedup. The seed's claim that the output
is distributed as the target's own samples is tested: the first two generated tokens of many sequences against
the exact target joint p(x1) p(x2 | x1), by Pearson's chi-square at significance 0.001; the same test on a broken
rule (resample from p instead of max(0, p - q)) is shown beside it.
"""
from __future__ import annotations

import dataclasses
import statistics
import time

import torch
from torch.func import vmap

from backend.config import Config, setting
from backend.limits import DYNAMO_IMPORT_S, cost
from backend.decoding.speculative import (RULES, chi_square, expected_tokens_per_call, next_probs, plain_decode,
                                          predicted_speedup, speculative_decode)
from backend.experiments import define
from backend.models.corpus import MarkovCorpus
from backend.models.llama import ModelShape, TinyDecoder
from backend.result import Check, Result, Schema

SIGNIFICANCE = 0.001  # the correct rule fails a test at this level once in a thousand seeds
PREFIX_LEN = 8
TARGET = dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=4, d_head=16, d_ff=128)
DRAFT = dict(d_model=16, n_layers=1, n_heads=2, n_kv_heads=2, d_head=8, d_ff=32)


@dataclasses.dataclass
class SpeculativeConfig(Config):
    gamma: int = setting(4, min=1, max=8, help="draft tokens per target call")
    new_tokens: int = setting(32, min=4, max=256, help="tokens generated per sequence")
    sequences: int = setting(8, min=1, max=64, help="sequences decoded for the acceptance statistics")
    test_samples: int = setting(1200, min=200, max=20000, help="sequences sampled for the distribution test")
    target_steps: int = setting(50, min=0, max=1000, help="training steps of the target (64 wide, 2 layers)")
    draft_steps: int = setting(30, min=0, max=1000, help="training steps of the draft (16 wide, 1 layer)")
    vocab: int = setting(16, min=4, max=32, help="vocabulary of the Markov-chain corpus")
    timing_repeats: int = setting(3, min=1, max=10, help="timed decodes of one sequence (median taken)")
    seed: int = setting(0, min=0, max=2**31 - 1, help="corpus, weights and sampling")

    cost_drivers = ("new_tokens", "gamma", "test_samples", "timing_repeats", "target_steps", "draft_steps")

    def estimate(self):
        """Model calls of ~300 ops each (vmap over a tiny LLaMA, no KV cache), counted at their worst: one token per
        round (alpha = 0), so each gamma in the sweep takes new_tokens·(gamma + 1) calls, as does each timed speculative
        decode; the distribution test's two rounds per rule run test_samples sequences through the target twice and
        the draft 2·gamma times. Training steps ~200 ops. Fitted to 4.4 s of CPU at the defaults (bench/limits.py): the
        calls cost about a fifth of these counts at OP_S and FLOPS."""
        sweep = self.new_tokens * self.gamma * (self.gamma + 3) // 2
        timing = self.timing_repeats * self.new_tokens * (self.gamma + 2) + 30
        test_calls = 2 * 2 * (self.gamma + 1)
        context, test_context = PREFIX_LEN + self.new_tokens + self.gamma + 1, PREFIX_LEN + 2 + self.gamma + 1
        target, draft = (m["n_layers"] * (4 * m["d_model"] ** 2 + 3 * m["d_model"] * m["d_ff"]) for m in (TARGET, DRAFT))
        test_flops = 2 * self.test_samples * test_context * 2 * (2 * target + 2 * self.gamma * draft)
        return cost(data_bytes=self.test_samples * test_context * (self.vocab + TARGET["d_ff"]) * 4 * 8,
                    flops=(test_flops + 2 * target * (sweep * self.sequences + timing) * context) / 5,
                    ops=50 * (sweep + timing + test_calls) + 200 * (self.target_steps + self.draft_steps),
                    seconds=DYNAMO_IMPORT_S)


def train(shape: dict, corpus: MarkovCorpus, steps: int, seed: int) -> TinyDecoder:
    torch.manual_seed(seed)
    model = TinyDecoder(ModelShape(vocab=corpus.P.shape[0], **shape))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(seed + 1)
    for _ in range(steps):
        batch = corpus.sample(8, 32, g)
        logits = vmap(model)(batch[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


def distribution_test(target, draft, prefix: torch.Tensor, c: SpeculativeConfig, rule: str) -> dict:
    """Counts of the first two generated tokens (x1, x2) against the exact target joint p(x1) p(x2 | x1)."""
    V = c.vocab
    p1 = next_probs(target, prefix, torch.tensor([[PREFIX_LEN - 1]]))[0, 0]
    extended = torch.cat([prefix.expand(V, -1), torch.arange(V)[:, None]], 1)
    p2 = next_probs(target, extended, torch.full((V, 1), PREFIX_LEN))[:, 0]
    joint = (p1[:, None] * p2).flatten()
    g = torch.Generator().manual_seed(c.seed + 7)
    buf, _, _ = speculative_decode(target, draft, prefix.expand(c.test_samples, -1), 2, c.gamma, g, rule)
    counts = torch.bincount(buf[:, PREFIX_LEN] * V + buf[:, PREFIX_LEN + 1], minlength=V * V)
    stat, dof, p_value = chi_square(counts, joint)
    tv = 0.5 * float((counts / c.test_samples - joint).abs().sum())
    return {"rule": rule, "chi_square": stat, "dof": dof, "p_value": p_value, "rejected": p_value < SIGNIFICANCE,
            "total_variation": tv, "samples": c.test_samples, "counts": counts.tolist(), "probs": joint.tolist()}


def timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run(config: SpeculativeConfig, ctx) -> Result:
    torch.set_num_threads(1)
    c = config
    corpus = MarkovCorpus(c.vocab, c.seed)
    ctx.progress(0.0, "training the target")
    target = train(TARGET, corpus, c.target_steps, c.seed)
    ctx.progress(0.25, "training the draft")
    draft = train(DRAFT, corpus, c.draft_steps, c.seed + 100)
    prefix = corpus.sample(1, PREFIX_LEN, torch.Generator().manual_seed(c.seed + 3))
    with torch.no_grad():
        ctx.progress(0.35, "acceptance for each gamma")
        sweep = []
        for gamma in range(1, c.gamma + 1):
            g = torch.Generator().manual_seed(c.seed + gamma)
            _, _, s = speculative_decode(target, draft, prefix.expand(c.sequences, -1), c.new_tokens, gamma, g)
            alpha = s.accepted / s.drafted
            sweep.append({"gamma": gamma, "alpha": alpha, "tokens_per_target_call": s.emitted / s.target_calls,
                          "formula": expected_tokens_per_call(alpha, gamma), "rounds": s.rounds})
        ctx.progress(0.55, "distribution test")
        tests = [distribution_test(target, draft, prefix, c, rule) for rule in RULES]

        ctx.progress(0.8, "timing")
        g = torch.Generator().manual_seed(c.seed)
        plain_s = timed(lambda: plain_decode(target, prefix, c.new_tokens, g), c.timing_repeats)
        spec_s = timed(lambda: speculative_decode(target, draft, prefix, c.new_tokens, c.gamma, g), c.timing_repeats)
        probe = torch.full((1, 1), PREFIX_LEN + c.new_tokens // 2)  # a call at the mean context length
        long = torch.zeros(1, PREFIX_LEN + c.new_tokens, dtype=torch.long)
        draft_s, target_s = (timed(lambda: next_probs(m, long, probe), 15) for m in (draft, target))
        cost_ratio = draft_s / target_s

    at_gamma = sweep[-1]
    speedup = plain_s / spec_s
    predicted = predicted_speedup(at_gamma["alpha"], c.gamma, cost_ratio)
    correct, broken = tests
    checks = [
        Check(f"output distribution equals the target's (chi-square, {correct['dof']} dof, significance {SIGNIFICANCE})",
              max(0.0, SIGNIFICANCE - correct["p_value"]), 0.0,
              reference="exact target joint p(x1)·p(x2|x1) from the target's own logits",
              detail=f"p-value {correct['p_value']:.3g} (fails below {SIGNIFICANCE}); total variation {correct['total_variation']:.4f}"),
    ]
    for row in sweep:
        checks.append(Check(f"gamma={row['gamma']}: tokens per target call within 10% of (1-α^(γ+1))/(1-α)",
                            abs(row["tokens_per_target_call"] / row["formula"] - 1), 0.10,
                            reference="the i.i.d.-acceptance formula with the measured α",
                            detail=f"measured {row['tokens_per_target_call']:.3f}, formula {row['formula']:.3f}"))
    return Result(
        metrics={"alpha": at_gamma["alpha"], "tokens_per_target_call": at_gamma["tokens_per_target_call"],
                 "formula_tokens_per_call": at_gamma["formula"], "plain_ms": 1e3 * plain_s, "speculative_ms": 1e3 * spec_s,
                 "measured_speedup": speedup, "predicted_speedup": predicted, "draft_to_target_cost": cost_ratio,
                 "draft_call_ms": 1e3 * draft_s, "target_call_ms": 1e3 * target_s,
                 "entropy_rate_nats": corpus.entropy_rate,
                 "p_value.correct": correct["p_value"], "p_value.broken": broken["p_value"]},
        tables={"gamma_sweep": sweep, "distribution_tests": [{k: v for k, v in t.items() if k not in ("counts", "probs")} for t in tests],
                "joint": [{"rule": t["rule"], "x1": i // c.vocab, "x2": i % c.vocab, "observed": n / t["samples"], "expected": p}
                          for t in tests for i, (n, p) in enumerate(zip(t["counts"], t["probs"]))],
                "timing": [{"decoder": "plain", "source": "measured", "ms": 1e3 * plain_s},
                           {"decoder": f"speculative γ={c.gamma}", "source": "measured", "ms": 1e3 * spec_s},
                           {"decoder": f"speculative γ={c.gamma}", "source": "predicted from call costs", "ms": 1e3 * plain_s / predicted}]},
        checks=checks,
        notes=[f"Wall time of one sequence of {c.new_tokens} tokens on this CPU, median of {c.timing_repeats}; no KV cache "
               "(every call recomputes its sequence). A draft call costs "
               f"{cost_ratio:.2f} target calls here, so the predicted speedup is E[tokens]/(γ·{cost_ratio:.2f} + 1) "
               f"= {predicted:.2f}×; measured {speedup:.2f}×.",
               "The broken rule resamples rejected positions from p instead of norm(max(0, p - q)); it is expected to fail the test."])


RESULT = Schema(
    metrics=(
        "alpha", "tokens_per_target_call", "formula_tokens_per_call", "plain_ms", "speculative_ms",
        "measured_speedup", "predicted_speedup", "draft_to_target_cost", "draft_call_ms", "target_call_ms",
        "entropy_rate_nats", "p_value.correct", "p_value.broken",
    ),
    tables={
        "gamma_sweep": ("alpha", "formula", "gamma", "rounds", "tokens_per_target_call"),
        "distribution_tests": ("chi_square", "dof", "p_value", "rejected", "rule", "samples", "total_variation"),
        "joint": ("expected", "observed", "rule", "x1", "x2"),
        "timing": ("decoder", "ms", "source"),
    },
)

EXPERIMENT = define(__name__, SpeculativeConfig,
                    "speculative sampling with two tiny LLaMAs: acceptance, tokens per target call, wall time, distribution test",
                    run_fn=run, schema=RESULT)
