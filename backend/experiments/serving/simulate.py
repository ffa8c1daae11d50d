"""serving.simulate: the engine's scheduler driven by a cost model, at any scale.

Every run first calibrates: the real engine serves a profiling trace (the cost model is fitted to
its steps) and a held-out trace (the fidelity: simulated vs real on requests the fit never saw).
Then the simulator serves the big trace, sweeps the request rate (the load curve and its knee), and
flips each knob once for a side-by-side against the settings as given.
"""
from __future__ import annotations

import dataclasses
import time

import numpy as np

from backend.config import ConfigError, setting
from backend.experiments import define
from backend.result import Check, Result, Schema
from backend.serving.report import (cost_rows, cost_summary_written, knee, latency_rows, latency_shares_written, load_row, step_rows,
                                    with_shares)
from backend.serving.schema import CALIBRATION_METRICS, CALIBRATION_TABLES, LOAD_COLUMNS, SUMMARY, each
from backend.experiments.serving._settings import ServingSettings
from backend.serving.simulator import latency_summary, simulate


KNOBS = {  # the flipped value of each knob, for the side-by-side
    "block_size": lambda c: 32 if c.block_size != 32 else 16,
    "max_batch": lambda c: c.max_batch * 2,
    "token_budget": lambda c: max(c.max_batch, c.token_budget // 2),
    "prefix_caching": lambda c: not c.prefix_caching,
    "preemption": lambda c: "swap" if c.preemption == "recompute" else "recompute",
    "policy": lambda c: "fcfs" if c.policy == "chunked" else "chunked",
}


@dataclasses.dataclass
class SimulateConfig(ServingSettings):
    n_requests: int = setting(5_000, min=10, max=1_000_000, help="requests in the simulated trace")

    cost_drivers = ("n_requests", "sweep_requests", "held_out_requests", "profile_requests")

    def estimate(self):
        """The big trace, its first 500 again together and step by step (the slow way: 5 s allowed), 11 load-curve
        points and 7 knob runs of sweep_requests each."""
        return self.serving_cost(0, self.n_requests + 2 * min(self.n_requests, 500) + 18 * self.sweep_requests, seconds=5.0)


def run(config: SimulateConfig, ctx) -> Result:
    _, cal = config.calibrate(lambda f, m: ctx.progress(0.3 * f, m))
    cost, sched_config = cal.cost, config.scheduler_config()

    trace = config.requests(config.n_requests, config.seed + 1)  # the uploaded trace's first n_requests, if one is set
    ctx.progress(0.3, f"simulating {len(trace):,} requests")
    start = time.perf_counter()
    big = simulate(trace, sched_config, cost, progress=lambda f: ctx.progress(0.3 + 0.4 * f, "simulating"))
    seconds = time.perf_counter() - start
    summary = latency_summary(big)
    head = trace.head(min(len(trace), 500))  # decode runs taken together vs one step at a time
    fast, slow = simulate(head, sched_config, cost), simulate(head, sched_config, cost, step_by_step=True)
    runs_gap = int(np.sum(fast.finish != slow.finish) + np.sum(fast.first_token != slow.first_token) + abs(len(fast.log) - len(slow.log)))

    ctx.progress(0.7, "load curve")
    sweep = config.synthetic(config.sweep_requests, config.seed + 2)
    load = [load_row(simulate(config.synthetic(config.sweep_requests, config.seed + 2, rate), sched_config, cost), rate, "simulated")
            for rate in config.rate * np.geomspace(0.25, 8, 11)]
    ctx.progress(0.85, "knobs, one at a time")
    knobs = [dict(load_row(simulate(sweep, sched_config, cost), config.rate, "as set"), knob="(as set)", setting="")]
    for name, flip in KNOBS.items():
        other = dataclasses.replace(config, **{name: flip(config)})
        try:
            other.validate()
        except ConfigError as err:  # the flipped value breaks a rule: say so instead of simulating it
            knobs.append({"knob": name, "setting": str(getattr(other, name)), "source": f"not run: {err}"})
            continue
        knobs.append(dict(load_row(simulate(sweep, other.scheduler_config(), cost), config.rate, "flipped"),
                          knob=name, setting=str(getattr(other, name))))

    checks = [
        *cal.checks(),
        Check("decode runs taken together give the step-by-step schedule", runs_gap, 0,
              reference="the same simulation one step at a time (first 500 requests)",
              detail="differing first-token and finish times, plus the difference in step count"),
        Check("every simulated request generated its output", int(np.sum(big.generated != trace.output_len)), 0,
              reference="the trace's output lengths"),
    ]
    metrics = {**cal.metrics(), **{f"scale.{k}": v for k, v in summary.items()},
               "simulation_seconds": seconds, "simulated_requests_per_second": len(trace) / seconds, "knee_rate": knee(load)}
    sample = set(np.linspace(0, len(trace) - 1, min(len(trace), 3000)).astype(int).tolist())
    latency = [row for row in latency_rows(big, "simulated") if row["request"] in sample]
    notes = [cal.note(), cal.fidelity_note(), f"{len(trace):,} requests ({len(big.log):,} steps) simulated in {seconds:.1f} s "
             f"({len(trace) / seconds:,.0f} requests/s of simulation)."]
    return Result(metrics=metrics, checks=checks, notes=notes,
                  tables={"load": load, "knobs": knobs, "latency": with_shares(latency + latency_rows(cal.real, "real (held-out)")
                                                                   + latency_rows(cal.simulated, "simulated (held-out)")),
                          "steps": step_rows(big, cost, limit=2000), "cost_model": cost_rows(cost)})


RESULT = Schema(
    metrics=(*CALIBRATION_METRICS, *each("scale", SUMMARY), "simulation_seconds", "simulated_requests_per_second"),
    tables={**CALIBRATION_TABLES, "knobs": (*LOAD_COLUMNS, "knob", "setting")},
    version=3, upgrades={1: cost_summary_written, 2: latency_shares_written},
)

EXPERIMENT = define(__name__, SimulateConfig,
                    "the engine's scheduler on a cost model fitted to the real engine: latency at any scale, with its fidelity",
                    run_fn=run, schema=RESULT)
