"""Benchmark: the serving simulator's speed at 10k, 100k and 1M requests, and its fidelity against the
real engine on three held-out traces. Writes bench/results/serving.json.

Targets (issue 18): 100k requests simulated in <= 30 s and 1M in <= 5 min on 2 cores; simulated
median and p90 TTFT and TPOT and throughput within 5% of the real engine on held-out traces.
The cost model is fitted once, to three profiling runs of the engine (other seeds: ShareGPT-like at 8 and
16 requests/s, shared prefixes with prefix caching), and used for all. The engine serves each held-out trace (320
requests) ENGINE_REPEATS times: on this shared machine one run is one path of the machine's speed (its steps are
about 25% slow or fast together over tens of steps), and its latency figures move with that path. The error is reported
against the first run (the target as written) and against the mean of all runs (the engine's expected figure, with
the standard error of that mean). Two figures say where the error comes from: the cost model's mean step-time
error on the held-out run's own steps, and the simulator driven by the held-out run's own noise path (the measured
step time over the model's mean, step by step), which must give back the engine's figures: then what is left is
the noise path alone. All engine runs are interleaved step by step and keep pace with the longest, so they meet the
same machine; repeat i joins i * 100 rounds late, so no two share their moments. The prediction is the simulator's
mean over 32 draws of its noise; how far one draw strays from it (four other seeds) is recorded beside the error.
`noise` holds what the simulator's noise model rests on, measured on the held-out runs' steps (`noise_evidence`).
`--quick` skips 1M.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from backend import experiments  # noqa: E402
from backend.device import describe  # noqa: E402
from backend.serving.engine import ModelExecutor, serve_interleaved, tiny_llama  # noqa: E402
from backend.serving.calibrate import REPEAT_LAG  # noqa: E402
from backend.serving.schema import BENCH_REQUESTS  # noqa: E402
from backend.serving.scheduler import SchedulerConfig  # noqa: E402
from backend.serving.simulator import (DRIFT_LAGS, FIDELITY_KEYS, CostModel, autocorrelation, clip_tails, expected_summary,  # noqa: E402
                                      fidelity, latency_summary, simulate)
from backend.serving.workload import shared_prefix, sharegpt_like  # noqa: E402

# Why the simulator's cost model and its calibration are what they are, with the figures measured on the way; written
# into the results' notes (backend/serving/simulator.py and calibrate.py keep the model, this keeps its history).
MODEL_HISTORY = {
    'simulator: the indicator terms c_pp, c_dp':
        "They are the fixed costs of the engine's two attention paths (padded SDPA for prefill chunks, the "
        'gather-softmax over blocks for decodes: each a dozen torch calls per layer whatever the batch), which a '
        'step pays once for each path it uses; without them a step that mixes both was under-predicted by a '
        'third.',
    'simulator: c_bd, the second decode':
        "A lone decode's matrix products are matrix-vector products: the second decode added 0.3-0.44 ms where "
        'each of the next few added 0.15-0.3 ms (noise.decode_only_steps). A linear term over-predicted lone '
        'decodes by 1-4% and pairs and triples by 1-2%, and a fit to low-load steps over-predicted a busier '
        "trace's p90 TPOT by up to 14%; with the term, up to 9%.",
    'simulator: c_qk, prefill (query, key) pairs':
        "A prefill chunk's attention grows with its tokens times their context (the pairs its padded SDPA scores,"
        " see TorchPagedAttention): at the tiny model's width it costs about as much as the chunk's projections "
        'and MLP, so a linear term alone under-predicted long chunks, and the decodes batched with them waited '
        'longer than the simulator said (the p90 TPOT at 16 requests/s came out 7-12% low).',
    'simulator: designed steps beside the profiles':
        'The coefficients are fitted by non-negative least squares to the steps of profiling runs of the real '
        'engine, beside designed steps in which the terms a trace moves together (decode tokens and KV blocks, '
        'chunk tokens and pairs) vary on their own.',
    'simulator: c_swap measured, not fitted':
        'The engine times copies of its own KV blocks to CPU memory and back '
        '(ModelExecutor.swap_seconds_per_block), since a profile at the default pool size never preempts and a '
        'fit would have no swaps to see.',
    'simulator: relative noise':
        "A step's spread grows with its length: on the 2-core box the residuals' standard deviation was 21-23% of"
        ' the predicted time for steps predicted at 4.5, 5.7, 9.4 and 12.8 ms in one capture, and 9.6-9.8% for '
        'steps of 3.5 to 6 ms on a quieter machine (noise.spread_by_predicted_step). Added in seconds, the same '
        'noise for every step, long steps came out too narrow and their median too high (the TTFT p50, set by a '
        "prompt's one prefill step, came out 1-7% high in every run).",
    'simulator: drifting noise':
        "The residuals are neither small (10-20% of a step) nor independent: the machine's speed drifts over tens"
        " of steps (other people's work in the caches and memory bus), so a request's steps tend to be slow "
        'together, which widens the spread of TPOT and TTFT across requests (the p90s) well beyond what '
        'independent noise gives. Hence the 64 quantiles of the relative residuals and two AR(1) drifts (one '
        'fading within tens of steps, one over seconds) plus independent noise, fitted at lags 1 to 80.',
    'calibration: interleaved runs':
        'On a shared machine the speed drifts by 10-30% over seconds, and runs made one after the other would '
        'each meet a different machine. The repeat joins REPEAT_LAG rounds late: the same machine, but not the '
        "same moments, so its difference from the first run includes the drift's path, which no prediction can "
        "know (started together, the two runs shared that path and differed by only 2-6%: the engine's "
        'repeatability with the drift taken out, not what a prediction of one run is up against).',
    'calibration: pacing':
        "Run at once, the profiles' ~250 steps were done in the first quarter of the held-out run's ~500 rounds, "
        "so the fit met only that quarter's machine, and the held-out run's later steps took from 0.85 to 1.7 "
        'times what it predicted (the median per 100 rounds, default settings): that, not preemption, made the '
        'error swing (no default run preempted, swap or recompute). Paced, they step in bursts spread over the '
        "whole held-out run. Pacing moves no engine's clock (each counts only its own steps' CPU time), only the "
        'moments its steps meet.',
    'calibration: the mean of 32 draws':
        "One draw of the simulator's noise is one possible run, whose medians and p90s over 320 requests stray up"
        ' to 8% from the mean; the prediction compared is the mean over 32 draws (expected_summary).',
}

CONFIG = SchedulerConfig()  # the experiments' defaults
CACHING = SchedulerConfig(prefix_caching=True)
N = 160  # requests per profiling run
# Requests per held-out run: a p90 over n requests carries sampling noise shrinking as 1/sqrt(n); at 160 the engine
# differed from its own repeat by up to 7.5% on one figure, so 5% was not measurable there.
N_HELD_OUT = BENCH_REQUESTS
ENGINE_REPEATS = 4  # runs of each held-out trace: the mean of 4 has half the noise of one
PROFILES = [(sharegpt_like(N, 8.0, 1000), CONFIG), (sharegpt_like(N, 16.0, 1001), CONFIG), (shared_prefix(N, 8.0, 1002), CACHING)]
HELD_OUT = {  # name: (trace, scheduler config)
    "sharegpt, 8 req/s": (sharegpt_like(N_HELD_OUT, 8.0, 0), CONFIG),
    "sharegpt, 16 req/s": (sharegpt_like(N_HELD_OUT, 16.0, 1), CONFIG),
    "shared prefix, 8 req/s, prefix caching": (shared_prefix(N_HELD_OUT, 8.0, 2), CACHING),
}


class HostSteal:
    """The share of this virtual machine's CPU time the host gave to others (steal, from /proc/stat), sampled every
    `every` seconds in a thread: what made one engine run's steps slower than another's, recorded beside them."""

    def __init__(self, every: float = 5.0):
        import threading

        self.every, self.samples, self._stop = every, [], threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    @staticmethod
    def _counters() -> tuple[int, int] | None:
        try:
            fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
        except (OSError, ValueError):
            return None
        return fields[7], sum(fields)  # steal, all

    def _sample(self) -> None:
        last = self._counters()
        while last:
            stopped = self._stop.wait(self.every)
            now = self._counters()
            if now[1] > last[1]:  # the last window is shorter when stopped: a run under 5 s still gets its one sample
                self.samples.append(100 * (now[0] - last[0]) / (now[1] - last[1]))
            last = None if stopped else now

    def __enter__(self) -> "HostSteal":
        self._thread.start()
        return self

    def __exit__(self, *_) -> None:
        self._stop.set()
        self._thread.join()

    def summary(self) -> dict:
        if not self.samples:
            return {"note": "no /proc/stat here: not measured"}
        q = np.percentile(self.samples, [50, 90, 100])
        return {"every_s": self.every, "median_percent": round(float(q[0]), 1), "p90_percent": round(float(q[1]), 1),
                "max_percent": round(float(q[2]), 1), "samples": [round(v, 1) for v in self.samples]}


def noise_evidence(cost: CostModel, tables: list[dict], rounds: list[list[int]]) -> dict:
    """What the simulator's noise model rests on, measured on the held-out runs' steps (not those it was fitted to):
    the residuals' spread against the step's predicted time (relative noise: their ratio stays put), their
    autocorrelation by rounds beside the fitted drifts', how much engines stepping in the same round share it (the
    machine's speed, not a model misfit), and decode-only steps by batch size against the cost model (the
    batched-decode term)."""
    pred = np.concatenate([cost.predict_steps(t) for t in tables])
    time_ = np.concatenate([t["time"] for t in tables])
    edges = np.quantile(pred, [0, 0.5, 0.8, 0.95, 0.99, 1])
    spread = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        m = (pred >= lo) & (pred <= hi)
        r = time_[m] - pred[m]
        spread.append({"predicted_ms": 1e3 * float(pred[m].mean()), "steps": int(m.sum()), "residual_sd_ms": 1e3 * float(r.std()),
                       "sd_over_predicted": float(r.std() / pred[m].mean()), "median_over_predicted": float(np.median(r / pred[m]))})
    relative = [cost.relative_residuals(t) for t in tables]
    pooled = np.concatenate(relative)
    clipped = np.split(clip_tails(pooled - pooled.mean()), np.cumsum([len(r) for r in relative])[:-1])
    dense = np.full((len(tables), max(r[-1] for r in rounds) + 1), np.nan)
    for i, (r, at) in enumerate(zip(clipped, rounds)):
        dense[i, at] = r - r.mean()
    same_round = []
    for i in range(len(tables)):
        for j in range(i + 1, len(tables)):
            both = ~np.isnan(dense[i]) & ~np.isnan(dense[j])
            same_round.append(float(np.corrcoef(dense[i, both], dense[j, both])[0, 1]))
    decodes, prefill = [], np.concatenate([t["prefill_tokens"] for t in tables])
    count = np.concatenate([t["decode_tokens"] for t in tables])
    for d in range(1, 9):
        m = (prefill == 0) & (count == d)
        if m.any():
            decodes.append({"decodes": d, "steps": int(m.sum()), "measured_ms": 1e3 * float(time_[m].mean()),
                            "predicted_ms": 1e3 * float(pred[m].mean())})
    return {"spread_by_predicted_step": spread,
            "autocorrelation": {"lags_rounds": list(DRIFT_LAGS), "measured": autocorrelation(clipped, rounds).tolist(),
                                "fitted": cost.autocorrelation(DRIFT_LAGS).tolist()},
            "same_round_correlation_between_engines": {"median": float(np.median(same_round)), "min": float(np.min(same_round)),
                                                       "max": float(np.max(same_round)), "pairs": len(same_round)},
            "decode_only_steps": decodes}


def engine_runs(model) -> tuple[list, dict, CostModel]:
    """Every engine run (the profiles, then each held-out trace ENGINE_REPEATS times) interleaved step by step, and
    the cost model fitted to the profiles. Returns (the runs' schedulers, their figures, the cost model)."""
    t0, cpu0 = time.perf_counter(), time.process_time()
    runs = PROFILES + [run for run in HELD_OUT.values() for _ in range(ENGINE_REPEATS)]
    # each repeat joins later: the same machine, other moments
    lag = [0] * len(PROFILES) + [i * REPEAT_LAG for i in range(ENGINE_REPEATS)] * len(HELD_OUT)
    # every run keeps pace with the first held-out run (the longest: the lowest rate), so all their steps span the
    # same rounds and meet the same machine; run at once, the busier traces finished in the first half of its rounds
    lead = len(PROFILES)
    pace = [None if i == lead else lead for i in range(len(runs))]
    with HostSteal() as engine_steal:
        scheds = serve_interleaved(model, [(trace, config, False) for trace, config in runs], start_round=lag, pace_with=pace)
    engine_wall, engine_cpu = time.perf_counter() - t0, time.process_time() - cpu0
    probe = ModelExecutor(model, CONFIG)  # swap copies and designed steps measured, as calibration does
    cost = CostModel.fit([s.log.table() for s in scheds[:len(PROFILES)]], rounds=[s.rounds for s in scheds[:len(PROFILES)]],
                         per_swapped_block=probe.swap_seconds_per_block(), designed=probe.designed_steps(CONFIG))
    print(f"{len(runs)} engine runs interleaved in {engine_wall:.0f} s wall, {engine_cpu:.0f} s CPU; cost model: {cost}")
    figures = {"runs": len(runs), "profile_requests": N, "held_out_requests": N_HELD_OUT, "runs_per_held_out_trace": ENGINE_REPEATS,
               "wall_s": engine_wall, "cpu_s": engine_cpu, "host_steal": engine_steal.summary()}
    return scheds, figures, cost


def held_out_fidelity(name: str, trace, config, cost, engine: list) -> dict:
    """One held-out trace: the simulator's prediction (mean of 32 noise draws) against the engine's first run and
    the mean of its repeats, the cost model's step error, the simulator on the run's own noise path, and how far
    single draws stray from the prediction."""
    reals = [latency_summary(s) for s in engine]
    real = reals[0]
    sim = expected_summary(trace, config, cost)  # the mean of 32 noise draws: the prediction, not one sample of it
    errors = fidelity(real, sim)
    repeats = [fidelity(real, again) for again in reals[1:]]
    mean = {k: float(np.mean([r[k] for r in reals])) for k in FIDELITY_KEYS}
    sem = {k: float(np.std([r[k] for r in reals], ddof=1) / np.sqrt(len(reals)) / mean[k]) for k in FIDELITY_KEYS}
    errors_vs_mean = fidelity(mean, sim)
    steps = engine[0].log.table()
    own_path = latency_summary(simulate(trace, config, cost, noise_path=cost.relative_residuals(steps)))
    others = []
    for seed in range(100, 104):  # single draws (other seeds than the prediction's), against the prediction: the spread one draw would have had
        others.append(fidelity(sim, latency_summary(simulate(trace, config, cost, noise_seed=seed))))
    print(f"{name}: " + ", ".join(f"{k} {100 * v:+.1f}% (vs the mean of {len(reals)} runs {100 * errors_vs_mean[k]:+.1f}% "
                                  f"± {100 * sem[k]:.1f})" for k, v in errors.items()))
    return {"trace": name, "requests": len(trace), "real": real, "real_repeats": reals[1:], "simulated": sim,
            "error": errors, "worst": max(abs(errors[k]) for k in FIDELITY_KEYS),
            "engine_vs_itself": {k: max((r[k] for r in repeats), key=abs) for k in FIDELITY_KEYS},
            "engine_spread": max(abs(r[k]) for r in repeats for k in FIDELITY_KEYS),
            "engine_mean": mean, "engine_mean_standard_error": sem,
            "error_vs_engine_mean": errors_vs_mean,
            "worst_vs_engine_mean": max(abs(errors_vs_mean[k]) for k in FIDELITY_KEYS),
            "cost_model_step_error": cost.step_error(steps),
            "error_given_the_runs_own_noise_path": fidelity(real, own_path),
            "one_draw_vs_prediction": {k: max(abs(o[k]) for o in others) for k in FIDELITY_KEYS}}


def simulator_speed(cost, quick: bool) -> list[dict]:
    """Wall and CPU seconds to simulate 10k, 100k (and 1M) ShareGPT-like requests, with the host's steal beside them."""
    speed = []
    for n in (10_000, 100_000) if quick else (10_000, 100_000, 1_000_000):
        trace = sharegpt_like(n, 8.0, 3)
        start, cpu = time.perf_counter(), time.process_time()
        with HostSteal() as steal:
            sched = simulate(trace, CONFIG, cost)
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
        speed.append({"requests": n, "steps": len(sched.log), "wall_s": wall, "cpu_s": cpu,
                      "requests_per_s": n / wall, "host_steal": steal.summary(), "summary": latency_summary(sched)})
        print(f"{n:,} requests, {len(sched.log):,} steps: {wall:.1f} s wall, {cpu:.1f} s CPU ({n / wall:,.0f} requests/s)")
    return speed


def main(quick: bool) -> None:
    torch.set_num_threads(1)
    model = tiny_llama(0)
    load = os.getloadavg()
    scheds, engine_figures, cost = engine_runs(model)
    held_out = []
    for i, (name, (trace, config)) in enumerate(HELD_OUT.items()):
        engine = scheds[len(PROFILES) + ENGINE_REPEATS * i:len(PROFILES) + ENGINE_REPEATS * (i + 1)]
        held_out.append(held_out_fidelity(name, trace, config, cost, engine))
    held_scheds = scheds[len(PROFILES):]
    noise = noise_evidence(cost, [s.log.table() for s in held_scheds], [s.rounds for s in held_scheds])
    print("noise: sd/predicted by predicted step " + ", ".join(f"{b['predicted_ms']:.1f} ms {100 * b['sd_over_predicted']:.0f}%" for b in noise["spread_by_predicted_step"])
          + "; autocorrelation measured " + " ".join(f"{v:.2f}" for v in noise["autocorrelation"]["measured"])
          + " fitted " + " ".join(f"{v:.2f}" for v in noise["autocorrelation"]["fitted"]))
    speed = simulator_speed(cost, quick)
    by_n = {row["requests"]: row for row in speed}
    out = {"benchmark": "serving", "device": describe(), "code_version": experiments.code_version(),
           "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "load_average_at_start": load, "load_average_at_end": os.getloadavg(),
           "engine_runs": engine_figures,
           "cost_model": cost.as_dict(), "fidelity": held_out, "noise": noise, "speed": speed,
           "targets": {"fidelity within 5% of the engine's first run (every figure, every held-out trace)": all(h["worst"] <= 0.05 for h in held_out),
                       f"fidelity within 5% of the mean of the engine's {ENGINE_REPEATS} runs": all(h["worst_vs_engine_mean"] <= 0.05 for h in held_out),
                       "100k requests <= 30 s of CPU": by_n[100_000]["cpu_s"] <= 30,
                       **({"1M requests <= 300 s of CPU": by_n[1_000_000]["cpu_s"] <= 300} if 1_000_000 in by_n else {})},
           "notes": "Engine step times are the engine thread's CPU time (robust to other processes, not to their cache "
                    "and memory-bandwidth pressure); the load averages say how busy the shared 2-core machine was, host_steal how much of "
                    "its CPU the host gave to other machines (per 5 s). The "
                    f"engine runs were interleaved step by step and paced; repeat i of a held-out trace joined {REPEAT_LAG} * i "
                    "rounds late, so its spread includes the path of the machine's slow drift, which the simulator cannot know "
                    "either (it draws its own). error_given_the_runs_own_noise_path: the simulator with the run's measured "
                    "residuals as its noise, step by step (0 when the scheduler and cost model explain the run exactly).",
           "model_history": MODEL_HISTORY,
           "gpu": "not measured: no GPU was lent to this task"}
    path = Path(__file__).parent / "results" / "serving.json"
    path.write_text(json.dumps(out, indent=1))
    print(f"wrote {path}: {out['targets']}")


if __name__ == "__main__":
    main("--quick" in sys.argv)
