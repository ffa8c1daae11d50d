"""What the Serving page reads besides a run's result: the bigger runs it links to, and the benchmark figures its
intro quotes. Plain values, no mechanism: the page imports this and the frame only; the experiments import it too."""

# The defaults (serving.engine: 10 profiling and 12 held-out requests) take about 9 s of CPU on 2 cores, so the page's first
# visit shows a result within 15 s; bigger runs, one click away on the page, the largest the server's default time budget
# (120 s) accepts: more requests make the fidelity figures less noisy (bench/serving.py uses 320 per held-out trace).
BIG = {"engine": {"profile_requests": 48, "held_out_requests": 40, "sweep_requests": 1000},
       "simulate": {"profile_requests": 32, "held_out_requests": 32, "sweep_requests": 1000, "n_requests": 30_000}}

# bench/serving.py's held-out traces, its worst error on them and the engine's widest difference from its own repeat there
BENCH_REQUESTS, BENCH_WORST_ERROR, BENCH_ENGINE_SPREAD = 320, 0.0358, 0.0441

# A run's metric holding the paragraph on its cost model (the fit, the designed steps, the noise), in markdown.
COST_SUMMARY = "cost.summary"
