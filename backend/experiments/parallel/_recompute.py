"""The pipeline page's checks of recomputation (seed 003: GPipe's re-materialisation costs about a third more compute).

The loop measures (parallel/pp/recompute.py, mesh_train.recompute_price) each rank's activation peak, and one step of
the same plan with and without recomputation, timed and FLOP-counted forward by forward. The models, per micro-batch
of b samples on a stage of L Linear(h, h)+tanh layers:
  forward FLOPs 2·b·h²·L (one GEMM per layer); recomputation adds exactly one forward per micro-batch per stage;
  held for backward (float64): the input and every tanh output, (L + 1)·b·h·8 bytes (the last stage also the
  loss's difference, +b·h·8); with recomputation only the input, b·h·8, until its backward rebuilds the rest.
  A rank that holds k micro-batches at its peak (the schedule's bound) thus peaks at k·A without recomputation
  and at k·A_in + (A − A_in) with it (the micro-batch being back-propagated is whole again).
Time: forward + backward ≈ 3 units (backward two GEMMs per forward GEMM), with recomputation 4: +33 %; the
prediction from this run's own measured forward and backward CPU times is F / (F + B).
"""
from __future__ import annotations

from statistics import median_high

from backend.result import Check

ITEM = 8  # float64


def forward_flops_model(config, layers: int) -> int:
    """2·b·h²·L: one micro-batch's forward through a stage of `layers` Linear(h, h) (FlopCounterMode counts a GEMM
    of m×k by k×n as 2·m·n·k, and nothing else in this model)."""
    b = config.batch // config.plan.microbatches(config.microbatches)
    return 2 * b * config.hidden * config.hidden * layers


def activation_model(config, layers: int, last: bool) -> tuple[int, int]:
    """(A, A_in): bytes one micro-batch holds for backward on a stage, without and with recomputation."""
    b = config.batch // config.plan.microbatches(config.microbatches)
    return (layers + 1 + int(last)) * b * config.hidden * ITEM, b * config.hidden * ITEM


def peak_model(config, layers: int, last: bool, bound: int, recompute: bool) -> int:
    full, kept = activation_model(config, layers, last)
    return bound * kept + (full - kept) if recompute else bound * full


MIN_TIMED_CPU_MS = 50.0  # below this much compute per run, CPU-time ratios are mostly timer and scheduler noise
TIME_TOLERANCE = 0.50    # relative: two runs seconds apart on a 2-core machine at load ~45 (bench/recompute.py:
                         # 0.85-1.31); recomputing twice (2) or not at all (0) still fails it; FLOPs are checked exactly


def time_ratio(prices: list[dict]) -> float:
    """A recomputation's CPU time over a forward's: the median of every rank's recomputations over the median of
    every rank's forwards in the same plan's step without recomputation (noise only adds: medians, not means)."""
    return (median_high([t for pr in prices for t in pr["recompute_cpu_us"]])
            / median_high([t for pr in prices for t in pr["without_forward_cpu_us"]]))


def time_check(prices: list[dict], overhead: float, predicted: float) -> Check:
    """A recomputation takes one forward's time (time_ratio within TIME_TOLERANCE of 1), beside the run's CPU time
    overhead and the F/(F+B) it predicts."""
    ratio = time_ratio(prices)
    return Check("a recomputation takes the time of one forward (CPU time, within 50 %)", abs(ratio - 1),
                 TIME_TOLERANCE, reference="the forwards of the plan's step without recomputation (median, all ranks)",
                 detail=f"recompute ÷ forward {ratio:.2f}; whole run +{100 * overhead:.1f} % CPU time, "
                        f"F/(F+B) predicts +{100 * predicted:.1f} %, the textbook +33 %")


def price(config, payloads: list[dict], stage_layers) -> tuple[list[Check], dict, list[dict], list[str]]:
    """What recomputation cost and saved in this run: each rank's price from the loop (its `price`, the steps with and
    without it) and its live peak, against the models above: (checks, metrics, per-(rank, stage) rows, notes)."""
    plan, p, S = config.plan, config.world_size, config.num_stages
    m = plan.microbatches(config.microbatches)
    rows, flops_err, peak_err = [], 0, 0
    totals = {"flops_with": 0, "flops_without": 0, "extra_forward": 0, "extra_model": 0, "cpu_with": 0.0,
              "cpu_without": 0.0, "forward_without": 0.0, "recompute": 0.0}
    for pl in payloads:
        pr, r = pl["price"], pl["rank"]
        cpu = {"cpu_with": sum(pr["with_cpu_us"].values()) / 1e3,
               "cpu_without": sum(pr["without_cpu_us"].values()) / 1e3,
               "forward_without": pr["without_cpu_us"]["F"] / 1e3, "recompute": sum(pr["recompute_cpu_us"]) / 1e3,
               "median_forward": median_high([t / 1e3 for t in pr["without_forward_cpu_us"]]),
               "median_recompute": median_high([t / 1e3 for t in pr["recompute_cpu_us"]])}
        for key in ("cpu_with", "cpu_without", "forward_without", "recompute"):
            totals[key] += cpu[key]
        totals["flops_with"] += pr["with_flops"]
        totals["flops_without"] += pr["without_flops"]
        for s in sorted({f["stage"] for f in pr["without_forwards"]}):
            layers, last = stage_layers(config, s), s == S - 1
            plain = [f["flops"] for f in pr["without_forwards"] if f["stage"] == s]
            done = [f["flops"] for f in pr["with_forwards"] if f["stage"] == s]
            extra = sum(done) - sum(plain)
            totals["extra_forward"] += extra
            totals["extra_model"] += m * forward_flops_model(config, layers)
            flops_err = max([flops_err] + [abs(f - forward_flops_model(config, layers)) for f in plain])
            bound = plan.live_bound(p, m, r)
            model_with, model_without = (peak_model(config, layers, last, bound, flag) for flag in (True, False))
            peak_err = max(peak_err, abs(pl["activation_peak_bytes"] - model_with),
                           abs(pr["peak_without"] - model_without))
            rows.append({"rank": r, "stage": s, "forwards": len(done), "forwards_without": len(plain),
                         "forward_flops_per_microbatch": plain[0], "extra_forward_flops": extra,
                         "peak_activation_bytes": pl["activation_peak_bytes"], "peak_model_bytes": model_with,
                         "peak_without_bytes": pr["peak_without"], "peak_without_model_bytes": model_without,
                         "saved_bytes": pr["peak_without"] - pl["activation_peak_bytes"],
                         "compute_cpu_ms": cpu["cpu_with"], "compute_cpu_without_ms": cpu["cpu_without"],
                         "recompute_cpu_ms": cpu["recompute"], "forward_cpu_without_ms": cpu["forward_without"],
                         "median_recompute_cpu_ms": cpu["median_recompute"],
                         "median_forward_cpu_without_ms": cpu["median_forward"]})
    checks = [
        Check("forward FLOPs per micro-batch per stage, counted, equal 2·b·h²·L", flops_err, 0,
              reference="torch.utils.flop_counter's per-op formulas (parallel/recompute.FlopCount) "
                        "against the GEMM count"),
        Check("recomputation's extra forward FLOPs equal one forward per micro-batch per stage",
              abs(totals["extra_forward"] - totals["extra_model"]), 0,
              reference="seed 003: the backward re-runs each stage's forward once; m · Σ 2·b·h²·L",
              detail=f"{totals['extra_forward']:,} counted, {totals['extra_model']:,} modelled"),
        Check("peak activation bytes per rank, with and without recomputation, equal the model", peak_err, 0,
              reference="k·A without, k·A_in + (A − A_in) with (k: the schedule's live bound); bytes of the storages "
                        "autograd saved, parameters excluded")]
    overhead = totals["cpu_with"] / totals["cpu_without"] - 1
    predicted = totals["forward_without"] / totals["cpu_without"]
    metrics = {"recompute_flops_overhead": round(totals["flops_with"] / totals["flops_without"] - 1, 4),
               "recompute_time_overhead": round(overhead, 4), "recompute_time_model": round(predicted, 4),
               "recompute_textbook_overhead": round(1 / 3, 4),
               "activation_peak_saved_bytes": max(row["saved_bytes"] for row in rows),
               "recompute_cpu_ms": round(totals["recompute"], 3),
               "recompute_to_forward_time": round(time_ratio([pl["price"] for pl in payloads]), 4)}
    notes = [f"Recomputation re-ran {totals['extra_forward']:,} forward FLOPs "
             f"(+{100 * metrics['recompute_flops_overhead']:.1f} % of all GEMM FLOPs; "
             f"the textbook 3 → 4 units is +33 %, more here because stage 0 computes no input gradient, "
             f"so its backward is smaller) and cost +{100 * overhead:.1f} % CPU time against the "
             f"same run without it, to hold up to {metrics['activation_peak_saved_bytes']:,} fewer activation bytes "
             f"on a rank."]
    if totals["cpu_without"] < MIN_TIMED_CPU_MS:
        notes.append(f"A step's compute took {totals['cpu_without']:.1f} ms of CPU, too little to time its "
                     f"+{100 * predicted:.0f} % against the clock's noise, so the time overhead is shown but not "
                     "checked (a larger hidden size or batch makes it longer).")
    else:
        checks.append(time_check([pl["price"] for pl in payloads], overhead, predicted))
    return checks, metrics, rows, notes
