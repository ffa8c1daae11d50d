"""An allocator simulation: the serving scheduler (scheduler.py) over a trace with no model, each step one unit
of time (arrivals in scheduler steps), reading every few steps how the KV allocator's memory is used.
kvcache.serve runs it twice on one trace in the same memory: the paged block manager, and contiguous
max-length reservations (kvcache/contiguous.py) behind the same interface.

Only memory limits the batch: the token budget and the batch size are as large as the pool, so each step
prefills every admitted prompt whole and decodes one token for every running request. When a paged request
needs a block and none is free, the most recently admitted one is preempted (swap or recompute), as in the
engine. A request's KV holds at most prompt + output - 1 tokens: its last token is sampled, never attended to.
"""
from __future__ import annotations

import numpy as np

from backend.kvcache.contiguous import ContiguousAllocator
from backend.kvcache.manager import KVCacheManager
from backend.serving.scheduler import Scheduler, SchedulerConfig, SequenceTokens, Step
from backend.serving.workload import Trace


class Sampler:
    """The simulation's executor: a step takes one unit of time and computes nothing. Every `every` steps it books
    the step's tokens in the allocator (the scheduler tells it of a token only when one takes or fills a block)
    and records `measure`'s sample of the memory held during the step."""

    def __init__(self, every: int = 5):
        self.every, self.samples = every, []

    def execute(self, step: Step, sched: Scheduler):
        if step.start % self.every == 0:
            self.book(step, sched)
            self.samples.append({"step": int(step.start), "running": len(step.rids), "waiting": len(sched.waiting),
                                 **self.measure(step, sched)})
        return 1.0, None

    @staticmethod
    def book(step: Step, sched: Scheduler) -> None:
        """Bring the allocator's count of each request's tokens up to the end of this step (the scheduler's is lazy)."""
        m, hashed = sched.m, sched.config.prefix_caching
        for rid, end in zip(step.rids.tolist(), (step.starts + step.takes).tolist()):
            m.grow(rid, end, SequenceTokens(sched, rid) if hashed else None)

    def measure(self, step: Step, sched: Scheduler) -> dict:
        m = sched.m
        return {"allocated_slots": m.used_blocks() * m.block_size, "filled_slots": m.filled_slots()}


class PagedSampler(Sampler):
    """Also, every `snapshot_every` samples, checks the manager's invariants and keeps a picture of the pool (at most
    `max_snapshots`, thinned to every other one, spread over the whole run)."""

    def __init__(self, every: int = 5, snapshot_every: int = 4, max_snapshots: int = 60):
        super().__init__(every)
        self.snapshot_every, self.max_snapshots = snapshot_every, max_snapshots
        self.snapshots, self.invariant_failures, self.events = [], 0, []

    def measure(self, step: Step, sched: Scheduler) -> dict:
        if int(step.start) % (self.every * self.snapshot_every) == 0:
            try:
                sched.m.check_invariants()
            except AssertionError as err:
                self.invariant_failures += 1
                self.events.append({"step": int(step.start), "op": f"invariant broken: {err}"})
            self.snapshots.append(pool_snapshot(sched.m, int(step.start), sched.running[:12].tolist()))
            if len(self.snapshots) > self.max_snapshots:
                self.snapshots, self.snapshot_every = self.snapshots[::2], self.snapshot_every * 2
        return {"swapped": len(sched.swapped), **super().measure(step, sched)}


class ContiguousSampler(Sampler):
    """Splits the reservations' unfilled slots (seed 000's waste): held for tokens not generated yet, reserved beyond
    what the request ever holds, and the buffer's tail that fits no reservation (while requests wait for one)."""

    def measure(self, step: Step, sched: Scheduler) -> dict:
        m, most = sched.m, sched.trace.total[step.rids] - 1
        return {**super().measure(step, sched), "not_yet": int((most - step.starts - step.takes).sum()),
                "reserved_never": int((m.reserve - most).sum()), "fragmentation": m.fragment if sched.waiting else 0}


def serve_in(trace: Trace, allocator: KVCacheManager, sampler: Sampler, policy: str = "recompute") -> Scheduler:
    """The trace served with its KV booked in `allocator`, memory the only limit."""
    slots = allocator.pool.num_blocks * allocator.block_size
    config = SchedulerConfig(allocator.block_size, allocator.pool.num_blocks, max_batch=slots, token_budget=slots,
                             chunked_prefill=True, prefix_caching=allocator.prefix_caching, preemption=policy)
    return Scheduler(trace, config, allocator=allocator).run(sampler)


def _shared(sched: Scheduler, samples: list[dict]) -> dict:
    """What both allocators report: steps to drain the trace, the most requests running after a step, the samples."""
    return {"steps": int(np.nanmax(sched.finish)), "max_running": int(sched.log.table()["running"].max()), "samples": samples}


def simulate_paged(trace: Trace, block_size: int, num_blocks: int, policy: str = "swap", prefix_caching: bool = True,
                   sample_every: int = 5) -> dict:
    m, sampler = KVCacheManager(num_blocks, block_size, prefix_caching), PagedSampler(sample_every)
    sched = serve_in(trace, m, sampler, policy)
    allocated = sum(s["allocated_slots"] for s in sampler.samples)
    filled = sum(s["filled_slots"] for s in sampler.samples)
    preempted = [{"step": int(out), "op": f"preempt ({policy})", "seq": rid} for rid, out, _ in sched.preempted_spans]
    events = sorted(sampler.events + preempted, key=lambda e: e["step"]) + [dict(e, step=None) for e in m.events]
    return {
        **_shared(sched, sampler.samples), "snapshots": sampler.snapshots, "events": events[:2000],
        "utilization": filled / allocated if allocated else 1.0,
        "waste": {"internal (last block)": 1 - filled / allocated if allocated else 0.0, "reservation": 0.0, "fragmentation": 0.0},
        "preemptions": int(sched.preemptions.sum()), "swaps": m.stats.swaps_out, "invariant_failures": sampler.invariant_failures,
        "cow_copies": m.stats.cow_copies, "evictions": m.pool.evictions,
        "prefix_hit_rate": m.stats.prefix_hit_tokens / max(1, m.stats.prefix_queried_tokens),
        "prefix_hit_tokens": m.stats.prefix_hit_tokens,
    }


def simulate_contiguous(trace: Trace, capacity: int, reserve: int, sample_every: int = 5) -> dict:
    sampler = ContiguousSampler(sample_every)
    sched = serve_in(trace, ContiguousAllocator(capacity, reserve), sampler)
    total = {k: sum(s[k] for s in sampler.samples) for k in ("filled_slots", "allocated_slots", "not_yet", "reserved_never", "fragmentation")}
    held = max(1, total["allocated_slots"] + total["fragmentation"])
    return {
        **_shared(sched, sampler.samples),
        "utilization": total["filled_slots"] / total["allocated_slots"] if total["allocated_slots"] else 1.0,
        "waste": {"reservation": total["reserved_never"] / held, "not yet generated": total["not_yet"] / held,
                  "fragmentation": total["fragmentation"] / held},
    }


def pool_snapshot(m: KVCacheManager, step: int, rids: list[int]) -> dict:
    """The pool as data: each block's ref count, fill, state and first owner; the block tables of `rids`."""
    owner = {}
    for seq in m.seqs.values():
        for b in seq.table:
            owner.setdefault(b.id, seq.seq_id)
    pool = [{"block": b.id, "ref": b.ref_count, "fill": b.num_tokens,
             "state": "used" if b.ref_count else ("cached, free" if b.hash is not None else "free"),
             "owner": owner.get(b.id, -1)} for b in m.pool.blocks]
    tables = [{"seq": rid, "logical": i, "physical": b} for rid in rids for i, b in enumerate(m.block_ids(rid))]
    return {"step": step, "pool": pool, "tables": tables}
