"""Continuous batching over a request trace, once on the paged manager and once on a contiguous allocator.

Time is counted in scheduler steps: each step admits what fits (swapped-out sequences first, then
waiting ones, FCFS) and decodes one token for every running sequence. When a paged sequence needs a
block and none is free, the most recently admitted sequence is preempted: its KV is swapped to CPU
memory (`swap`) or dropped and recomputed later from its tokens (`recompute`).

The contiguous allocator reserves `reserve` slots per request (the maximum length) in one piece of a
linear buffer of the same size, first fit. Its waste splits three ways (seed 000): slots reserved
beyond what the request ever uses, slots held for tokens not generated yet, and free slots in holes
too small for another reservation (fragmentation). The paged manager wastes only the unfilled tail
of each sequence's last block.
"""
from __future__ import annotations

import csv
import io
import random
from collections import deque
from dataclasses import dataclass

from backend.kvcache.manager import KVCacheManager


@dataclass(frozen=True)
class Request:
    rid: int
    arrival: int
    prompt_len: int
    output_len: int
    prefix_id: int = -1   # requests with the same prefix_id start with the same prefix_len tokens
    prefix_len: int = 0

    @property
    def total(self) -> int:
        return self.prompt_len + self.output_len

    def token(self, i: int) -> int:
        """Token id at position i: shared prefix tokens are equal across requests, the rest unique."""
        if i < self.prefix_len:
            return -(self.prefix_id + 1) * 1_000_000 - i
        return (self.rid + 1) * 1_000_000 + i


def synthetic_trace(n: int, seed: int = 0, rate: float = 1.0, max_len: int = 2048, shared_fraction: float = 0.3,
                    prefix_len: int = 64) -> list[Request]:
    """ShareGPT-like: log-normal prompt (median ~150) and output (median ~150) lengths, Poisson arrivals
    (`rate` per step), and a share of requests opening with one of four system prompts."""
    rng, t, out = random.Random(seed), 0.0, []
    for rid in range(n):
        t += rng.expovariate(rate)
        prompt = min(max(4, int(rng.lognormvariate(5.0, 0.8))), max_len // 2)
        output = min(max(1, int(rng.lognormvariate(5.0, 0.9))), max_len - prompt)
        shared = rng.random() < shared_fraction and prompt > prefix_len
        out.append(Request(rid, int(t), prompt, output, rng.randrange(4) if shared else -1, prefix_len if shared else 0))
    return out


def read_csv_trace(text: str) -> list[Request]:
    """Columns arrival, prompt_len, output_len (integers >= 0; lengths >= 1), optional prefix_id, prefix_len."""
    rows = list(csv.DictReader(io.StringIO(text)))
    if not rows:
        raise ValueError("trace: the CSV has no rows (columns: arrival, prompt_len, output_len[, prefix_id, prefix_len])")
    out = []
    for i, row in enumerate(rows, start=2):
        try:
            vals = {k: int(row[k]) for k in ("arrival", "prompt_len", "output_len")}
            prefix_id, prefix_len = int(row.get("prefix_id") or -1), int(row.get("prefix_len") or 0)
        except (KeyError, ValueError, TypeError):
            raise ValueError(f"trace: line {i} needs integer arrival, prompt_len, output_len") from None
        if vals["arrival"] < 0 or vals["prompt_len"] < 1 or vals["output_len"] < 1 or not 0 <= prefix_len <= vals["prompt_len"]:
            raise ValueError(f"trace: line {i} has a negative time or a length below 1 (allowed: arrival >= 0, lengths >= 1, "
                             f"0 <= prefix_len <= prompt_len)")
        out.append(Request(len(out), vals["arrival"], vals["prompt_len"], vals["output_len"], prefix_id, prefix_len))
    return out


@dataclass
class RequestState:
    """A request inside the scheduler: its sequence so far (prompt, then generated) is `num_tokens` long;
    while it runs, all of them are in the KV cache."""
    request: Request
    num_tokens: int


class TokenIds:
    """The first `length` token ids of a request, computed on demand: what the manager hashes."""

    def __init__(self, request: Request, length: int):
        self.request, self.length = request, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: slice) -> list[int]:
        return [self.request.token(i) for i in range(*index.indices(self.length))]


def simulate_paged(trace: list[Request], block_size: int, num_blocks: int, policy: str = "swap",
                   prefix_caching: bool = True, sample_every: int = 5, max_snapshots: int = 60) -> dict:
    m = KVCacheManager(num_blocks, block_size, prefix_caching)
    watermark = max(1, num_blocks // 100)  # blocks kept free at admission, as vLLM's watermark
    pending = deque(sorted(trace, key=lambda r: r.arrival))
    waiting: deque[RequestState] = deque()
    swapped: deque[RequestState] = deque()
    running: list[RequestState] = []
    step = preemptions = max_running = invariant_failures = 0
    samples, snapshots, events = [], [], []
    snapshot_every = sample_every * 4
    while pending or waiting or running or swapped:
        while pending and pending[0].arrival <= step:
            request = pending.popleft()
            waiting.append(RequestState(request, request.prompt_len))
        while swapped and m.blocks_for(swapped[0].num_tokens) <= m.pool.num_free:
            state = swapped.popleft()
            m.swap_in(state.request.rid)
            running.append(state)
        while waiting and not swapped:
            state = waiting[0]
            length = state.num_tokens  # a recomputed request brings back what it had generated
            if m.blocks_for(length + 1) + watermark > m.pool.num_free:  # leave room to decode, or we thrash
                break
            try:
                m.add(state.request.rid, TokenIds(state.request, length))
            except MemoryError:
                break
            waiting.popleft()
            running.append(state)
        i = 0
        while i < len(running):
            state = running[i]
            try:
                m.grow(state.request.rid, state.num_tokens + 1, TokenIds(state.request, state.num_tokens + 1))
            except MemoryError:
                victim = running.pop()
                preemptions += 1
                events.append({"step": step, "op": f"preempt ({policy})", "seq": victim.request.rid})
                if policy == "swap":
                    m.swap_out(victim.request.rid)
                    swapped.appendleft(victim)
                else:
                    m.free(victim.request.rid)  # its tokens stay known; their KV is computed again on return
                    waiting.appendleft(victim)
                continue  # retry this sequence (or stop, if it was the victim)
            state.num_tokens += 1
            i += 1
        for state in [s for s in running if s.num_tokens >= s.request.total]:
            running.remove(state)
            m.free(state.request.rid)
        max_running = max(max_running, len(running))
        if step % sample_every == 0:
            used = m.used_blocks()
            filled = m.filled_slots()
            samples.append({"step": step, "running": len(running), "waiting": len(waiting), "swapped": len(swapped),
                            "allocated_slots": used * block_size, "filled_slots": filled})
            if step % snapshot_every == 0:
                try:
                    m.check_invariants()
                except AssertionError as err:
                    invariant_failures += 1
                    events.append({"step": step, "op": f"invariant broken: {err}"})
                snapshots.append(_snapshot(m, step, running))
                if len(snapshots) > max_snapshots:  # keep them spread over the whole run
                    snapshots, snapshot_every = snapshots[::2], snapshot_every * 2
        step += 1
        if step > 10_000_000:
            raise RuntimeError("the simulation did not finish")
    allocated = sum(s["allocated_slots"] for s in samples)
    filled = sum(s["filled_slots"] for s in samples)
    return {
        "steps": step, "samples": samples, "snapshots": snapshots,
        "events": (events + [dict(e, step=None) for e in m.events])[:2000],
        "utilization": filled / allocated if allocated else 1.0,
        "waste": {"internal (last block)": 1 - filled / allocated if allocated else 0.0, "reservation": 0.0, "fragmentation": 0.0},
        "max_running": max_running, "preemptions": preemptions, "swaps": m.stats.swaps_out,
        "invariant_failures": invariant_failures,
        "cow_copies": m.stats.cow_copies, "evictions": m.pool.evictions,
        "prefix_hit_rate": m.stats.prefix_hit_tokens / max(1, m.stats.prefix_queried_tokens),
        "prefix_hit_tokens": m.stats.prefix_hit_tokens,
    }


def _snapshot(m: KVCacheManager, step: int, running: list[RequestState]) -> dict:
    owner = {}
    for seq in m.seqs.values():
        for b in seq.table:
            owner.setdefault(b.id, seq.seq_id)
    pool = [{"block": b.id, "ref": b.ref_count, "fill": b.num_tokens,
             "state": "used" if b.ref_count else ("cached, free" if b.hash is not None else "free"),
             "owner": owner.get(b.id, -1)} for b in m.pool.blocks]
    tables = [{"seq": s.request.rid, "logical": i, "physical": b} for s in running[:12]
              for i, b in enumerate(m.block_ids(s.request.rid))]
    return {"step": step, "pool": pool, "tables": tables}


def simulate_contiguous(trace: list[Request], capacity: int, reserve: int, sample_every: int = 5) -> dict:
    pending = deque(sorted(trace, key=lambda r: r.arrival))
    waiting, running, holes = deque(), [], [[0, capacity]]  # running: [request, start, length]; holes sorted by start
    step = max_running = 0
    totals = {"used": 0, "not_yet": 0, "reserved_never": 0, "fragmentation": 0, "allocated": 0}
    samples = []
    while pending or waiting or running:
        while pending and pending[0].arrival <= step:
            waiting.append(pending.popleft())
        while waiting:
            hole = next((h for h in holes if h[1] >= reserve), None)
            if hole is None:
                break
            req = waiting.popleft()
            running.append([req, hole[0], req.prompt_len])
            hole[0] += reserve
            hole[1] -= reserve
            holes = [h for h in holes if h[1] > 0]
        for entry in running:
            entry[2] += 1
        for entry in [e for e in running if e[2] >= e[0].total]:
            running.remove(entry)
            holes = _free_region(holes, entry[1], reserve)
        max_running = max(max_running, len(running))
        if step % sample_every == 0:
            used = sum(e[2] for e in running)
            s = {"step": step, "running": len(running), "waiting": len(waiting), "allocated_slots": reserve * len(running),
                 "filled_slots": used, "not_yet": sum(e[0].total - e[2] for e in running),
                 "reserved_never": sum(reserve - e[0].total for e in running),
                 "fragmentation": sum(h[1] for h in holes if h[1] < reserve) if waiting else 0}
            samples.append(s)
            for k, key in (("used", "filled_slots"), ("not_yet", "not_yet"), ("reserved_never", "reserved_never"),
                           ("fragmentation", "fragmentation"), ("allocated", "allocated_slots")):
                totals[k] += s[key]
        step += 1
    held = totals["allocated"] + totals["fragmentation"]
    return {
        "steps": step, "samples": samples, "max_running": max_running,
        "utilization": totals["used"] / totals["allocated"] if totals["allocated"] else 1.0,
        "waste": {"reservation": totals["reserved_never"] / max(1, held), "not yet generated": totals["not_yet"] / max(1, held),
                  "fragmentation": totals["fragmentation"] / max(1, held)},
    }


def _free_region(holes, start, length):
    holes = sorted(holes + [[start, length]])
    merged = [holes[0]]
    for h in holes[1:]:
        if merged[-1][0] + merged[-1][1] == h[0]:
            merged[-1][1] += h[1]
        else:
            merged.append(h)
    return merged


def mean_sequence_len(trace: list[Request]) -> float:
    return sum(r.total for r in trace) / max(1, len(trace))

