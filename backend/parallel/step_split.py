"""Where each rank's time goes in one step of the composed mesh run, from the wall clock.

Every rank records the pipeline's actions (F, B, I, W) and its pp receives on one tracer, and each other mesh dimension
(tp, cp, ep, dp) on a tracer of its own, so every event says which dimension it belongs to (mesh_train). Each instant of
the step window is given to one category, the first that covers it in this order:
  compute    work inside a dimension's code (ring attention's blocks, a ring reduction's sums, Adam's update), then
  tp, cp, ep, dp, pp   exposed communication: a collective's span (a collective blocks this rank until it is done),
             the blocked tail of a ring message sent while attention computed (ring attention's K/V blocks: only the
             wait after the overlapped compute is exposed), a pipeline receive (waiting for a stage's activation or
             gradient: the time the pipeline's fill, drain or an unbalanced stage leaves this rank)
  compute    the rest of an F, B, I or W action
  idle       nothing runs: before the rank's first action of the step, between actions, after its last
so nested spans (a tp all-reduce inside a forward) count once. Idle is measured as the window less the union of all
events, independently of the categories' own sums, so their total equalling the window checks that no instant is
counted twice or lost.
"""
from __future__ import annotations

DIMENSIONS = ("tp", "cp", "ep", "dp", "pp")
CATEGORIES = ("compute", *DIMENSIONS, "idle")
FBIW = ("F", "B", "I", "W")


def classify(event: dict) -> tuple[int, str, tuple[float, float]] | None:
    """(level, category, interval) of one trace event, or None for an event no category takes (it nests in others).
    Level 0 is taken first: compute inside a dimension's code; 1: exposed communication; 2: the pipeline's actions."""
    args, start, end = event["args"], event["ts"], event["ts"] + event["dur"]
    dim, lane = args.get("dim"), event["lane"]
    if lane == "compute":
        if dim:
            return 0, "compute", (start, end)
        return (2, "compute", (start, end)) if args.get("kind") in FBIW else None
    if lane == "recv":
        return 1, "pp", (start, end)
    if dim and lane in ("collective", "comm"):
        return 1, dim, ((end - args["blocked_us"], end) if "blocked_us" in args else (start, end))
    return None


def union(intervals) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for a, b in sorted(i for i in intervals if i[1] > i[0]):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def measure(intervals) -> float:
    return sum(b - a for a, b in union(intervals))


def clip(interval, window):
    return max(interval[0], window[0]), min(interval[1], window[1])


def split(events: list[dict], window: tuple[float, float]) -> dict[str, float]:
    """Microseconds of `window` per category for one rank's events (see the module's order)."""
    taken = [(lvl, cat, clip(iv, window)) for lvl, cat, iv in filter(None, map(classify, events))]
    out, covered = {c: 0.0 for c in CATEGORIES}, []
    for level, names in ((0, ("compute",)), (1, DIMENSIONS), (2, ("compute",))):
        for name in names:
            mine = [iv for lvl, cat, iv in taken if lvl == level and cat == name]
            if mine:
                out[name] += measure(covered + mine) - measure(covered)  # what it adds beyond the categories before it
                covered = union(covered + mine)
    out["idle"] = (window[1] - window[0]) - measure(iv for _, _, iv in taken)
    return out


def lanes(events: list[dict], window: tuple[float, float]) -> list[dict]:
    """The step's events for drawing, one lane per category: the pipeline's actions on the compute lane (by kind,
    micro-batch and stage), each dimension's collectives and receives on its own lane (not the ring steps inside them)."""
    rows = []
    for e in events:
        c = classify(e)
        if c is None or (c[0] == 0) or (e["lane"] == "comm" and "blocked_us" not in e["args"]):
            continue
        a, b = clip(c[2], window)
        if b > a:
            label = f"{e['args']['kind']}{e['args']['mb']} stage {e['args']['stage']}" if c[0] == 2 else e["name"]
            rows.append({"lane": c[1], "name": label, "kind": e["args"]["kind"] if c[0] == 2 else c[1],
                         "start_ms": (a - window[0]) / 1e3, "end_ms": (b - window[0]) / 1e3})
    return rows
