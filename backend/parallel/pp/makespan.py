"""The makespan model: a pipeline step's time and each rank's idle from the schedule's order and per-action costs.

Every rank runs its actions in order on one core; an action starts when the previous one has ended and its inputs are
there: F(s, mb) needs F(s-1, mb); B or I of (s, mb) needs F(s, mb) and the backward of (s+1, mb); W(s, mb) needs
I(s, mb). A dependency across ranks is one message, + `latency`. Idle (bubble) = 1 - busy / step time. This max-plus
walk is how the zero-bubble paper and DeepSeek-V3 reason; with equal stages it gives the schedules' closed forms. It
takes costs, not a trace, so a planner can call it at any scale (parallel.pipeline checks it against the replay).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from backend.parallel.pp.schedules import ACTIONS, SCHEDULES, Action
from backend.trace import replay


@dataclass(frozen=True)
class Makespan:
    step: float                              # the step's time, in the costs' unit
    busy: dict[int, float]                   # per rank: the sum of its actions' costs
    idle: dict[int, float]                   # per rank: 1 - busy / step (the bubble fraction)
    timeline: list[tuple[int, Action, float, float]]  # (rank, action, start, end) in the order walked


def stage_costs(costs: Mapping[str, Sequence[float]], stages: int) -> dict[str, list[float]]:
    """Each kind's cost per stage: F is required; a full backward B may be given, or I and W (I = B - W; a stage's B
    not given, or 0 where a schedule splits that stage's backwards as DualPipe-V does, is I + W)."""
    if "F" not in costs or len(costs["F"]) != stages:
        raise ValueError(f"costs['F'] must give one forward cost per stage ({stages} stages)")
    out = {k: list(c) for k, c in costs.items() if k in ACTIONS}
    for kind, c in out.items():
        if len(c) != stages:
            raise ValueError(f"costs[{kind!r}] has {len(c)} entries for {stages} stages")
    if "I" in out and "W" in out:
        out["B"] = [b or i + w for b, i, w in zip(out.get("B", [0.0] * stages), out["I"], out["W"])]
    if "I" not in out and "B" in out and "W" in out:
        out["I"] = [b - w for b, w in zip(out["B"], out["W"])]
    return out


def _needs(a: Action, last_stage: int) -> list[tuple[str, int, int]]:
    """What an action waits for besides its rank's previous action: (phase, stage, mb), phase F or back (B or I)."""
    if a.kind == "F":
        return [("F", a.stage - 1, a.mb)] if a.stage > 0 else []
    if a.kind in ("B", "I"):
        return [("F", a.stage, a.mb)] + ([("back", a.stage + 1, a.mb)] if a.stage < last_stage else [])
    return [("back", a.stage, a.mb)]  # W after its I


def _phase(a: Action) -> tuple[str, int, int]:
    return ("F" if a.kind == "F" else "W" if a.kind == "W" else "back", a.stage, a.mb)


def makespan(schedule: str, p: int, m: int, v: int, costs: Mapping[str, Sequence[float]], latency: float = 0.0) -> Makespan:
    """Walk `schedule`'s orders (p ranks, m micro-batches, v chunks per rank when interleaved) with `costs[kind][stage]`
    per micro-batch (F, and B or I and W, over all stages): the trace's replay (backend/trace.replay), given costs
    instead of measured CPU times."""
    plan = SCHEDULES[schedule]
    stages = p * plan.chunks(v)
    cost = stage_costs(costs, stages)
    orders = plan.actions(p, m, v)
    where: dict[tuple[str, int, int], tuple[int, int]] = {}  # (phase, stage, mb) -> (rank, index in its order)
    actions = []
    for r, order in orders.items():
        for i, a in enumerate(order):
            if a.kind not in cost:
                raise ValueError(f"{schedule} runs {a.kind} actions: give costs[{a.kind!r}]")
            where[_phase(a)] = (r, i)
            actions.append({"rank": r, "name": str(a), "action": a, "cpu_us": cost[a.kind][a.stage]})
    try:
        walked = replay(actions, lambda e: [where.get(n, ("none", n)) for n in _needs(e["action"], stages - 1)], latency)
    except ValueError as err:
        raise ValueError(f"{schedule}: the orders deadlock on their dependencies ({err})") from None
    timeline = [(e["rank"], e["action"], e["ts"], e["ts"] + e["dur"]) for e in walked]
    step = max((end for *_, end in timeline), default=0.0)
    busy = {r: sum(e - s for rr, _, s, e in timeline if rr == r) for r in orders}
    return Makespan(step, busy, {r: 1 - busy[r] / step if step else 0.0 for r in orders}, timeline)
