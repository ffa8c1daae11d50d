"""Calibrating the simulator against the engine, and measuring how well it predicts.

1. Profile: the real engine serves a trace; every step's (prefill tokens, decode tokens, KV blocks,
   time) is a sample. 2. Fit the cost model to those steps by least squares. 3. Fidelity: the engine
   serves a held-out trace (another seed), the simulator predicts the same trace, and the latency
   figures are compared. The same scheduler code runs on both sides.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from backend.serving.engine import serve
from backend.serving.scheduler import Scheduler, SchedulerConfig
from backend.serving.simulator import CostModel, ReplayExecutor, fidelity, latency_summary, simulate
from backend.serving.workload import Trace


@dataclass
class Calibration:
    cost: CostModel
    real: Scheduler          # the engine on the held-out trace
    simulated: Scheduler     # the simulator on the same trace
    fidelity: dict           # relative error per figure (simulated vs real)
    real_summary: dict
    simulated_summary: dict


def calibrate(model, config: SchedulerConfig, profile_trace: Trace, held_out: Trace, progress=None) -> Calibration:
    say = progress or (lambda f, m: None)
    say(0.0, f"profiling the engine on {len(profile_trace)} requests")
    cost = CostModel.fit(serve(model, profile_trace, config).log.table())
    say(0.5, f"the engine on {len(held_out)} held-out requests")
    real = serve(model, held_out, config, record_batches=True)
    simulated = simulate(held_out, config, cost)
    real_summary, sim_summary = latency_summary(real), latency_summary(simulated)
    return Calibration(cost, real, simulated, fidelity(real_summary, sim_summary), real_summary, sim_summary)


def replay_mismatches(real: Scheduler) -> int:
    """Steps whose batch differs when the simulator is given the engine's measured step times
    (plus the difference in step count): 0 means the same scheduler made the same decisions."""
    replay = Scheduler(real.trace, real.config, record_batches=True).run(ReplayExecutor(list(real.log.table()["time"])))
    differ = sum(not (np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])) for a, b in zip(real.batches, replay.batches))
    return differ + abs(len(real.batches) - len(replay.batches))
