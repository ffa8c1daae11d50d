"""serving.engine: the tiny LLaMA served by continuous batching over a trace arriving in real time,
and the simulator calibrated from it predicting the same trace.

A profiling trace fits the cost model; a held-out trace (another seed) is served for real and
simulated; a few more rates, real and simulated, draw the load curve. Checked: every logits row the engine
sampled from equals a full recompute of the request's sequence without KV cache; every request's tokens
equal the model decoding it alone; the simulator given the engine's measured step times makes the
same batches step by step; the batched CPU attention equals the Triton paged kernel and a per-query
SDPA reference; the block manager's invariants hold; the simulator's fidelity on the held-out trace.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from backend.config import setting
from backend.experiments import define
from backend.result import Check, Result, Schema
from backend.serving import attention
from backend.serving.engine import logits_error, serve, token_mismatches
from backend.serving.report import (cost_rows, cost_summary_written, gantt_rows, knee, latency_rows, latency_shares_written, load_row,
                                    step_rows, token_gap_rows, with_shares)
from backend.serving.schema import CALIBRATION_METRICS, CALIBRATION_TABLES
from backend.experiments.serving._settings import ServingSettings
from backend.serving.simulator import simulate


LOGITS_TOL = 1e-5  # float32: the paged, batched path and one causal forward add in other orders (measured ~1.2e-6)


@dataclasses.dataclass
class EngineConfig(ServingSettings):
    real_rates: int = setting(0, min=0, max=6, help="extra rates served for real on the load curve (each with half the held-out requests), "
                                                 "besides the held-out run at the set rate")

    cost_drivers = ("held_out_requests", "profile_requests", "real_rates", "sweep_requests")

    def estimate(self):
        """Besides the calibration: each held-out request decoded alone (one model call per token, about twice a
        served request) and recomputed once without a cache, the extra real rates, the Triton paged kernel in the interpreter (~10 s), 9 simulated rates."""
        extra = self.real_rates * max(2, self.held_out_requests // 2)
        return self.serving_cost(2 * self.held_out_requests + extra, 9 * self.sweep_requests + extra, seconds=10.0)


def run(config: EngineConfig, ctx) -> Result:
    model, cal = config.calibrate(lambda f, m: ctx.progress(0.5 * f, m))
    real, cost, sched_config = cal.real, cal.cost, config.scheduler_config()
    ctx.progress(0.5, "checking logits against a full recompute, tokens against single-request decoding")
    logit_gap, logit_rows = logits_error(model, real)
    wrong = token_mismatches(model, real)
    ctx.progress(0.6, "attention: batched CPU path vs the Triton kernel")
    q, pool, tables, seq, pos = attention.mixed_batch(config.seed)
    ours = attention.TorchPagedAttention(tables, seq, pos, pool.shape[2])(q, pool)
    kernel_gap = (ours - attention.TritonPagedAttention(tables, seq, pos, pool.shape[2])(q, pool)).abs().max().item()
    reference_gap = (ours - attention.paged_attention_reference(q, pool, tables, seq, pos)).abs().max().item()
    try:
        real.m.check_invariants()
        invariant_error = ""
    except AssertionError as err:
        invariant_error = str(err)

    ctx.progress(0.7, "load curve")
    rates = config.rate * np.geomspace(0.25, 4, 9)
    load = []
    for rate in rates:
        load.append(load_row(simulate(config.synthetic(config.sweep_requests, config.seed + 1, rate), sched_config, cost), rate, "simulated"))
    load += [load_row(real, config.rate, "real"), load_row(cal.simulated, config.rate, "simulated, same trace")]
    for rate in config.rate * np.geomspace(2, 0.5, config.real_rates):  # the busier side first
        ctx.progress(0.8, f"the engine at {rate:.1f} requests/s")
        trace = config.synthetic(max(2, config.held_out_requests // 2), config.seed + 2, rate)
        load.append(load_row(serve(model, trace, sched_config), rate, "real"))
        load.append(load_row(simulate(trace, sched_config, cost), rate, "simulated, same trace"))

    checks = [
        Check("every sampled logits row equals a full recompute of its sequence (no KV cache)", logit_gap, LOGITS_TOL,
              reference="TinyDecoder's causal forward over the request's prompt and served tokens, float32, one call per request",
              detail=f"{logit_rows} rows of {model.shape.vocab} logits over {config.held_out_requests} requests"),
        Check("every request's tokens equal the model decoding it alone (greedy)", len(wrong), 0,
              reference="TinyDecoder with its own contiguous KV cache, one request at a time",
              detail=f"{config.held_out_requests} requests; mismatching: {wrong[:10]}"),
        Check("batched CPU paged attention equals the Triton paged kernel", kernel_gap, 1e-5,
              reference="kernels/paged_attention.py (interpreter on a CPU), one kernel row per query token"),
        Check("batched CPU paged attention equals per-query gather + SDPA", reference_gap, 1e-5,
              reference="torch scaled_dot_product_attention over each query's gathered context"),
        Check("block-manager invariants after the run", float(bool(invariant_error)), 0,
              reference="ref counts = table entries; fills; free queue", detail=invariant_error),
        *cal.checks(),
    ]
    metrics = {**cal.metrics(), "prefix_hit_rate": real.m.stats.prefix_hit_tokens / max(1, real.m.stats.prefix_queried_tokens),
               "knee_rate": knee([r for r in load if r["source"] == "simulated"]), "attention": "batched torch (CPU)"}
    notes = [cal.note(), cal.fidelity_note()]
    tables = {"gantt": gantt_rows(real, limit=200), "latency": with_shares(latency_rows(real, "real") + latency_rows(cal.simulated, "simulated")),
              "steps": step_rows(real, cost), "load": load, "cost_model": cost_rows(cost), "token_gaps": token_gap_rows(real)}
    return Result(metrics=metrics, checks=checks, notes=notes, tables=tables)


RESULT = Schema(
    metrics=(*CALIBRATION_METRICS, "prefix_hit_rate", "attention"),
    tables={**CALIBRATION_TABLES, "gantt": ("end", "phase", "request", "start"), "token_gaps": ("gap", "request")},
    version=3, upgrades={1: cost_summary_written, 2: latency_shares_written},
)

EXPERIMENT = define(__name__, EngineConfig,
                    "continuous batching of the tiny LLaMA over paged KV on a real-time trace, beside its calibrated simulator",
                    run_fn=run, schema=RESULT)
