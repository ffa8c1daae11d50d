"""Pipeline schedules as data: for every rank, the ordered list of actions it performs.

An action is (kind, microbatch, stage): F forward; B backward (input and weight gradients); I the
input-gradient half of a split backward and W its weight-gradient half (zero-bubble). `stage` is the
virtual stage id; with v virtual stages per rank, rank r holds stages r, r + p, r + 2p, ...
Sends and receives are implied by the stage graph (stage s feeds s + 1) and added by the executor.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple


class Action(NamedTuple):
    kind: str  # F | B | I | W
    mb: int
    stage: int

    def __str__(self) -> str:  # torch.distributed.pipelining's _Action prints "{stage}{kind}{mb}"
        return f"{self.stage}{self.kind}{self.mb}"


def gpipe(p: int, m: int, r: int) -> list[Action]:
    """F-then-B: every forward, then every backward; m activations live at the peak."""
    return [Action("F", i, r) for i in range(m)] + [Action("B", i, r) for i in range(m)]


def one_f_one_b(p: int, m: int, r: int) -> list[Action]:
    """PipeDream-flush: p - r - 1 warm-up forwards, then alternate F and B, then drain; <= p - r live."""
    warmup = min(m, p - r - 1)
    ops = [Action("F", i, r) for i in range(warmup)]
    for i in range(m - warmup):
        ops += [Action("F", warmup + i, r), Action("B", i, r)]
    return ops + [Action("B", i, r) for i in range(m - warmup, m)]


def zb_h1(p: int, m: int, r: int) -> list[Action]:
    """Zero-bubble H1: 1F1B with each backward split into I (input grad, on the critical path) and W (weight
    grad), W deferred by r slots to fill the bubble the drain would leave."""
    warmup = min(m, p - r)
    ops = [Action("F", i, r) for i in range(warmup)]
    w_next = 0
    for k in range(m):
        ops.append(Action("I", k, r))
        if k >= r:
            ops.append(Action("W", w_next, r))
            w_next += 1
        if k + warmup < m:
            ops.append(Action("F", k + warmup, r))
    return ops + [Action("W", i, r) for i in range(w_next, m)]


def interleaved_1f1b(p: int, m: int, r: int, v: int) -> list[Action]:
    """Interleaved 1F1B (Megatron-LM, with the flexible rounds PyTorch uses): v model chunks per rank, forwards
    go depth-first through chunks in rounds of micro-batches, backwards through chunks in reverse."""
    rounds = max(1, m // p)
    per_round = m // rounds
    warmup = min((v - 1) * per_round + 2 * (p - 1 - r), v * m)
    total = v * m

    def fwd_stage(step):
        return ((step // per_round) % v) * p + r

    def bwd_stage(step):
        return (v - 1 - ((step - warmup) // per_round) % v) * p + r

    next_f, next_b, ops = {}, {}, []

    def take(counter, stage):
        counter[stage] = counter.get(stage, -1) + 1
        return counter[stage]

    for step in range(warmup):
        s = fwd_stage(step)
        ops.append(Action("F", take(next_f, s), s))
    for step in range(warmup, total):
        s = fwd_stage(step)
        ops.append(Action("F", take(next_f, s), s))
        s = bwd_stage(step)
        ops.append(Action("B", take(next_b, s), s))
    for step in range(total, total + warmup):
        s = bwd_stage(step)
        ops.append(Action("B", take(next_b, s), s))
    return ops


def pipedream(p: int, m: int, r: int) -> list[Action]:
    """PipeDream's asynchronous 1F1B: the same order as 1F1B, but each stage updates its weights after every
    backward, with no flush; weight stashing keeps each micro-batch's backward on the weights its forward used."""
    return one_f_one_b(p, m, r)


def live_activations(order: list[Action]) -> int:
    """Peak activations a rank's order keeps: +1 at F, -1 at B or W (I keeps them for its W)."""
    live = peak = 0
    for a in order:
        live += 1 if a.kind == "F" else (-1 if a.kind in ("B", "W") else 0)
        peak = max(peak, live)
    return peak


def _flush_bubble(p: int, m: int, v: int) -> float:
    return (p - 1) / (m + p - 1)


@dataclass(frozen=True)
class Schedule:
    """A schedule: its per-rank action lists, what it implies, and the flags the config, executor and page read.
    Nothing outside this file compares schedule names."""
    name: str
    title: str
    order_fn: Callable[..., list[Action]]          # (p, m, r) or, interleaved, (p, m, r, v)
    bubble_fn: Callable[[int, int, int], float] = _flush_bubble
    bubble_formula: str = "(p−1)/(m+p−1)"
    interleaved: bool = False       # v model chunks per rank
    whole_batch: bool = False       # no micro-batching: the batch runs as one micro-batch
    split_backward: bool = False    # zero bubble: each backward split into I (input grad) and W (weight grad)
    asynchronous: bool = False      # PipeDream: weights updated after every backward, no flush
    supports_recompute: bool = False
    # The makespan given each stage's forward and backward cost per micro-batch (lists f, b) and m: the formula
    # generalised to unequal stages, where one is known (checked against the replay).
    makespan_fn: Callable[[list, list, int], float] | None = None
    live_bound_fn: Callable[[int, int, int], int] | None = None  # (p, m, r) -> the bound the seed states, if any
    live_bound_source: str = "the peak its order implies"
    torch_peer: str | None = None   # torch.distributed.pipelining class run on the same model as a peer
    torch_order: str | None = None  # torch.distributed.pipelining class whose per-rank order is data to compare

    def microbatches(self, m: int) -> int:
        return 1 if self.whole_batch else m

    def chunks(self, v: int) -> int:
        return v if self.interleaved else 1

    def actions(self, p: int, m: int, v: int = 1) -> dict[int, list[Action]]:
        m = self.microbatches(m)
        if self.interleaved:
            return {r: self.order_fn(p, m, r, v) for r in range(p)}
        return {r: self.order_fn(p, m, r) for r in range(p)}

    def bubble(self, p: int, m: int, v: int = 1) -> float:
        """Idle fraction of each stage with equal action costs: the textbook formula."""
        return self.bubble_fn(p, self.microbatches(m), self.chunks(v))

    def live_bound(self, p: int, m: int, r: int, v: int = 1) -> int:
        if self.live_bound_fn:
            return self.live_bound_fn(p, self.microbatches(m), r)
        return live_activations(self.actions(p, m, v)[r])


def _forward_then_backward(f, b, m):  # every forward wave, then every backward wave
    return sum(f) + (m - 1) * max(f) + sum(b) + (m - 1) * max(b)


def _alternating(f, b, m):  # warm-up, then F and B alternate on the busiest stage
    c = [x + y for x, y in zip(f, b)]
    return sum(c) + (m - 1) * max(c)


def _all_microbatches(p, m, r):  # seed 000: GPipe holds every micro-batch's activations
    return m


def _p_minus_r(p, m, r):  # seed 000: 1F1B holds at most p - r
    return min(m, p - r)


SCHEDULES = {s.name: s for s in (
    Schedule("naive", "naive (no micro-batches)", gpipe, bubble_fn=lambda p, m, v: (p - 1) / p, bubble_formula="(p−1)/p",
             whole_batch=True, supports_recompute=True, makespan_fn=_forward_then_backward, live_bound_fn=_all_microbatches, live_bound_source="one micro-batch"),
    Schedule("gpipe", "GPipe (F then B)", gpipe, supports_recompute=True, makespan_fn=_forward_then_backward,
             torch_peer="ScheduleGPipe",
             live_bound_fn=_all_microbatches, live_bound_source="seed 000: all m"),
    Schedule("1f1b", "1F1B (PipeDream-flush)", one_f_one_b, supports_recompute=True, makespan_fn=_alternating,
             torch_peer="Schedule1F1B",
             live_bound_fn=_p_minus_r, live_bound_source="seed 000: p − r"),
    Schedule("interleaved_1f1b", "interleaved 1F1B", interleaved_1f1b, bubble_fn=lambda p, m, v: (p - 1) / (v * m + p - 1),
             bubble_formula="(p−1)/(v·m+p−1)", interleaved=True, torch_order="ScheduleInterleaved1F1B"),
    Schedule("zb_h1", "zero bubble H1", zb_h1, bubble_fn=lambda p, m, v: (p - 1) / (3 * m + p - 1),
             bubble_formula="(p−1)/(3m+p−1) with F = I = W", split_backward=True, torch_order="ScheduleInterleavedZeroBubble"),
    Schedule("pipedream", "PipeDream (async 1F1B)", pipedream, asynchronous=True, live_bound_fn=_p_minus_r,
             live_bound_source="seed 000: p − r"),
)}
