"""The one continuous-batching scheduler: the real engine, the simulator and the allocator simulation (kvcache.serve).

Each step it picks what runs: for every request, how many of its tokens get their KV computed. A
request's tokens so far (`known`: prompt, then what it generated) run ahead of its `computed`
tokens; a step computes some of the difference, and a request whose computed tokens catch up
samples one more token (vLLM v1's shape: prefill, chunked prefill, decode and recompute are one rule).

Policies:
- `chunked_prefill=False` (FCFS, vLLM v0): a step either prefills whole prompts of waiting requests,
  first come first served while they fit the token budget, or decodes one token for every running one.
- `chunked_prefill=True` (Sarathi, vLLM v1): running requests first, in admission order, then waiting
  ones, each taking what is left of the token budget: decodes and prefill chunks share a step.
- prefix caching: a new request starts with the cached full blocks of its prompt already computed.
- preemption, when the pool runs out of blocks: the most recently admitted request is swapped out to
  CPU memory (`swap`) or dropped and recomputed later (`recompute`).
Time is the executor's: the engine's measured step time, or the cost model's prediction.

The requests' state is kept as arrays indexed by request id, and a step is computed with array
operations over the running batch; the block manager is called only when a request needs a block or
fills one. That is what lets the simulator run a million requests (and the engine is no slower).
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from backend.kvcache.manager import KVCacheManager
from backend.serving.workload import Trace


@dataclass(frozen=True)
class SchedulerConfig:
    block_size: int = 16
    num_blocks: int = 128
    max_batch: int = 16           # running requests at most
    token_budget: int = 256       # tokens computed per step at most
    chunked_prefill: bool = True
    prefix_caching: bool = False
    preemption: str = "recompute"  # or "swap"


@dataclass
class Step:
    """One step's batch: request `rids[i]` computes tokens starts[i] .. starts[i] + takes[i] - 1."""
    index: int
    start: float
    rids: np.ndarray
    starts: np.ndarray
    takes: np.ndarray
    samples: np.ndarray                                   # the request samples a token after this step
    block_ops: list = field(default_factory=list)         # ("swap_out" | "swap_in", rid, block ids), in order
    prefill_tokens: int = 0
    decode_tokens: int = 0
    kv_blocks: int = 0                                    # blocks attention reads
    swapped_blocks: int = 0                               # blocks copied out to CPU memory or back in
    prefill_pairs: int = 0                                # (query, key) pairs the prefill chunks' attention scores


def scored_prefill_pairs(chunk_tokens: np.ndarray, chunk_ends: np.ndarray, block_size: int) -> int:
    """(query, key) pairs the engine's prefill attention scores for chunks of `chunk_tokens` tokens ending at
    `chunk_ends` (rows of two or more tokens: a one-token row takes the decode path, whose cost is its KV blocks).
    It is one SDPA over every chunk's queries, padded to the longest, against the chunks' widest context in whole
    blocks, masked or not (TorchPagedAttention). Causal pairs alone (query j against keys 0..j) missed that a new
    prompt's chunk scores about twice its pairs and a chunk after a cached prefix about once: the TTFT of
    shared-prefix traces came out about 10% high."""
    if not len(chunk_tokens):
        return 0
    return len(chunk_tokens) * int(chunk_tokens.max()) * int(-(-int(chunk_ends.max()) // block_size)) * block_size


STEP_NUMBERS = np.arange(1, 65)  # a decode run's first look ahead (decode_run): made once


class StepLog:
    """One row per step. Single steps are kept as tuples and decode runs as their arrays, both joined into one
    array every FLUSH_EVERY entries: a run is logged in one append, and the columns it shares with every other
    run are built once per join (a million requests' runs, one by one, cost more than the runs themselves)."""
    COLUMNS = ("start", "time", "requests", "prefill_tokens", "decode_tokens", "kv_blocks", "running", "waiting", "swapped",
               "swapped_blocks", "prefill_pairs")
    FLUSH_EVERY = 4096

    def __init__(self):
        self.blocks: list[np.ndarray] = []  # joined: (columns, steps), a column's values contiguous
        self.rows: list[tuple] = []         # single steps since the last join
        self.runs: list[tuple] = []         # decode runs since the last join: (rows before it, now, times, clock, decodes, kv, waiting)
        self.count = 0

    def add(self, *row) -> None:
        """One step: values in COLUMNS order."""
        self.rows.append(row)
        self.count += 1
        if len(self.rows) >= self.FLUSH_EVERY:
            self._flush()

    def decode_run(self, now: float, times, clock, decodes, kv, running_after: int, waiting=0) -> None:
        """k decode-only steps from `now`: their times, end times (clock), decode tokens and KV blocks; the requests
        still running after the last (after step i < k - 1 those decoding in step i + 1); waiting: a scalar or per step."""
        self.runs.append((len(self.rows), now, times, clock, decodes, kv, running_after, waiting))
        self.count += len(times)
        if len(self.runs) >= self.FLUSH_EVERY:
            self._flush()

    def _flush(self) -> None:
        rows = np.array(self.rows, dtype=np.float64).reshape(-1, len(self.COLUMNS)).T
        if not self.runs:
            self.blocks.append(rows)
            self.rows = []
            return
        before, nows, times, clocks, decodes, kvs, running_after, waiting = zip(*self.runs)
        lengths = np.fromiter(map(len, times), np.int64, len(times))
        first = np.cumsum(lengths) - lengths                      # each run's first step among the runs' steps
        last = first + lengths - 1
        runs = np.zeros((len(self.COLUMNS), int(lengths.sum())))
        col = {name: runs[i] for i, name in enumerate(self.COLUMNS)}
        col["time"][:] = np.concatenate(times)
        clock = np.concatenate(clocks)
        col["start"][1:] = clock[:-1]                             # a step starts where the one before it ended ...
        col["start"][first] = nows                                # ... or where its run began
        col["requests"][:] = col["decode_tokens"][:] = np.concatenate(decodes)
        col["kv_blocks"][:] = np.concatenate(kvs)
        col["running"][:-1] = col["decode_tokens"][1:]            # those still running decode in the next step ...
        col["running"][last] = running_after                      # ... but after a run's last, those left
        col["waiting"][:] = np.concatenate([np.broadcast_to(w, n) for w, n in zip(waiting, lengths.tolist())]) if any(
            not np.isscalar(w) or w for w in waiting) else 0
        # Interleave: run j's steps follow the single steps logged before it.
        at = np.repeat(np.asarray(before) + first, lengths) + (np.arange(len(clock)) - np.repeat(first, lengths))
        joined = np.empty((len(self.COLUMNS), rows.shape[1] + len(clock)))
        is_run = np.zeros(joined.shape[1], bool)
        is_run[at] = True
        joined[:, at], joined[:, ~is_run] = runs, rows
        self.blocks.append(joined)
        self.rows, self.runs = [], []

    def __len__(self) -> int:
        return self.count

    def table(self) -> dict[str, np.ndarray]:
        self._flush()
        joined = np.concatenate(self.blocks, axis=1)
        self.blocks = [joined]
        return dict(zip(self.COLUMNS, joined))


class SequenceTokens:
    """A request's token ids as the manager reads them: the trace's prompt, then its outputs."""

    def __init__(self, scheduler: "Scheduler", rid: int):
        self.s, self.rid = scheduler, rid

    def __len__(self) -> int:
        return int(self.s.known[self.rid])

    def __getitem__(self, index: slice) -> list[int]:
        return [self.s.token(self.rid, i) for i in range(*index.indices(len(self)))]


class Scheduler:
    def __init__(self, trace: Trace, config: SchedulerConfig, record_batches: bool = False, allocator: KVCacheManager | None = None):
        """allocator: the block manager the requests' KV is booked in (default: the paged KVCacheManager of the
        config's pool; kvcache.serve also passes a ContiguousAllocator, max-length reservations behind its interface)."""
        n, c = len(trace), config
        self.trace, self.n, self.config, self.record_batches = trace, n, c, record_batches
        self.m = allocator if allocator is not None else KVCacheManager(c.num_blocks, c.block_size, c.prefix_caching)
        if (self.m.block_size, self.m.pool.num_blocks) != (c.block_size, c.num_blocks):
            raise ValueError(f"the allocator's {self.m.pool.num_blocks} blocks of {self.m.block_size} are not the config's "
                             f"{c.num_blocks} of {c.block_size}")
        self.watermark = self.m.watermark               # blocks kept free at admission
        self.known = trace.prompt_len.astype(np.int64).copy()
        self.computed = np.zeros(n, np.int64)
        self.held = np.zeros(n, np.int64)               # blocks each request holds
        self.generated = np.zeros(n, np.int64)
        self.first_scheduled = np.full(n, np.nan)
        self.first_token = np.full(n, np.nan)
        self.finish = np.full(n, np.nan)
        self.preemptions = np.zeros(n, np.int64)
        self.finished = 0                               # requests done (np.isfinite(self.finish).sum(), kept count of)
        self.outputs: dict[int, list[int]] = {}         # sampled token ids, when the executor gives them
        self.token_times: dict[int, list[float]] = {}
        self.preempted_spans: list[tuple[int, float, float]] = []  # (rid, out, back)
        self._out_since: dict[int, float] = {}
        self.running = np.zeros(0, np.int64)            # admission order: the last is preempted first
        self.mid_prefill = True                         # a request of the last step computed without sampling
        self.waiting: deque[int] = deque()
        self.swapped: deque[int] = deque()
        self.next_arrival = 0
        self.log = StepLog()
        self.batches: list[tuple[np.ndarray, np.ndarray]] = []
        self.sampled_logits: list[tuple[np.ndarray, object]] = []  # record_batches, the engine: (rids sampled, their logits) per step

    # --- tokens --------------------------------------------------------------------------------------
    def token(self, rid: int, i: int) -> int:
        prompt = int(self.trace.prompt_len[rid])
        if i < prompt:
            return self.trace.token(rid, i)
        out = self.outputs.get(rid)
        return out[i - prompt] if out is not None else self.trace.token(rid, i)  # the simulator samples nothing

    # --- one step --------------------------------------------------------------------------------------
    def schedule(self, now: float, index: int) -> Step | None:
        c, m, bs = self.config, self.m, self.config.block_size
        self._intake(now)
        ops: list = []
        self._swap_in(ops, now)
        admitted: list[tuple[int, int, int]] = []
        prefill_only = not c.chunked_prefill and self.waiting and not self.swapped
        if prefill_only:
            admitted = self._admit(c.token_budget, now)
        if admitted:
            takes = np.zeros(len(self.running) - len(admitted), np.int64)
        else:
            takes, preempted = self._take_running(ops, now)
            if c.chunked_prefill and not preempted and not self.swapped:
                admitted = self._admit(c.token_budget - int(takes.sum()), now)
        rids = self.running[:len(takes)]
        if admitted:
            rids = np.concatenate([rids, np.array([a[0] for a in admitted], np.int64)])
            takes = np.concatenate([takes, np.array([a[2] for a in admitted], np.int64)])
        if not takes.all():
            picked = takes > 0
            rids, takes = rids[picked], takes[picked]
        if len(rids) == 0 and not ops:
            return None  # nothing to run: the caller waits for the next arrival
        starts = self.computed[rids]
        ends = starts + takes
        samples = ends == self.known[rids]
        is_decode = (takes == 1) & samples & (self.generated[rids] > 0)
        decodes = int(np.count_nonzero(is_decode))
        pairs = 0
        if decodes < len(rids):
            chunk = takes > 1
            pairs = scored_prefill_pairs(takes[chunk], ends[chunk], bs)
        step = Step(index, now, rids, starts, takes, samples, ops, int(takes.sum()) - decodes, decodes,
                    int((-(-ends // bs)).sum()), sum(len(ids) for _, _, ids in ops), pairs)
        first = rids[np.isnan(self.first_scheduled[rids])]
        self.first_scheduled[first] = now
        return step

    def _intake(self, now: float) -> None:
        while self.next_arrival < self.n and self.trace.arrival[self.next_arrival] <= now:
            self.waiting.append(self.next_arrival)
            self.next_arrival += 1

    def _take_running(self, ops: list, now: float) -> tuple[np.ndarray, bool]:
        """Tokens for each running request (admission order) within the budget, preempting from the back
        until the pool holds them; books their blocks."""
        c, m, bs = self.config, self.m, self.config.block_size
        preempted = False
        while True:
            run = self.running
            computed = self.computed[run]
            need = self.known[run] - computed
            takes = need
            if c.chunked_prefill and need.sum() > c.token_budget:  # the budget runs out: later requests get less
                takes = np.minimum(np.maximum(c.token_budget - (np.cumsum(need) - need), 0), need)
            ends = computed + takes
            new_blocks = -(-ends // bs) - self.held[run]
            if new_blocks.sum() <= m.pool.num_free:
                break
            self._preempt(int(run[-1]), ops, now)
            preempted = True
        grows = new_blocks > 0
        if c.prefix_caching:
            grows |= ends // bs > computed // bs  # fills a block
        for i in np.flatnonzero(grows).tolist():  # the manager hears only of new or filled blocks
            rid = int(run[i])
            m.grow(rid, int(ends[i]), SequenceTokens(self, rid) if c.prefix_caching else None)  # token ids: for hashes only
            self.held[rid] = len(m.seqs[rid].table)
        return takes, preempted

    def _admit(self, budget: int, now: float) -> list[tuple[int, int, int]]:
        """Waiting requests, first come first served, while the batch, the budget and the pool allow."""
        c, m = self.config, self.m
        admitted = []
        while self.waiting and len(self.running) < c.max_batch and budget > 0:
            rid = self.waiting[0]
            known = int(self.known[rid])
            if budget >= known and m.blocks_for(known + 1) - (known - 1) // c.block_size + self.watermark > m.pool.num_free:
                break  # it would not fit whole even if every full block of it were cached: no need to hash them
            tokens = SequenceTokens(self, rid)
            hit = m.cached_prefix(tokens) if c.prefix_caching else 0
            want = int(self.known[rid]) - hit
            take = min(want, budget)
            if take < want and not c.chunked_prefill:
                break  # whole prompts only: the head of the queue waits for a step with room
            if m.blocks_for(hit + take + 1) - hit // c.block_size + self.watermark > m.pool.num_free:
                break
            try:
                m.add(rid, tokens, hit + take)
            except MemoryError:
                break
            self.waiting.popleft()
            self.computed[rid], self.held[rid] = hit, len(m.seqs[rid].table)
            self.running = np.append(self.running, rid)
            self._back(rid, now)
            admitted.append((rid, hit, take))
            budget -= take
        return admitted

    def _preempt(self, rid: int, ops: list, now: float) -> None:
        m = self.m
        self.running = self.running[:-1]
        self.preemptions[rid] += 1
        self._out_since[rid] = now
        if self.config.preemption == "swap":
            m.grow(rid, int(self.computed[rid]), SequenceTokens(self, rid))  # bring the lazy count up to date
            ops.append(("swap_out", rid, m.swap_out(rid)))
            self.swapped.appendleft(rid)
        else:
            m.free(rid)
            self.computed[rid] = 0
            self.waiting.appendleft(rid)
        self.held[rid] = 0

    def _swap_in(self, ops: list, now: float) -> None:
        m = self.m
        while self.swapped and len(self.running) < self.config.max_batch:
            rid = self.swapped[0]
            if m.blocks_for(int(self.computed[rid])) + self.watermark > m.pool.num_free:
                break
            self.swapped.popleft()
            ops.append(("swap_in", rid, m.swap_in(rid)))
            self.held[rid] = len(m.seqs[rid].table)
            self.running = np.append(self.running, rid)
            self._back(rid, now)

    def _back(self, rid: int, now: float) -> None:
        if rid in self._out_since:
            self.preempted_spans.append((rid, self._out_since.pop(rid), now))

    def complete(self, step: Step, seconds: float, tokens: np.ndarray | None) -> None:
        """The step took `seconds`; `tokens` are the sampled ids of the requests with step.samples set."""
        rids, end = step.rids, step.start + seconds
        # A request that computed without sampling (a prefill chunk) has more than one token to compute: no decode
        # run can start after this step (decode_run's first, cheap test; half of its calls end there).
        self.mid_prefill = not step.samples.all()
        self.computed[rids] += step.takes
        sampled = rids[step.samples]
        self.generated[sampled] += 1
        self.known[sampled] += 1
        self.first_token[sampled[self.generated[sampled] == 1]] = end
        if tokens is not None:
            for rid, token in zip(sampled.tolist(), tokens.tolist()):
                self.outputs.setdefault(rid, []).append(token)
                self.token_times.setdefault(rid, []).append(end)
        done = sampled[self.generated[sampled] >= self.trace.output_len[sampled]]
        if len(done):
            self.finish[done] = end
            self.finished += len(done)
            for rid in done.tolist():
                self.m.free(rid)
                self.held[rid] = 0
            run = self.running
            self.running = run[self.generated[run] < self.trace.output_len[run]]
        self.log.add(step.start, seconds, len(rids), step.prefill_tokens, step.decode_tokens, step.kv_blocks,
                     len(self.running), len(self.waiting), len(self.swapped), step.swapped_blocks,
                     step.prefill_pairs)
        if self.record_batches:
            self.batches.append((rids, step.takes))

    # --- a run of decode steps at once ----------------------------------------------------------------
    def decode_run(self, executor, now: float, index: int, cap: int = 1024) -> tuple[float, int]:
        """When every running request is decoding and nothing can join (no request waits, or the batch is
        full, and none is swapped out), the coming steps differ only in which requests are still running
        and the KV blocks they read, until one arrives, a finishing request makes room for one waiting, or
        the pool might run short (counted without the blocks finishing requests give back, so never
        wrongly). Take them together: the same steps with the same times (summed in the same order), the
        manager told of each block taken, filled or freed in the order the steps would. Returns (now,
        steps taken), 0 steps if the state is not such a run; a test holds it to the step-by-step schedule."""
        c, m, bs = self.config, self.m, self.config.block_size
        run = self.running
        if (self.mid_prefill or not len(run) or self.swapped or (self.waiting and len(run) < c.max_batch)
                or len(run) > c.token_budget):
            return now, 0
        computed, generated = self.computed[run], self.generated[run]
        if ((self.known[run] - computed != 1) | (generated == 0)).any():
            return now, 0
        left = self.trace.output_len[run] - generated  # request i decodes in steps 1 .. left[i], then finishes
        longest = int(min(left.min() if self.waiting else left.max(), cap))  # a finish lets a waiting one in
        room = m.pool.num_free + int(self.held[run].sum())  # blocks the running requests may hold in all
        for horizon in (min(64, longest), longest):  # a short look first: an arrival usually ends the run soon
            step = STEP_NUMBERS[:horizon] if horizon <= len(STEP_NUMBERS) else np.arange(1, horizon + 1)
            active = step <= left[:, None]                                   # (running, step)
            ends = computed[:, None] + np.minimum(step, left[:, None])        # tokens computed after the step
            blocks = -(-ends // bs)
            fits = blocks.sum(0) <= room
            k = horizon if fits[-1] else int(np.argmin(fits))                # blocks only grow: fits is monotone
            if k == 0:
                return now, 0
            decodes = active[:, :k].sum(0)
            kv = (blocks[:, :k] * active[:, :k]).sum(0)
            times = executor.decode_times(index, decodes, kv)
            clock = np.empty(len(times) + 1)
            clock[0], clock[1:] = now, times
            clock = np.cumsum(clock)[1:]  # summed in order, as one step at a time would
            if not self.waiting and self.next_arrival < self.n:  # stop at the step that ends at or after it
                k = min(k, int(np.searchsorted(clock, self.trace.arrival[self.next_arrival])) + 1)
            if k < horizon or horizon == longest:
                break
        times, clock, decodes, kv = times[:k], clock[:k], decodes[:k], kv[:k]
        taken = np.minimum(left, k)
        self.known[run] += taken  # first: the manager reads the new tokens' ids to hash the blocks they fill
        if c.prefix_caching:
            self._book_run_in_step_order(run, computed, taken, left)
        else:  # blocks are only counted (no hash can find them): each request's blocks at once, then the finished freed
            ends = computed + taken
            for rid, end, grows in zip(run.tolist(), ends.tolist(), (-(-ends // bs) > self.held[run]).tolist()):
                if grows:
                    m.grow(rid, end, None)
                    self.held[rid] = len(m.seqs[rid].table)
            for rid in run[taken == left].tolist():
                m.free(rid)
                self.held[rid] = 0
        self.computed[run] += taken
        self.generated[run] += taken
        done = left <= k
        self.finish[run[done]] = clock[left[done] - 1]
        self.finished += int(np.count_nonzero(done))
        self.running = run[left > k]
        waiting = 0  # a run stops at the first arrival unless requests already wait (then more queue behind them)
        if self.waiting:
            starts = np.empty(k)
            starts[0], starts[1:] = now, clock[:-1]
            waiting = len(self.waiting) + np.maximum(np.searchsorted(self.trace.arrival, starts, side="right") - self.next_arrival, 0)
        self.log.decode_run(now, times, clock, decodes, kv, len(self.running), waiting)
        return float(clock[-1]), k

    def _book_run_in_step_order(self, run, computed, taken, left) -> None:
        """The manager's calls of a decode run in the steps' order (with prefix caching, which blocks a hash finds
        and which free block is evicted first depend on it): in each step a block taken where a request's token
        starts one, or filled where it ends one, in running order, then the requests that finished in it freed."""
        m, bs = self.m, self.config.block_size
        events = []  # (step, 0 = grow / 1 = free, request); few per run: a Python list
        for i, (start, steps) in enumerate(zip(computed.tolist(), taken.tolist())):
            events += [(t, 0, i) for t in range(-start % bs, steps, bs)]        # token start + t + 1 opens a block
            if bs > 1:
                events += [(t, 0, i) for t in range((-start - 1) % bs, steps, bs)]  # ... or fills one
            if steps == left[i]:
                events.append((steps - 1, 1, i))
        events.sort()
        rids, starts_of = run.tolist(), computed.tolist()
        for t, finished, i in events:
            rid = rids[i]
            if finished:
                m.free(rid)
                self.held[rid] = 0
            else:
                m.grow(rid, starts_of[i] + t + 1, SequenceTokens(self, rid))
                self.held[rid] = len(m.seqs[rid].table)

    # --- the loop ----------------------------------------------------------------------------------------
    def run(self, executor, progress=None, max_steps: int = 50_000_000) -> "Scheduler":
        """Steps until every request finished (see `steps`)."""
        next_progress = 2000
        for index in self.steps(executor, max_steps):
            if progress and index >= next_progress:
                progress(self.finished / self.n)
                next_progress = index + 2000
        return self

    def steps(self, executor, max_steps: int = 50_000_000):
        """The loop, one step (or one decode run) per iteration; yields the steps taken so far. Several
        engines can be stepped in turn (`engine.serve_interleaved`): each measures only its own steps.
        `executor.execute(step, scheduler)` returns (seconds or None, sampled tokens or None); None seconds
        means 'as long as it took': this thread's CPU time for the step, from the end of the previous one
        (its bookkeeping) through scheduling and the forward. CPU time, not wall time: on a shared machine
        wall time also counts other people's work; on a dedicated core (one thread per step, no waiting on
        I/O) the two agree. Requests arrive on the same clock, and idle time until an arrival is skipped."""
        measured = getattr(executor, "measured", False)  # the engine: time is what a step took
        clock = time.thread_time if measured else float  # float(): 0.0, no system call for the simulator
        now, index, n, carried = 0.0, 0, self.n, 0.0
        runs = hasattr(executor, "decode_times") and not self.record_batches
        while self.next_arrival < n or len(self.running) or self.waiting or self.swapped:
            resumed = clock()
            if runs:
                self._intake(now)
                now, k = self.decode_run(executor, now, index)
                if k:
                    index += k
                    yield index
                    continue
            step = self.schedule(now, index)
            if step is None:
                if self.next_arrival >= n:
                    raise RuntimeError(f"requests {list(self.waiting)[:5]} can never be scheduled")
                now = max(now, float(self.trace.arrival[self.next_arrival]))  # idle until the next arrival
                carried = 0.0
                continue
            seconds, tokens = executor.execute(step, self)
            if seconds is None:
                seconds = carried + clock() - resumed
            now += seconds
            done = clock()
            self.complete(step, seconds, tokens)
            carried = clock() - done  # booking this step's results is part of the next one's time
            index += 1
            if index > max_steps:
                raise RuntimeError("the schedule did not finish")
            yield index
