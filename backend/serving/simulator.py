"""The simulator: the engine's scheduler, with the model replaced by a cost model of a step's time.

    step time = c0 + c_p · prefill tokens + c_d · decode tokens + c_kv · KV blocks read

fitted by (non-negative) least squares to the steps of a profiling run of the real engine (the fit's error is
reported). `ReplayExecutor` feeds back a run's measured step times instead: given those, the simulator
must reproduce the engine's schedule step for step, which is what shows it is the same scheduler.
"""
from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass

import numpy as np

from backend.serving.scheduler import Scheduler, SchedulerConfig, Step
from backend.serving.workload import Trace

FEATURES = ("prefill_tokens", "decode_tokens", "kv_blocks")


@dataclass(frozen=True)
class CostModel:
    intercept: float            # seconds per step
    per_prefill_token: float
    per_decode_token: float
    per_kv_block: float
    rmse: float = 0.0           # of the fit, seconds
    mape: float = 0.0           # mean |relative error| of the fit
    r2: float = 0.0
    steps: int = 0

    @classmethod
    def fit(cls, steps: dict[str, np.ndarray]) -> "CostModel":
        """Least squares with every coefficient >= 0 (each term is a cost; decode tokens and KV blocks rise
        together, and a free fit trades them against each other, one going negative). Exact: the best
        unconstrained fit over each subset of the terms, kept if non-negative. steps: a StepLog table."""
        X = np.column_stack([np.ones(len(steps["time"]))] + [steps[f] for f in FEATURES])
        y = steps["time"]
        best, coef = np.inf, np.zeros(X.shape[1])
        for subset in itertools.product((False, True), repeat=X.shape[1]):
            cols = np.flatnonzero(subset)
            if not len(cols):
                continue
            c = np.linalg.lstsq(X[:, cols], y, rcond=None)[0]
            residual = float(((X[:, cols] @ c - y) ** 2).sum())
            if (c >= 0).all() and residual < best:
                best, coef = residual, np.zeros(X.shape[1])
                coef[cols] = c
        pred = X @ coef
        resid = y - pred
        r2 = 1 - float(resid @ resid) / max(float(((y - y.mean()) ** 2).sum()), 1e-30)
        return cls(*map(float, coef), rmse=float(np.sqrt(np.mean(resid ** 2))),
                   mape=float(np.mean(np.abs(resid) / y)), r2=r2, steps=len(y))

    def predict(self, prefill_tokens, decode_tokens, kv_blocks):
        return (self.intercept + self.per_prefill_token * prefill_tokens + self.per_decode_token * decode_tokens
                + self.per_kv_block * kv_blocks)

    def as_dict(self) -> dict:
        return asdict(self)


class CostModelExecutor:
    def __init__(self, cost: CostModel):
        self.cost = cost

    def execute(self, step: Step, sched: Scheduler):
        return float(self.cost.predict(step.prefill_tokens, step.decode_tokens, step.kv_blocks)), None

    def decode_times(self, index: int, decode_tokens: int, kv_blocks: np.ndarray) -> np.ndarray:
        """Times of a run of decode-only steps (the same arithmetic as `execute`, elementwise)."""
        return self.cost.predict(0, decode_tokens, kv_blocks)


class ReplayExecutor:
    def __init__(self, step_times: list[float]):
        self.step_times = step_times

    def execute(self, step: Step, sched: Scheduler):
        return self.step_times[step.index], None

    def decode_times(self, index: int, decode_tokens: int, kv_blocks: np.ndarray) -> np.ndarray:
        return np.asarray(self.step_times[index:index + len(kv_blocks)], dtype=np.float64)


def simulate(trace: Trace, config: SchedulerConfig, cost: CostModel, progress=None, step_by_step=False) -> Scheduler:
    """step_by_step: no decode runs taken together (and each step's batch recorded)."""
    return Scheduler(trace, config, record_batches=step_by_step).run(CostModelExecutor(cost), progress)


def latency_summary(sched: Scheduler) -> dict:
    """TTFT, TPOT (mean time between a request's output tokens) and end-to-end latency percentiles in
    seconds; throughput in output tokens and requests per second of trace time."""
    t = sched.trace
    ttft = sched.first_token - t.arrival
    multi = t.output_len > 1
    tpot = (sched.finish[multi] - sched.first_token[multi]) / (t.output_len[multi] - 1)
    e2e = sched.finish - t.arrival
    span = float(np.nanmax(sched.finish) - t.arrival[0])
    out = {"requests": len(t), "steps": len(sched.log), "duration_s": span,
           "throughput_tok_s": float(t.output_len.sum()) / span, "throughput_req_s": len(t) / span,
           "preemptions": int(sched.preemptions.sum())}
    for name, values in (("ttft", ttft), ("tpot", tpot), ("e2e", e2e)):
        for q in (50, 90, 99):
            out[f"{name}_p{q}"] = float(np.percentile(values, q)) if len(values) else float("nan")
    return out


FIDELITY_KEYS = ("ttft_p50", "ttft_p90", "tpot_p50", "tpot_p90", "throughput_tok_s")


def fidelity(real: dict, simulated: dict) -> dict:
    """Relative error of the simulated summary against the real one, per figure."""
    return {k: (simulated[k] - real[k]) / real[k] for k in FIDELITY_KEYS}
