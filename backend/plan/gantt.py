"""The Gantt of one predicted step: every pipeline rank's actions in the Schedule's own order (backend/parallel/pp/
schedules.py), each at its predicted cost, replayed by backend/trace.replay: F(s, mb) waits for F(s − 1, mb), a
backward of (s, mb) for the backward of (s + 1, mb); a zero-bubble W follows its I on the same rank."""
from __future__ import annotations

from backend.parallel.pp import schedules
from backend.trace import replay as replay_actions

MAX_ACTIONS = 20_000


def formula_exact(plan) -> bool:
    """Whether the step's pipeline time is the schedule's makespan function (exact for its order) or its bubble formula."""
    return schedules.SCHEDULES[plan.schedule].makespan_fn is not None


def replay(plan, result: dict) -> list[dict]:
    """Bars (rank, kind, stage, mb, ts and dur in µs) of one step; [] when pp = 1 or the step has too many actions."""
    p, v, m = plan.pp, plan.vp, result["time"]["m"]
    sched = schedules.SCHEDULES[plan.schedule]
    if p == 1 or 2 * p * v * m > MAX_ACTIONS:
        return []
    t = result["time"]
    last = p * sched.chunks(v) - 1
    cost = {"F": t["F"], "B": t["B"], "I": t["B"] / 2, "W": t["B"] / 2}
    orders = sched.actions(p, m, v)
    actions, where = [], {}
    for r, order in orders.items():
        for i, a in enumerate(order):
            extra = t["head_f"] * (1 if a.kind == "F" else 2 if a.kind == "B" else 1) if a.stage == last else 0.0
            actions.append({"rank": r, "name": str(a), "kind": a.kind, "stage": a.stage, "mb": a.mb, "cpu_us": (cost[a.kind] + extra) * 1e6})
            where[(a.kind if a.kind != "I" else "B", a.stage, a.mb)] = (r, i)

    def depends_on(e):
        if e["kind"] == "F":
            return [where[("F", e["stage"] - 1, e["mb"])]] if e["stage"] > 0 else []
        if e["kind"] in ("B", "I"):
            return [where[("B", e["stage"] + 1, e["mb"])]] if e["stage"] < last else []
        return []
    return [{k: e[k] for k in ("rank", "kind", "stage", "mb", "ts", "dur")} for e in replay_actions(actions, depends_on)]
