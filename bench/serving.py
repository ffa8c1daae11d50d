"""Benchmark: the serving simulator's speed at 10k, 100k and 1M requests, and its fidelity against the
real engine on three held-out traces. Writes bench/results/serving.json.

Targets (issue 18): 100k requests simulated in <= 30 s and 1M in <= 5 min on 2 cores; simulated
median and p90 TTFT and TPOT and throughput within 5% of the real engine on held-out traces.
The cost model is fitted once, to three profiling runs of the engine (other seeds: ShareGPT-like at 8 and
16 requests/s, shared prefixes with prefix caching), and used for all. The engine serves each held-out
trace (320 requests) twice: how far it differs from itself is the noise a prediction of it is up against on this
shared machine (the load averages are recorded). The error is reported against its first run (the target) and
against the mean of its two runs (the engine's figure with half its own noise, as the prediction is the simulator's
mean). All nine engine runs are interleaved step by step and keep pace with
the longest, so they meet the same machine; each repeat joins 100 rounds late, so it does not share the first run's
moments. The prediction is the simulator's mean over 8 draws of its noise; how far one draw strays from it (four
other seeds) is recorded beside the error. `--quick` skips 1M.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from backend import experiments  # noqa: E402
from backend.device import describe  # noqa: E402
from backend.serving.engine import ModelExecutor, serve_interleaved, tiny_llama  # noqa: E402
from backend.serving.calibrate import BENCH_REQUESTS, REPEAT_LAG  # noqa: E402
from backend.serving.scheduler import SchedulerConfig  # noqa: E402
from backend.serving.simulator import FIDELITY_KEYS, CostModel, expected_summary, fidelity, latency_summary, simulate  # noqa: E402
from backend.serving.workload import shared_prefix, sharegpt_like  # noqa: E402

CONFIG = SchedulerConfig()  # the experiments' defaults
CACHING = SchedulerConfig(prefix_caching=True)
N = 160  # requests per profiling run
# Requests per held-out run: a p90 over n requests carries sampling noise shrinking as 1/sqrt(n); at 160 the engine
# differed from its own repeat by up to 7.5% on one figure, so 5% was not measurable there.
N_HELD_OUT = BENCH_REQUESTS
PROFILES = [(sharegpt_like(N, 8.0, 1000), CONFIG), (sharegpt_like(N, 16.0, 1001), CONFIG), (shared_prefix(N, 8.0, 1002), CACHING)]
HELD_OUT = {  # name: (trace, scheduler config)
    "sharegpt, 8 req/s": (sharegpt_like(N_HELD_OUT, 8.0, 0), CONFIG),
    "sharegpt, 16 req/s": (sharegpt_like(N_HELD_OUT, 16.0, 1), CONFIG),
    "shared prefix, 8 req/s, prefix caching": (shared_prefix(N_HELD_OUT, 8.0, 2), CACHING),
}


def main(quick: bool) -> None:
    torch.set_num_threads(1)
    model = tiny_llama(0)
    load = os.getloadavg()
    t0, cpu0 = time.perf_counter(), time.process_time()
    runs = PROFILES + [run for run in HELD_OUT.values() for _ in range(2)]
    lag = [0] * len(PROFILES) + [0, REPEAT_LAG] * len(HELD_OUT)  # each repeat joins late: same machine, other moments
    # every run keeps pace with the first held-out run (the longest: the lowest rate), so all their steps span the
    # same rounds and meet the same machine; run at once, the busier traces finished in the first half of its rounds
    lead = len(PROFILES)
    pace = [None if i == lead else lead for i in range(len(runs))]
    scheds = serve_interleaved(model, [(trace, config, False) for trace, config in runs], start_round=lag, pace_with=pace)
    engine_wall, engine_cpu = time.perf_counter() - t0, time.process_time() - cpu0
    swap = ModelExecutor(model, CONFIG).swap_seconds_per_block()  # measured, as calibration does
    cost = CostModel.fit([s.log.table() for s in scheds[:len(PROFILES)]], rounds=[s.rounds for s in scheds[:len(PROFILES)]],
                         per_swapped_block=swap)
    print(f"{len(runs)} engine runs of {N} requests interleaved in {engine_wall:.0f} s wall, {engine_cpu:.0f} s CPU; cost model: {cost}")
    held_out = []
    for i, (name, (trace, config)) in enumerate(HELD_OUT.items()):
        real, again = (latency_summary(s) for s in scheds[len(PROFILES) + 2 * i:len(PROFILES) + 2 * i + 2])
        sim = expected_summary(trace, config, cost)  # the mean of 8 noise draws: the prediction, not one sample of it
        errors, repeat = fidelity(real, sim), fidelity(real, again)
        both = {k: (real[k] + again[k]) / 2 for k in FIDELITY_KEYS}  # the engine's figure with its own noise halved
        errors_vs_both = fidelity(both, sim)
        others = []
        for seed in range(100, 104):  # single draws (other seeds than the prediction's), against the prediction: the spread one draw would have had
            others.append(fidelity(sim, latency_summary(simulate(trace, config, cost, noise_seed=seed))))
        held_out.append({"trace": name, "requests": len(trace), "real": real, "real_again": again, "simulated": sim,
                         "error": errors, "engine_vs_itself": repeat, "worst": max(abs(errors[k]) for k in FIDELITY_KEYS),
                         "error_vs_mean_of_both_engine_runs": errors_vs_both,
                         "worst_vs_mean_of_both_engine_runs": max(abs(errors_vs_both[k]) for k in FIDELITY_KEYS),
                         "engine_spread": max(abs(repeat[k]) for k in FIDELITY_KEYS),
                         "one_draw_vs_prediction": {k: max(abs(o[k]) for o in others) for k in FIDELITY_KEYS}})
        print(f"{name}: " + ", ".join(f"{k} {100 * v:+.1f}% (engine vs itself {100 * repeat[k]:+.1f}%)" for k, v in errors.items()))
    speed = []
    for n in (10_000, 100_000) if quick else (10_000, 100_000, 1_000_000):
        trace = sharegpt_like(n, 8.0, 3)
        start, cpu = time.perf_counter(), time.process_time()
        sched = simulate(trace, CONFIG, cost)
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
        speed.append({"requests": n, "steps": len(sched.log), "wall_s": wall, "cpu_s": cpu,
                      "requests_per_s": n / wall, "summary": latency_summary(sched)})
        print(f"{n:,} requests, {len(sched.log):,} steps: {wall:.1f} s wall, {cpu:.1f} s CPU ({n / wall:,.0f} requests/s)")
    by_n = {row["requests"]: row for row in speed}
    out = {"benchmark": "serving", "device": describe(), "code_version": experiments.code_version(),
           "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "load_average_at_start": load, "load_average_at_end": os.getloadavg(),
           "engine_runs": {"runs": len(runs), "profile_requests": N, "held_out_requests": N_HELD_OUT, "wall_s": engine_wall, "cpu_s": engine_cpu},
           "cost_model": cost.as_dict(), "fidelity": held_out, "speed": speed,
           "targets": {"fidelity within 5% (every figure, every held-out trace)": all(h["worst"] <= 0.05 for h in held_out),
                       "fidelity within twice the engine's own run-to-run spread": all(h["worst"] <= 2 * h["engine_spread"] for h in held_out),
                       "fidelity within 5% of the mean of the engine's two runs": all(h["worst_vs_mean_of_both_engine_runs"] <= 0.05 for h in held_out),
                       "100k requests <= 30 s of CPU": by_n[100_000]["cpu_s"] <= 30,
                       **({"1M requests <= 300 s of CPU": by_n[1_000_000]["cpu_s"] <= 300} if 1_000_000 in by_n else {})},
           "notes": "Engine step times are the engine thread's CPU time (robust to other processes, not to their cache "
                    "and memory-bandwidth pressure); the load averages say how busy the shared 2-core machine was. The "
                    "engine runs were interleaved step by step (profiles, held-out runs and their repeats meet the same "
                    "machine); each repeat joined 100 rounds late, so its spread includes the path of the machine's slow "
                    "drift, which the simulator cannot know either (it draws its own).",
           "gpu": "not measured: no GPU was lent to this task"}
    path = Path(__file__).parent / "results" / "serving.json"
    path.write_text(json.dumps(out, indent=1))
    print(f"wrote {path}: {out['targets']}")


if __name__ == "__main__":
    main("--quick" in sys.argv)
