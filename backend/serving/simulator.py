"""The simulator: the engine's scheduler, with the model replaced by a cost model of a step's time.

    step time = c0 + c_p · prefill tokens + c_d · decode tokens + c_kv · KV blocks read
                   + c_pp · [the step has prefill tokens] + c_dp · [the step has decode tokens]
                   + c_qk · (query, key) pairs prefill attention scores + c_swap · KV blocks swapped out or in + noise

The two indicator terms are the fixed costs of the engine's two attention paths (padded SDPA for prefill
chunks, the gather-softmax over blocks for decodes: each a dozen torch calls per layer whatever the
batch), which a step pays once for each path it uses; without them a step that mixes both is
under-predicted by a third. A prefill chunk's attention grows with its tokens times their context (the pairs
its padded SDPA scores, see TorchPagedAttention): at the tiny model's width it costs about as much as the chunk's projections and MLP, so
a linear term alone under-predicts long chunks, and the decodes batched with them wait longer than the
simulator said (the p90 TPOT at 16 requests/s came out 7-12% low). The coefficients are fitted by (non-negative) least squares to the steps of
profiling runs of the real engine (the fit's error is reported), beside designed steps in which the terms a trace
moves together (decode tokens and KV blocks, chunk tokens and pairs) vary on their own. c_swap is measured, not fitted: the
engine times copies of its own KV blocks to CPU memory and back (`ModelExecutor.swap_seconds_per_block`),
since a profile at the default pool size never preempts and a fit would have no swaps to see.

The noise is the fit's own residuals, which on a shared machine are neither small (±15% per step) nor
independent: the machine's speed drifts over tens of steps (other people's work in the caches and
memory bus), so a request's steps tend to be slow together, which widens the spread of TPOT and TTFT
across requests (the p90s) well beyond what independent noise gives. The model keeps the residuals'
distribution (64 quantiles) and their autocorrelation (a share of slow drift with a per-step persistence,
fitted at lags 1 and 10: an AR(1) drift plus independent noise), and draws a deterministic sequence with
both. Step i takes entry i mod 65,536, so a decode run taken in one go (`decode_times`) draws exactly what
its steps would one at a time. `ReplayExecutor` feeds back a run's measured step times instead: given
those, the simulator must reproduce the engine's schedule step for step, which is what shows it is the
same scheduler.
"""
from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass

import numpy as np

from backend.serving.scheduler import Scheduler, SchedulerConfig, Step
from backend.serving.workload import Trace

TERMS = ("intercept", "per_prefill_token", "per_decode_token", "per_kv_block", "per_prefill_step", "per_decode_step",
         "per_prefill_pair")
NOISE_QUANTILES = 64   # residual quantiles kept: the noise's shape, small enough for a run's metrics
NOISE_TABLE = 1 << 16  # step i draws entry i mod this: a lookup, as cheap one step at a time as for a whole run
DRIFT_LAG = 10         # the second lag the drift's autocorrelation is fitted at (the first is 1)


def features(prefill_tokens, decode_tokens, kv_blocks, prefill_pairs=0) -> list:
    """One column per term of TERMS (scalars or arrays)."""
    p, d = np.asarray(prefill_tokens), np.asarray(decode_tokens)
    return [np.ones_like(p, dtype=np.float64), p, d, np.asarray(kv_blocks), (p > 0).astype(np.float64), (d > 0).astype(np.float64),
            np.broadcast_to(np.asarray(prefill_pairs, dtype=np.float64), p.shape)]


def drift(residual_runs: list[np.ndarray], round_runs: list | None = None) -> tuple[float, float]:
    """(share, persistence) of a slow AR(1) drift under independent noise, whose autocorrelation at lag l is
    share · persistence^l: solved from the residuals' autocorrelation at lags 1 and DRIFT_LAG (each run on
    its own, pooled). round_runs: each run's steps' rounds, for an engine that sat rounds out (steps are
    paired by rounds apart: the drift is the machine's, per round); None: one step a round. (0, 0) when the
    residuals show none."""
    def on_rounds(r, rounds):  # the run's residuals by round, NaN where it did not step
        rounds = np.arange(len(r)) if rounds is None else np.asarray(rounds) - rounds[0]
        dense = np.full(int(rounds[-1]) + 1 if len(r) else 0, np.nan)
        dense[rounds] = r - r.mean()
        return dense

    runs = [on_rounds(r, t) for r, t in zip(residual_runs, round_runs or [None] * len(residual_runs))]

    def acf(lag):
        num = den = 0.0
        for d in runs:
            if len(d) > lag + 2:
                a, b = d[:-lag], d[lag:]
                both = ~np.isnan(a) & ~np.isnan(b)  # both steps taken
                a, b = a[both], b[both]
                num, den = num + float(a @ b), den + float(a @ a + b @ b) / 2
        return num / den if den > 0 else 0.0
    near, far = acf(1), acf(DRIFT_LAG)
    if near <= 0 or far <= 0:
        return 0.0, 0.0
    persistence = min((far / near) ** (1 / (DRIFT_LAG - 1)), 0.999)
    return min(near / persistence, 1.0), persistence


@dataclass(frozen=True)
class CostModel:
    intercept: float            # seconds per step
    per_prefill_token: float
    per_decode_token: float
    per_kv_block: float
    per_prefill_step: float = 0.0   # once per step with prefill tokens
    per_decode_step: float = 0.0    # once per step with decode tokens
    per_prefill_pair: float = 0.0   # per (query, key) pair of prefill attention
    per_swapped_block: float = 0.0  # per KV block copied to CPU memory or back (measured, not fitted)
    noise: tuple = ()           # residual quantiles (seconds) at (i + 0.5) / 64; () for none
    drift_share: float = 0.0    # of the noise's variance, the slow part
    drift_persistence: float = 0.0  # its autocorrelation from one step to the next
    rmse: float = 0.0           # of the fit, seconds
    mape: float = 0.0           # mean |relative error| of the fit
    r2: float = 0.0
    steps: int = 0              # the runs' steps fitted
    designed_steps: int = 0     # designed steps beside them (ModelExecutor.designed_steps)

    @classmethod
    def fit(cls, runs: dict | list[dict], noise: bool = True, rounds: list | None = None,
            per_swapped_block: float = 0.0, designed: dict | None = None) -> "CostModel":
        """Least squares with every coefficient >= 0 (each term is a cost; decode tokens and KV blocks rise
        together, and a free fit trades them against each other, one going negative). Exact: the best
        unconstrained fit over each subset of the terms, kept if non-negative. runs: StepLog tables, one per
        profiling run (or one table); rounds: each run's steps' rounds, if it sat some out (see `drift`);
        per_swapped_block: the measured cost of a swap copy, taken off each step's time before the fit;
        designed: steps whose terms move on their own (`ModelExecutor.designed_steps`), fitted with the runs'
        but with an offset of their own (they skip the scheduler's bookkeeping and meet the machine at another
        moment): they settle how the cost splits between terms the runs move together, and nothing else. The
        fit's error and the noise are the runs' alone."""
        runs = [runs] if isinstance(runs, dict) else runs
        tables = runs + ([designed] if designed is not None else [])
        steps = {k: np.concatenate([r[k] for r in tables]) for k in ("prefill_tokens", "decode_tokens", "kv_blocks", "time")}
        swapped, pairs = (np.concatenate([r.get(k, np.zeros(len(r["time"]))) for r in tables]) for k in ("swapped_blocks", "prefill_pairs"))
        X = np.column_stack(features(steps["prefill_tokens"], steps["decode_tokens"], steps["kv_blocks"], pairs))
        y = steps["time"] - per_swapped_block * swapped
        in_runs = sum(len(r["time"]) for r in runs)
        offset = (np.arange(len(y)) >= in_runs).astype(np.float64)[:, None] if designed is not None else np.zeros((len(y), 0))
        best, coef = np.inf, np.zeros(X.shape[1])
        for subset in itertools.product((False, True), repeat=X.shape[1]):
            cols = np.flatnonzero(subset)
            if not len(cols):
                continue
            A = np.column_stack([X[:, cols], offset])
            c = np.linalg.lstsq(A, y, rcond=None)[0]
            residual = float(((A @ c - y) ** 2).sum())
            if (c[:len(cols)] >= 0).all() and residual < best:
                best, coef = residual, np.zeros(X.shape[1])
                coef[cols] = c[:len(cols)]
        X, y = X[:in_runs], y[:in_runs]
        resid = y - X @ coef
        r2 = 1 - float(resid @ resid) / max(float(((y - y.mean()) ** 2).sum()), 1e-30)
        # Each quantile stands for 1/64 of the steps (midpoints: a lone 170 ms stall among 4,000 steps is not
        # stretched over the top 1/64), and the drift is measured on residuals clipped to their 1st-99th percentiles.
        centred = resid - resid.mean()
        shape = tuple(map(float, np.quantile(centred, (np.arange(NOISE_QUANTILES) + 0.5) / NOISE_QUANTILES))) if noise else ()
        clipped = np.clip(centred, *np.quantile(centred, [0.01, 0.99]))
        share, persistence = drift(np.split(clipped, np.cumsum([len(r["time"]) for r in runs])[:-1]), rounds) if noise else (0.0, 0.0)
        return cls(*map(float, coef), per_swapped_block=float(per_swapped_block), noise=shape, drift_share=share, drift_persistence=persistence,
                   rmse=float(np.sqrt(np.mean(resid ** 2))),
                   mape=float(np.mean(np.abs(resid) / y)), r2=r2, steps=len(y),
                   designed_steps=0 if designed is None else len(designed["time"]))

    def coefficients(self) -> np.ndarray:
        return np.array([getattr(self, t) for t in TERMS])

    def predict(self, prefill_tokens, decode_tokens, kv_blocks, swapped_blocks=0, prefill_pairs=0):
        """The mean step time (no noise)."""
        c = self.coefficients()
        return (sum(ci * f for ci, f in zip(c, features(prefill_tokens, decode_tokens, kv_blocks, prefill_pairs)))
                + self.per_swapped_block * np.asarray(swapped_blocks))

    def predict_steps(self, steps: dict) -> np.ndarray:
        """The mean time of each step of a StepLog table."""
        return self.predict(steps["prefill_tokens"], steps["decode_tokens"], steps["kv_blocks"], steps["swapped_blocks"],
                            steps["prefill_pairs"])

    def step_error(self, steps: dict) -> float:
        """Relative error of the mean predicted step time against the mean measured one, over a StepLog table."""
        return float(self.predict_steps(steps).mean() / steps["time"].mean() - 1)

    def noise_table(self, seed: int = 0) -> np.ndarray:
        """Each step's noise, by step index mod NOISE_TABLE: a Gaussian AR(1) drift plus independent noise in
        the fitted shares, mapped through its ranks onto the residual quantiles (so the values have the
        residuals' distribution, and about their autocorrelation)."""
        if not self.noise:
            return np.zeros(NOISE_TABLE)
        rng, phi = np.random.default_rng(seed), self.drift_persistence
        shocks, slow = rng.standard_normal(NOISE_TABLE) * np.sqrt(1 - phi ** 2), np.empty(NOISE_TABLE)
        level = rng.standard_normal()
        for i, shock in enumerate(shocks.tolist()):
            level = phi * level + shock
            slow[i] = level
        z = np.sqrt(self.drift_share) * slow + np.sqrt(1 - self.drift_share) * rng.standard_normal(NOISE_TABLE)
        u = (np.argsort(np.argsort(z)) + 0.5) / NOISE_TABLE
        return np.interp(u, (np.arange(len(self.noise)) + 0.5) / len(self.noise), self.noise)  # flat beyond the ends

    def as_dict(self) -> dict:
        return asdict(self)


class CostModelExecutor:
    def __init__(self, cost: CostModel, noise_seed: int = 0, noise_path: np.ndarray | None = None):
        self.cost = cost
        self.coef = tuple(map(float, cost.coefficients()))  # plain floats: `execute` runs once per step
        self.per_swapped_block = float(cost.per_swapped_block)
        self.noise = cost.noise_table(noise_seed) if noise_path is None else np.resize(np.asarray(noise_path, np.float64), NOISE_TABLE)
        self.floor = 0.1 * cost.intercept or 1e-6  # a noisy step still takes some time

    def execute(self, step: Step, sched: Scheduler):
        c0, cp, cd, ckv, cps, cds, cqk = self.coef
        p, d = step.prefill_tokens, step.decode_tokens
        mean = c0 + cp * p + cd * d + ckv * step.kv_blocks + (cps if p else 0.0) + (cds if d else 0.0) + cqk * step.prefill_pairs
        if step.swapped_blocks:
            mean += self.per_swapped_block * step.swapped_blocks
        return max(mean + float(self.noise[step.index % NOISE_TABLE]), self.floor), None

    def decode_times(self, index: int, decode_tokens: np.ndarray, kv_blocks: np.ndarray) -> np.ndarray:
        """Times of a run of decode-only steps from step `index` (the same arithmetic as `execute`, elementwise;
        every step has decode tokens)."""
        c0, cp, cd, ckv, cps, cds, _ = self.coef
        mean = c0 + cd * decode_tokens + ckv * kv_blocks + cds
        start, n = index % NOISE_TABLE, len(kv_blocks)
        noise = self.noise[start:start + n] if start + n <= NOISE_TABLE else self.noise.take(np.arange(start, start + n), mode="wrap")
        return np.maximum(mean + noise, self.floor)


class ReplayExecutor:
    def __init__(self, step_times: list[float]):
        self.step_times = step_times

    def execute(self, step: Step, sched: Scheduler):
        return self.step_times[step.index], None

    def decode_times(self, index: int, decode_tokens: np.ndarray, kv_blocks: np.ndarray) -> np.ndarray:
        return np.asarray(self.step_times[index:index + len(kv_blocks)], dtype=np.float64)


def simulate(trace: Trace, config: SchedulerConfig, cost: CostModel, progress=None, step_by_step=False,
             noise_seed: int = 0, noise_path: np.ndarray | None = None) -> Scheduler:
    """step_by_step: no decode runs taken together (and each step's batch recorded). noise_seed: which draw of
    the cost model's noise the steps take; noise_path: a given noise instead (step i takes noise_path[i], e.g. a
    measured run's residuals)."""
    executor = CostModelExecutor(cost, noise_seed, noise_path)
    return Scheduler(trace, config, record_batches=step_by_step).run(executor, progress)


PREDICTION_DRAWS = 32


def expected_summary(trace: Trace, config: SchedulerConfig, cost: CostModel, draws: int = PREDICTION_DRAWS) -> dict:
    """The simulator's prediction of a trace's latency figures: each figure's mean over `draws` draws of the
    noise. One draw is one possible run; its medians and p90s of 320 requests stray up to 8% from the mean
    (bench/results/serving.json, one_draw_vs_prediction; a standard deviation of 4-5% per figure), which is the
    simulator's sampling noise, not its error. The mean of 32 draws cuts that to under 1% (of 8, it left about
    1.6%, a third of the 5% target), for 32 runs of the scheduler on the held-out trace, a small cost beside the
    engine's two runs of it."""
    runs = [latency_summary(simulate(trace, config, cost, noise_seed=seed)) for seed in range(draws)]
    return {k: runs[0][k] if k == "requests" else float(np.mean([r[k] for r in runs])) for k in runs[0]}


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
