"""Where each rank's time goes in one step of the mesh run, on the wall clock and replayed with one core per rank,
both from one decomposition of the step into items (each event's dimension is its tracer's, mesh_train).

A rank's step is an ordered list of items: compute pieces (an action between its communication calls, or traced
compute outside the actions) and communication calls of one dimension each: a collective, a pipeline send (an
instant) or receive, a ring attention message's post (an instant) and wait (only the blocked tail after the overlapped
compute is exposed; DDP's overlapped buckets run on a thread of their own, so their posts do not cut the action they
start in, and only their wait after the backward is exposed). Per rank: compute, each dimension's exposed
communication, and idle, measured as the step less the union of the items, apart from the parts, so parts summing to
the step checks that no instant is counted twice or lost.
"""
from __future__ import annotations

from collections import defaultdict

from backend.parallel.pp.schedules import is_action

DIMENSIONS = ("tp", "cp", "ep", "dp", "pp")
CATEGORIES = ("compute", *DIMENSIONS, "idle")


def union(intervals) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for a, b in sorted(i for i in intervals if i[1] > i[0]):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def parts(intervals: list[tuple[dict, tuple[float, float]]], step: float) -> dict[str, float]:
    """µs per category of a rank's (item, interval) pairs within a step of `step` µs (see the module's note)."""
    out = {c: 0.0 for c in CATEGORIES}
    for it, (a, b) in intervals:
        out["compute" if it["op"] == "compute" else it["dim"]] += max(b - a, 0.0)
    out["idle"] = step - sum(b - a for a, b in union(iv for _, iv in intervals))
    return out


def drawn(rank: int, intervals: list[tuple[dict, tuple[float, float]]], origin: float) -> list[dict]:
    """Rows for a timeline, one lane per category: compute pieces by action (kind, micro-batch, stage), each
    dimension's calls on its own lane; in ms from `origin`."""
    return [{"rank": rank, "lane": "compute" if it["op"] == "compute" else it["dim"],
             "kind": it.get("kind", "other" if it["op"] == "compute" else it["dim"]),
             "name": f"{it['kind']}{it['mb']} stage {it['stage']}" if "kind" in it else it.get("name", it["op"]),
             "start_ms": (a - origin) / 1e3, "end_ms": (b - origin) / 1e3} for it, (a, b) in intervals if b > a]


# --- the items, and the step replayed from them with one core per rank ------------------------------------------------
# backend.trace.replay walks the items: one starts when the rank's previous item has ended and what it depends on has
# ended. A collective (tp, cp, ep, dp) depends on every member's arrival, so it starts with the slowest and takes the
# same time on each; a receive or ring wait depends on its matched send or post. A collective's cost is from its last
# member's arrival to its first member's finish (before, a member had not arrived; after, a member may finish late
# because the OS ran another rank); a message's from the later of its post and its wait to its arrival. Compute inside
# an F/B/I/W action is the action's CPU time less its collectives', spread over the pieces between them by wall time;
# outside the actions, the traced compute spans' CPU time (Adam's update; untraced glue counts nothing).


def _inside(e: dict, outer: dict) -> bool:
    return outer["ts"] <= e["ts"] and e["ts"] + e["dur"] <= outer["ts"] + outer["dur"]


def _calls(events: list[dict]) -> list[tuple[float, float, dict]]:
    """A rank's communication calls in the step: (blocking start, end, item), in time order."""
    colls = [e for e in events if e["lane"] == "collective" and e["args"].get("dim")]
    calls = []
    for e in colls:
        if not any(o is not e and _inside(e, o) for o in colls):  # (a collective made of another counts once)
            calls.append((e["ts"], e["ts"] + e["dur"], {"op": "collective", "dim": e["args"]["dim"], "name": e["name"],
                                                        "wall_us": e["dur"], "call_cpu_us": e.get("cpu_us", 0.0)}))
    for e in events:
        end = e["ts"] + e["dur"]
        if e["lane"] == "comm" and "blocked_us" in e["args"] and e["args"].get("dim"):
            calls.append((e["ts"], e["ts"], {"op": "post", "dim": e["args"]["dim"], "name": e["name"],
                                             **({"overlapped": True} if e["args"].get("overlapped") else {})}))
            calls.append((end - e["args"]["blocked_us"], end, {"op": "wait", "dim": e["args"]["dim"], "name": e["name"],
                                                                 "posted_us": e["ts"]}))
        elif e["lane"] == "send" and "tag" in e["args"]:
            calls.append((e["ts"], e["ts"], {"op": "send", "dim": "pp", "name": e["name"], "peer": e["args"]["peer"],
                                             "tag": e["args"]["tag"]}))
        elif e["lane"] == "recv" and "tag" in e["args"]:
            calls.append((e["ts"], end, {"op": "recv", "dim": "pp", "name": e["name"], "peer": e["args"]["peer"],
                                         "tag": e["args"]["tag"]}))
    return sorted(calls, key=lambda c: (c[0], c[1]))


def step_items(events: list[dict], window: tuple[float, float]) -> list[dict]:
    """One rank's step (`window` on its clock) as replay items in order: compute pieces and communication calls. A piece
    inside an action carries (kind, stage, mb, piece): an action with k calls inside it is k + 1 pieces."""
    events = [e for e in events if window[0] <= e["ts"] and e["ts"] + e["dur"] <= window[1]]
    actions = sorted(filter(is_action, events), key=lambda e: e["ts"])
    calls, items, at = _calls(events), [], window[0]
    loose = [e for e in events if e["lane"] == "compute" and not is_action(e)
             and not any(_inside(e, a) for a in actions)]  # traced compute outside the actions (Adam's update)

    def gap(a: float, b: float):
        traced = [e for e in loose if a <= e["ts"] < b]
        if traced:
            items.append({"op": "compute", "cost_us": sum(e.get("cpu_us", 0.0) for e in traced),
                          "wall": (min(e["ts"] for e in traced), max(e["ts"] + e["dur"] for e in traced))})
    for act in actions:
        mine = [c for c in calls if act["ts"] <= c[0] and c[1] <= act["ts"] + act["dur"] and not c[2].get("overlapped")]
        before = [c for c in calls if c[0] < act["ts"] and c not in mine]
        for c in before:
            gap(at, c[0])
            items.append({**c[2], "wall": (c[0], c[1])})
            at = max(at, c[1])
        calls = [c for c in calls if c not in mine and c not in before]
        gap(at, act["ts"])
        blocked = sum(c[1] - c[0] for c in mine)
        cpu = act["cpu_us"] - sum(c[2].get("call_cpu_us", 0.0) for c in mine)
        rate = max(cpu, 0.0) / max(act["dur"] - blocked, 1e-9)  # CPU per wall µs of the action's own compute
        edges = [act["ts"], *[x for c in mine for x in c[:2]], act["ts"] + act["dur"]]
        for j in range(len(mine) + 1):
            a, b = edges[2 * j], edges[2 * j + 1]
            items.append({"op": "compute", "cost_us": rate * max(b - a, 0.0), "wall": (a, b),
                          "kind": act["args"]["kind"], "stage": act["args"]["stage"], "mb": act["args"]["mb"],
                          "piece": j})
            if j < len(mine):
                items.append({**mine[j][2], "wall": mine[j][:2]})
        at = act["ts"] + act["dur"]
    for c in calls:
        gap(at, c[0])
        items.append({**c[2], "wall": (c[0], c[1])})
        at = max(at, c[1])
    gap(at, window[1])
    return items


def match_calls(steps: dict[int, list[dict]], coords: dict[int, dict]) -> dict[tuple[int, int], list[tuple[int, int]]]:
    """Each call's partners, by (rank, item index): a collective's group members (the nth call of its dimension on
    every rank sharing all other coordinates), a receive's send (by peer and tag), a ring wait's post on the previous
    rank of the ring (the nth of each)."""
    nth, where = {}, {}
    for r, items in steps.items():
        count: dict[tuple, int] = defaultdict(int)
        for i, it in enumerate(items):
            if it["op"] in ("collective", "post", "wait"):
                group = tuple(v for d, v in sorted(coords[r].items()) if d != it["dim"])
                key = (it["op"], it["dim"], group, count[(it["op"], it["dim"])])
                count[(it["op"], it["dim"])] += 1
                where.setdefault(key, {})[coords[r][it["dim"]]] = (r, i)
                nth[(r, i)] = key
            elif it["op"] == "send":
                where[("send", r, it["peer"], it["tag"])] = (r, i)
    out = {}
    for r, items in steps.items():
        for i, it in enumerate(items):
            if it["op"] == "collective":
                out[(r, i)] = [k for k in where[nth[(r, i)]].values() if k != (r, i)]
            elif it["op"] == "recv":
                out[(r, i)] = [where[("send", it["peer"], r, it["tag"])]]
            elif it["op"] == "wait":
                op, dim, group, n = nth[(r, i)]
                ring = where[("post", dim, group, n)]
                out[(r, i)] = [ring[(coords[r][dim] - 1) % len(ring)]]
    return out


def measured_costs(steps: dict[int, list[dict]], partners: dict) -> None:
    """Each call's cost from the wall clock, in place (see the section's note): a collective's from its last arrival
    to its first finish; a message's from the later of its post and its wait to its arrival; posts are instants."""
    for (r, i), keys in partners.items():
        it = steps[r][i]
        if it["op"] == "collective":
            walls = [steps[k[0]][k[1]]["wall"] for k in [(r, i), *keys]]
            it["cost_us"] = max(0.0, min(b for _, b in walls) - max(a for a, _ in walls))
        else:
            sent = steps[keys[0][0]][keys[0][1]]["wall"][0]
            it["cost_us"] = max(0.0, it["wall"][1] - max(sent, it["wall"][0]))
    for items in steps.values():
        for it in items:
            it.setdefault("cost_us", 0.0)


def replay_step(steps: dict[int, list[dict]], partners: dict,
                cost=lambda it: it.get("cost_us", 0.0)) -> dict[int, list[dict]]:
    """The items replayed with one core per rank at `cost(item)` µs each: a collective waits for every member's
    arrival (the end of its item before the collective), a receive or ring wait for its matched post."""
    from backend.trace import replay

    flat = [{**it, "rank": r, "index": i, "cpu_us": cost(it), "name": it.get("name", it["op"])}
            for r, items in steps.items() for i, it in enumerate(items)]

    def depends_on(a):
        keys = partners.get((a["rank"], a["index"]), [])
        if a["op"] == "collective":
            return [(k[0], k[1] - 1) for k in keys if k[1] > 0]
        return keys
    out: dict[int, list[dict]] = defaultdict(list)
    for a in replay(flat, depends_on):
        out[a["rank"]].append(a)
    return dict(out)


def replay_split(replayed: dict[int, list[dict]]) -> tuple[float, dict[int, dict[str, float]]]:
    """The replayed step (the last item's end over all ranks) and per rank µs of compute, of each dimension's exposed
    communication, and idle (waiting for a group's slowest member or a message's sender is idle)."""
    step = max(a["ts"] + a["dur"] for items in replayed.values() for a in items)
    return step, {r: parts([(a, (a["ts"], a["ts"] + a["dur"])) for a in items], step) for r, items in replayed.items()}


def mean_action_costs(steps: dict[int, list[dict]]) -> dict[tuple[str, int, int], float]:
    """The mean CPU time of each piece of each kind of action on each stage, over micro-batches and ranks:
    {(kind, stage, piece): µs}. Fed to every rank with communication free, the pipelines become identical, so no
    collective waits and the replay must walk as the makespan model does."""
    runs: dict[tuple, list[float]] = defaultdict(list)
    for items in steps.values():
        for it in items:
            if "kind" in it:
                runs[(it["kind"], it["stage"], it["piece"])].append(it["cost_us"])
    return {k: sum(v) / len(v) for k, v in runs.items()}
