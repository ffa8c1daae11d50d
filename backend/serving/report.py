"""Rows for the Serving page, read off a finished schedule (engine or simulator)."""
from __future__ import annotations

import numpy as np

from backend.serving.schema import COST_SUMMARY
from backend.serving.scheduler import Scheduler
from backend.serving.simulator import CostModel, describe_noise, latency_summary


def gantt_rows(sched: Scheduler, limit: int = 200) -> list[dict]:
    """Per request: queued (arrival -> first scheduled), prefill (-> first token), decode (-> last token),
    and the spans it spent preempted."""
    t, rows = sched.trace, []
    for rid in range(min(limit, len(t))):
        edges = (float(t.arrival[rid]), float(sched.first_scheduled[rid]), float(sched.first_token[rid]), float(sched.finish[rid]))
        for phase, start, end in zip(("queued", "prefill", "decode"), edges, edges[1:]):
            rows.append({"request": rid, "phase": phase, "start": start, "end": end})
    rows += [{"request": rid, "phase": "preempted", "start": out, "end": back}
             for rid, out, back in sched.preempted_spans if rid < limit]
    return rows


def latency_rows(sched: Scheduler, source: str) -> list[dict]:
    t = sched.trace
    tpot = np.where(t.output_len > 1, (sched.finish - sched.first_token) / np.maximum(t.output_len - 1, 1), np.nan)
    return [{"source": source, "request": rid, "ttft": float(sched.first_token[rid] - t.arrival[rid]),
             "tpot": None if np.isnan(tpot[rid]) else float(tpot[rid]), "e2e": float(sched.finish[rid] - t.arrival[rid])}
            for rid in range(len(t))]


def with_shares(rows: list[dict], fields: tuple[str, ...] = ("ttft", "tpot", "e2e")) -> list[dict]:
    """Each request's place in its source's latency distribution, per field: the share of that source's requests with a
    value no larger (the empirical CDF, ties together; None where the request has no value), as `FIELD_share`."""
    for field in fields:
        ordered: dict[str, np.ndarray] = {}
        for source in {r["source"] for r in rows}:
            ordered[source] = np.sort([r[field] for r in rows if r["source"] == source and r[field] is not None])
        for r in rows:
            values = ordered[r["source"]]
            r[f"{field}_share"] = None if r[field] is None else float(np.searchsorted(values, r[field], "right") / len(values))
    return rows


def latency_shares_written(result: dict) -> None:
    """Schema version 2 -> 3 of both serving experiments: the latency rows' empirical CDF (the page's chart computed
    it before)."""
    with_shares(result["tables"]["latency"])


def token_gap_rows(sched: Scheduler) -> list[dict]:
    """Every gap between two consecutive output tokens of a request (the engine records each token's time)."""
    return [{"request": rid, "gap": float(b - a)} for rid, times in sched.token_times.items() for a, b in zip(times, times[1:])]


def step_rows(sched: Scheduler, cost: CostModel, limit: int = 3000) -> list[dict]:
    log = sched.log.table()
    predicted = cost.predict_steps(log)
    stride = max(1, len(log["time"]) // limit)
    return [{"step": i, "start": float(log["start"][i]), "end": float(log["start"][i] + log["time"][i]), "time_ms": 1e3 * float(log["time"][i]),
             "predicted_ms": 1e3 * float(predicted[i]), **{k: int(log[k][i]) for k in
             ("prefill_tokens", "decode_tokens", "kv_blocks", "requests", "running", "waiting", "swapped", "swapped_blocks")}}
            for i in range(0, len(log["time"]), stride)]


def load_row(sched: Scheduler, rate: float, source: str) -> dict:
    s = latency_summary(sched)
    return {"rate": float(rate), "source": source, **{k: s[k] for k in (
        "throughput_tok_s", "throughput_req_s", "ttft_p50", "ttft_p90", "tpot_p50", "tpot_p90", "e2e_p50", "e2e_p90", "preemptions")}}


def knee(rows: list[dict]) -> float | None:
    """The lowest offered rate the server no longer keeps up with (served < 90% of offered requests/s)."""
    over = [r["rate"] for r in sorted(rows, key=lambda r: r["rate"]) if r["throughput_req_s"] < 0.9 * r["rate"]]
    return over[0] if over else None


def cost_rows(cost: CostModel) -> list[dict]:
    return [{"term": "per step", "coefficient_us": 1e6 * cost.intercept},
            {"term": "per prefill token", "coefficient_us": 1e6 * cost.per_prefill_token},
            {"term": "per decode token", "coefficient_us": 1e6 * cost.per_decode_token},
            {"term": "per KV block read", "coefficient_us": 1e6 * cost.per_kv_block},
            {"term": "per step with prefill", "coefficient_us": 1e6 * cost.per_prefill_step},
            {"term": "per step with decodes", "coefficient_us": 1e6 * cost.per_decode_step},
            {"term": "per (query, key) pair of prefill attention", "coefficient_us": 1e6 * cost.per_prefill_pair},
            {"term": "per step with two or more decodes", "coefficient_us": 1e6 * cost.per_batched_decode_step},
            {"term": "per KV block swapped out or in (measured)", "coefficient_us": 1e6 * cost.per_swapped_block}]


def cost_model_summary(m: dict) -> str:
    """The Serving page's paragraph on the cost model, from a run's metrics: the fit, the designed steps beside it, and
    how the simulator draws its noise (each part only if the run measured it: runs stored by older code lack some)."""
    text = (f"Fitted by least squares to **{m['cost.steps']:.0f}** profiled steps of the real engine: R² {m['cost.r2']:.3f}, "
            f"RMSE {1e3 * m['cost.rmse']:.2f} ms, mean |error| per step {100 * m['cost.mape']:.1f}%.")
    if m.get("cost.designed_steps"):
        text += (f" Beside them, **{m['cost.designed_steps']:.0f}** designed steps (decode batches and prefill chunks whose "
                 "tokens, KV blocks and attention pairs vary on their own) settle how a step's cost splits between terms "
                 "that rise together in a trace.")
    if "cost.slow_drift_share" in m:
        text += " The simulator draws each step's noise from " + describe_noise(
            *(m[f"cost.{k}"] for k in ("drift_share", "drift_persistence", "slow_drift_share", "slow_drift_persistence"))) + "."
    return text


def cost_summary_written(result: dict) -> None:
    """Schema version 1 -> 2 of both serving experiments: a run stored before they wrote the cost model's paragraph
    gets it from its own metrics."""
    result["metrics"].setdefault(COST_SUMMARY, cost_model_summary(result["metrics"]))
