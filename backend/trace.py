"""Per-rank event recorder and Chrome trace export.

Each rank records spans on named lanes (compute, send, recv, ...) with the monotonic clock, its
zero taken right after a barrier: ranks on one machine share one origin exactly (the same clock), ranks
on different machines to within the barrier's exit skew. Export is Chrome trace JSON: "X" complete events with pid = rank and tid = lane, plus "M"
metadata events naming and ordering processes and threads, which Perfetto and chrome://tracing open.
"""
from __future__ import annotations

import contextlib
import os
import socket
import time
from collections import defaultdict
from typing import Any, Iterable

DEFAULT_LANES = ("compute", "collective", "send", "recv")
# What an event is, for colour and legend: a few kinds, whatever the experiment named the event.
KINDS = ("forward", "backward", "weight grad", "optimizer", "compute", "send", "recv", "collective", "kernel", "library call")
_KIND_OF_ARG = {"F": "forward", "B": "backward", "I": "backward", "W": "weight grad", "forward": "forward",
                "backward": "backward", "optimizer": "optimizer", "collective": "collective"}
_KIND_OF_LANE = {"send": "send", "recv": "recv", "collective": "collective", "comm": "collective",
                 "generated kernel": "kernel", "library call": "library call"}
_KIND_OF_NAME = (("forward", "forward"), ("backward", "backward"), ("adam", "optimizer"), ("update", "optimizer"),
                 ("all-reduce", "collective"), ("all-gather", "collective"), ("reduce-scatter", "collective"),
                 ("broadcast", "collective"), ("gather", "collective"))


def kind_of(event: dict[str, Any]) -> str:
    """The event's kind (one of KINDS): its declared kind, else its lane's, else what its name says, else compute."""
    declared = _KIND_OF_ARG.get(str(event.get("args", {}).get("kind")))
    if declared:
        return declared
    if event.get("lane") in _KIND_OF_LANE:
        return _KIND_OF_LANE[event["lane"]]
    name = event.get("name", "").lower()
    return next((kind for prefix, kind in _KIND_OF_NAME if name.startswith(prefix)), "compute")


def _machine() -> str:
    """Which kernel's monotonic clock this process reads: the boot's id on Linux, else host and process (unshared)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return f"{socket.gethostname()}:{os.getpid()}"


class Tracer:
    def __init__(self, rank: int = 0):
        self.rank = rank
        self.t0_ns = time.perf_counter_ns()
        self.events: list[dict[str, Any]] = []
        self.bytes_sent: dict[str, int] = defaultdict(int)
        self.bytes_recv: dict[str, int] = defaultdict(int)

    def align(self, barrier) -> None:
        """Set the time origin right after `barrier()` returns on every rank (twice, to settle stragglers). Ranks on
        one machine then take the earliest of their readings: they all read the machine's monotonic clock, so their
        times compare exactly however the OS schedules them (a rank descheduled on leaving the barrier would
        otherwise start its clock late). Across machines each keeps its own, to within the barrier's exit skew."""
        barrier()
        barrier()
        self.t0_ns = time.perf_counter_ns()
        import torch.distributed as dist

        if dist.is_initialized() and dist.get_world_size() > 1:
            here, readings = _machine(), [None] * dist.get_world_size()
            dist.all_gather_object(readings, (here, self.t0_ns))
            self.t0_ns = min(t0 for machine, t0 in readings if machine == here)

    def now_us(self) -> float:
        return (time.perf_counter_ns() - self.t0_ns) / 1e3

    @contextlib.contextmanager
    def span(self, lane: str, name: str, **args):
        """Time a block: wall time, and this thread's CPU time (what the block cost, whoever else shared the core)."""
        start, cpu_start = self.now_us(), time.thread_time_ns()
        try:
            yield
        finally:
            end = self.now_us()
            self.events.append({"name": name, "lane": lane, "rank": self.rank, "ts": start, "dur": end - start,
                                "cpu_us": (time.thread_time_ns() - cpu_start) / 1e3, "args": args})

    def count(self, kind: str, sent: int = 0, recv: int = 0) -> None:
        """Communication byte counters, keyed by what moved (an op name, a peer, a tensor)."""
        self.bytes_sent[kind] += sent
        self.bytes_recv[kind] += recv

    def payload(self) -> dict[str, Any]:
        return {"rank": self.rank, "events": self.events, "bytes_sent": dict(self.bytes_sent), "bytes_recv": dict(self.bytes_recv)}


def replay(actions: list[dict], depends_on, latency: float = 0.0) -> list[dict]:
    """The timeline the actions imply with one dedicated core per rank: each action takes its measured CPU time
    (`cpu_us`), starts when the previous action of its rank has ended and every action it depends on has ended.
    `actions` are in each rank's executed order; `depends_on(action)` returns the keys ((rank, index) pairs of
    other actions, e.g. the matched sender of a receive) it waits for; a dependency on another rank's action adds
    `latency` (0: communication is free, so the replay shows the schedule, not the wire). Returns copies with ts and
    dur replayed. A key no action has (or a cycle) deadlocks: ValueError naming where each rank is stuck."""
    by_rank: dict[int, list[dict]] = defaultdict(list)
    for a in actions:
        by_rank[a["rank"]].append(a)
    end: dict[tuple[int, int], float] = {}
    out, cursor = [], {r: 0 for r in by_rank}
    progress = True
    while progress:
        progress = False
        for r, todo in by_rank.items():
            while cursor[r] < len(todo):
                a = todo[cursor[r]]
                deps = depends_on(a)
                if any(d not in end for d in deps):
                    break  # waits on another rank: come back to this rank after the others advance
                start = max([end.get((r, cursor[r] - 1), 0.0)] + [end[d] + (latency if d[0] != r else 0.0) for d in deps])
                end[(r, cursor[r])] = start + a["cpu_us"]
                out.append({**a, "ts": start, "dur": a["cpu_us"]})
                cursor[r] += 1
                progress = True
    stuck = {r: todo[cursor[r]]["name"] for r, todo in by_rank.items() if cursor[r] < len(todo)}
    if stuck:
        raise ValueError(f"replay deadlocked: the orders and dependencies are inconsistent (stuck at {stuck})")
    return out


def to_chrome_trace(events: Iterable[dict[str, Any]], lanes: Iterable[str] = DEFAULT_LANES) -> dict[str, Any]:
    """Convert recorder events (rank, lane, name, ts, dur in µs) to a Chrome trace object."""
    events = list(events)
    lane_order = list(dict.fromkeys(list(lanes) + [e["lane"] for e in events]))
    tid = {lane: i for i, lane in enumerate(lane_order)}
    out: list[dict[str, Any]] = []
    ranks = sorted({e["rank"] for e in events})
    for r in ranks:
        out.append({"ph": "M", "name": "process_name", "pid": r, "tid": 0, "args": {"name": f"rank {r}"}})
        out.append({"ph": "M", "name": "process_sort_index", "pid": r, "tid": 0, "args": {"sort_index": r}})
        for lane in sorted({e["lane"] for e in events if e["rank"] == r}, key=tid.get):
            out.append({"ph": "M", "name": "thread_name", "pid": r, "tid": tid[lane], "args": {"name": lane}})
            out.append({"ph": "M", "name": "thread_sort_index", "pid": r, "tid": tid[lane], "args": {"sort_index": tid[lane]}})
    for e in sorted(events, key=lambda e: (e["rank"], tid[e["lane"]], e["ts"], -e["dur"])):
        out.append({
            "ph": "X", "name": e["name"], "cat": e["lane"], "pid": e["rank"], "tid": tid[e["lane"]],
            "ts": round(e["ts"], 3), "dur": round(e["dur"], 3),
            "args": {**e.get("args", {}), "kind": kind_of(e), **({"cpu_us": round(e["cpu_us"], 1)} if "cpu_us" in e else {})},
        })
    return {"traceEvents": out, "displayTimeUnit": "ms"}
