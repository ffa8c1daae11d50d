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

# The result keys both serving experiments declare (their Schemas, beside each experiment), named once here.
SUMMARY = ("requests", "steps", "duration_s", "throughput_tok_s", "throughput_req_s", "preemptions", "ttft_p50",
           "ttft_p90", "ttft_p99", "tpot_p50", "tpot_p90", "tpot_p99", "e2e_p50", "e2e_p90", "e2e_p99")  # a run's figures
FIDELITY = ("ttft_p50", "ttft_p90", "tpot_p50", "tpot_p90", "throughput_tok_s")  # simulated against real, and real twice
COST = ("intercept", "per_prefill_token", "per_decode_token", "per_kv_block", "per_prefill_step", "per_decode_step",
        "per_prefill_pair", "per_batched_decode_step", "per_swapped_block", "drift_share", "drift_persistence",
        "slow_drift_share", "slow_drift_persistence", "rmse", "mape", "r2", "steps", "designed_steps")  # the fitted model


def each(prefix: str, names: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(f"{prefix}.{name}" for name in names)


CALIBRATION_METRICS = (*each("real", SUMMARY), *each("simulated", SUMMARY), *each("error", FIDELITY),
                       *each("repeat", FIDELITY), "fidelity_target_met", "fidelity_within_noise", "fidelity_tolerance",
                       "cost_model_step_error", *each("cost", COST), COST_SUMMARY, "knee_rate")
LOAD_COLUMNS = ("e2e_p50", "e2e_p90", "preemptions", "rate", "source", "throughput_req_s", "throughput_tok_s", "tpot_p50",
                "tpot_p90", "ttft_p50", "ttft_p90")
CALIBRATION_TABLES = {
    "latency": ("e2e", "request", "source", "tpot", "ttft", "ttft_share", "tpot_share", "e2e_share"),  # share: its CDF
    "steps": ("decode_tokens", "end", "kv_blocks", "predicted_ms", "prefill_tokens", "requests", "running", "start",
              "step", "swapped", "swapped_blocks", "time_ms", "waiting"),
    "load": LOAD_COLUMNS,
    "cost_model": ("coefficient_us", "term"),
}
