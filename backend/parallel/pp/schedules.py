"""Pipeline schedules as data: for every rank, the ordered list of actions it performs.

An action is (kind, microbatch, stage): F forward; B backward; I and W the input- and weight-gradient halves of a
split backward (zero bubble). With v virtual stages per rank, rank r holds stages r, r + p, r + 2p, ... (looped); in
the V schedules (ZB-V, DualPipe-V) chunk 0 on rank r is stage r and chunk 1 stage 2p - 1 - r, so the last stage sits
on rank 0 beside the first. Stage s feeds s + 1: the executor adds the messages (none inside one rank, a V's turn).
"""
from __future__ import annotations

import itertools
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, NamedTuple


class Action(NamedTuple):
    kind: str  # F | B | I | W
    mb: int
    stage: int

    def __str__(self) -> str:  # torch.distributed.pipelining's _Action prints "{stage}{kind}{mb}"
        return f"{self.stage}{self.kind}{self.mb}"


ACTIONS = ("F", "B", "I", "W")


def is_action(e: dict) -> bool:
    """Whether a trace event is a pipeline action (the executor's F, B, I or W span)."""
    return e["lane"] == "compute" and e["args"].get("kind") in ACTIONS


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
    """Zero-bubble H1: 1F1B with each backward split into I (on the critical path) and W, W deferred by r slots to
    fill the bubble the drain would leave."""
    warmup = min(m, p - r)
    ops = [Action("F", i, r) for i in range(warmup)]
    for k in range(m):
        ops += [Action("I", k, r)] + ([Action("W", k - r, r)] if k >= r else [])
        if k + warmup < m:
            ops.append(Action("F", k + warmup, r))
    return ops + [Action("W", i, r) for i in range(max(0, m - r), m)]


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

    taken = {"F": defaultdict(itertools.count), "B": defaultdict(itertools.count)}  # next micro-batch per stage

    def act(kind: str, stage: int) -> Action:
        return Action(kind, next(taken[kind][stage]), stage)
    ops = [act("F", fwd_stage(step)) for step in range(warmup)]
    for step in range(warmup, total):
        ops += [act("F", fwd_stage(step)), act("B", bwd_stage(step))]
    return ops + [act("B", bwd_stage(step)) for step in range(total, total + warmup)]


class _V:
    """A V schedule's order being built on rank r: chunk 0 is stage r, chunk 1 stage 2p - 1 - r; F and the backward
    (B or I) count their micro-batches per chunk, and each I's W waits in `deferred` until played."""

    def __init__(self, p: int, r: int):
        self.stages, self.ops, self.deferred = (r, 2 * p - 1 - r), [], []
        self.count = {"F0": 0, "F1": 0, "B0": 0, "B1": 0}

    def play(self, pattern: str, times: int = 1) -> None:
        """Append `pattern` `times` times: "F0 B1 I1" are (kind, chunk); "W" the oldest waiting W, "W1" chunk 1's."""
        for _ in range(times):
            for a in pattern.split():
                if a[0] == "W":
                    waiting = [w for w in self.deferred if a[1:] in ("", str(w[0]))]
                    if waiting:
                        self.deferred.remove(waiting[0])
                        self.ops.append(Action("W", waiting[0][1], self.stages[waiting[0][0]]))
                    continue
                key = ("F" if a[0] == "F" else "B") + a[1]
                self.ops.append(Action(a[0], self.count[key], self.stages[int(a[1])]))
                if a[0] == "I":
                    self.deferred.append((int(a[1]), self.count[key]))
                self.count[key] += 1


def zb_v(p: int, m: int, r: int) -> list[Action]:
    """ZB-V (zero-bubble paper, section 6): two chunks per rank in a V, every backward split into I and W (the
    phases below). Built for max(m, 2p-1) micro-batches, those past m dropped, as torch's ScheduleZBVZeroBubble does."""
    v, n = _V(p, r), max(2 * p - 1, m)
    v.play("F0", 2 * (p - r) - 1)
    v.play("F1 F0", r)
    v.play("F1 I1 W1", p - r)
    while v.count["F1"] < v.count["F0"] or v.count["F0"] < n:
        v.play(("F0 " if v.count["F0"] < n else "") + "I0 W0 F1 I1 W1")
    v.play("I0 I1", r)
    v.play("I0 W0", p - r)
    v.play("W1", r)
    v.play("W0", r)
    return [a for a in v.ops if a.mb < m]


def dualpipe_v(p: int, m: int, r: int) -> list[Action]:
    """DualPipe-V (DeepSeek-V3's DualPipe cut in half, as torch's ScheduleDualPipeV): two chunks per rank in a V. The
    main phase pairs a forward of one chunk with a full backward of the other (DualPipe overlaps the pair's compute
    and communication; here they run one after the other); the cool-down switches to I (W deferred) half way through
    its B1 B0 pairs. Needs m >= 2p."""
    v = _V(p, r)
    v.play("F0", 2 * (p - r - 1))
    v.play("F0 F1", r + 1)
    v.play("I1 W F1", p - r - 1)
    v.play("F0 B1 F1 B0", m - 2 * p + r + 1)
    v.play("B1 F1 B0", p - r - 1)
    split = False
    for i in range(r + 1):
        split = split or (i == (r + 1) // 2 and r % 2 == 1)
        v.play("I1" if split else "B1")
        split = split or (i == (r + 1) // 2 and r % 2 == 0)
        v.play("I0" if split else "B0")
    v.play("W I0" if split else "W B0", p - r - 1)
    v.play("W", r + 1)
    return v.ops


def live_activations(order: list[Action], size=None) -> int:
    """Peak activations a rank's order keeps: +1 at F, -1 at B or W (I keeps them for its W); with size(stage, mb),
    the peak of their summed sizes (bytes) instead of their count."""
    live = peak = 0
    for kind, mb, stage in order:
        held = size(stage, mb) if size else 1
        live += held if kind == "F" else (-held if kind in ("B", "W") else 0)
        peak = max(peak, live)
    return peak


@dataclass(frozen=True)
class Schedule:
    """A schedule: its per-rank action lists, what it implies, and the flags the config, executor and page read
    (nothing outside this file compares schedule names)."""
    name: str
    title: str
    order_fn: Callable[..., list[Action]]          # (p, m, r) or, interleaved, (p, m, r, v)
    bubble_fn: Callable[[int, int, int], float] = lambda p, m, v: (p - 1) / (m + p - 1)  # (p, m, v chunks)
    bubble_formula: str = "(p−1)/(m+p−1)"
    interleaved: bool = False       # v model chunks per rank
    v_shape: bool = False           # two chunks per rank in a V: chunk 0 is stage r, chunk 1 stage 2p - 1 - r
    whole_batch: bool = False       # no micro-batching: the batch runs as one micro-batch
    split_backward: bool = False    # zero bubble: each backward split into I (input grad) and W (weight grad)
    asynchronous: bool = False      # PipeDream: weights updated after every backward, no flush
    supports_recompute: bool = False
    # (f, b per stage, m) -> the closed-form makespan generalised to unequal stages, where known (checked by replay)
    makespan_fn: Callable[[list, list, int], float] | None = None
    live_bound_fn: Callable[[int, int, int], int] | None = None  # (p, m, r) -> the bound the seed states, if any
    live_bound_source: str = "the peak its order implies"
    min_microbatches_fn: Callable[[int], int] | None = None  # p -> the fewest micro-batches the order is built for
    # (p, F, I, W per chunk) -> the published idle per rank (drawn, not checked: it assumes DualPipe's overlap)
    published_idle_fn: Callable[[int, float, float, float], float] | None = None
    published_idle_formula: str = ""
    torch_peer: str | None = None   # torch.distributed.pipelining class run on the same model as a peer
    torch_order: str | None = None  # torch.distributed.pipelining class whose per-rank order is data to compare

    def microbatches(self, m: int) -> int:
        return 1 if self.whole_batch else m

    def chunks(self, v: int) -> int:
        return 2 if self.v_shape else (v if self.interleaved else 1)

    def rank_of(self, stage: int, p: int) -> int:
        """The rank holding a stage: looped (s mod p) or V-shaped (down the ranks, then back up)."""
        if self.v_shape:
            return stage if stage < p else 2 * p - 1 - stage
        return stage % p

    def stages_on(self, rank: int, p: int, v: int = 1) -> list[int]:
        return [s for s in range(p * self.chunks(v)) if self.rank_of(s, p) == rank]

    def order(self, p: int, m: int, r: int, v: int = 1) -> list[Action]:
        m = self.microbatches(m)
        return self.order_fn(p, m, r, v) if self.interleaved else self.order_fn(p, m, r)

    def actions(self, p: int, m: int, v: int = 1) -> dict[int, list[Action]]:
        return {r: self.order(p, m, r, v) for r in range(p)}

    def bubble(self, p: int, m: int, v: int = 1) -> float:
        """Idle fraction of each stage with equal action costs: the textbook formula."""
        return self.bubble_fn(p, self.microbatches(m), self.chunks(v))

    def live_bound(self, p: int, m: int, r: int, v: int = 1) -> int:
        bound = self.live_bound_fn(p, self.microbatches(m), r) if self.live_bound_fn else None
        return live_activations(self.order(p, m, r, v)) if bound is None else bound


def _forward_then_backward(f, b, m):  # every forward wave, then every backward wave
    return sum(f) + (m - 1) * max(f) + sum(b) + (m - 1) * max(b)


def _alternating(f, b, m):  # warm-up, then F and B alternate on the busiest stage
    c = [x + y for x, y in zip(f, b)]
    return sum(c) + (m - 1) * max(c)


def _p_minus_r(p, m, r):  # seed 000: 1F1B holds at most p - r
    return min(m, p - r)


def _zb_v_live(p, m, r):  # zero-bubble paper: ZB-V holds 1F1B's peak, p whole-rank = 2p chunk activations, on every rank
    return 2 * p if m >= 2 * p - 1 else None  # (fewer micro-batches than the warm-up: the order's own peak)


def _dualpipe_idle(p, f, i, w):
    b = i + w  # DeepSeek-V3 Table 2 (published_idle_formula), F&B run one after the other: F + B
    return (p - 1) * ((f + b) + b - 3 * w)


def _v_bubble(p, m, v):
    """With F = I = W per chunk each rank idles p - 1 chunk-forwards per flushed step (the warm-up staircase and its
    mirror), out of 6m busy; the paper's "zero bubble" is the steady state, the staircase hidden by the next step."""
    return (p - 1) / (6 * m + p - 1)


SCHEDULES = {s.name: s for s in (
    Schedule("naive", "naive (no micro-batches)", gpipe, bubble_fn=lambda p, m, v: (p - 1) / p, bubble_formula="(p−1)/p",
             whole_batch=True, supports_recompute=True, makespan_fn=_forward_then_backward,
             live_bound_fn=lambda p, m, r: m, live_bound_source="one micro-batch"),
    Schedule("gpipe", "GPipe (F then B)", gpipe, supports_recompute=True, makespan_fn=_forward_then_backward,
             torch_peer="ScheduleGPipe", live_bound_fn=lambda p, m, r: m, live_bound_source="seed 000: all m"),
    Schedule("1f1b", "1F1B (PipeDream-flush)", one_f_one_b, supports_recompute=True, makespan_fn=_alternating,
             torch_peer="Schedule1F1B", live_bound_fn=_p_minus_r, live_bound_source="seed 000: p − r"),
    Schedule("interleaved_1f1b", "interleaved 1F1B", interleaved_1f1b, bubble_fn=lambda p, m, v: (p - 1) / (v * m + p - 1),
             bubble_formula="(p−1)/(v·m+p−1)", interleaved=True, torch_order="ScheduleInterleaved1F1B"),
    Schedule("zb_h1", "zero bubble H1", zb_h1, bubble_fn=lambda p, m, v: (p - 1) / (3 * m + p - 1),
             bubble_formula="(p−1)/(3m+p−1) with F = I = W", split_backward=True, torch_order="ScheduleInterleavedZeroBubble"),
    Schedule("zb_v", "ZB-V (zero bubble, V-shaped)", zb_v, bubble_fn=_v_bubble,
             bubble_formula="(p−1)/(6m+p−1) with F = I = W per chunk", v_shape=True, split_backward=True,
             live_bound_fn=_zb_v_live, live_bound_source="zero-bubble paper: 1F1B's peak, 2p chunk activations",
             torch_order="ScheduleZBVZeroBubble"),
    Schedule("dualpipe_v", "DualPipe-V (DeepSeek-V3)", dualpipe_v, bubble_fn=_v_bubble,
             bubble_formula="(p−1)/(6m+p−1) with F = I = W per chunk; DeepSeek-V3: (PP/2−1)(F&B+B−3W)", v_shape=True,
             split_backward=True, live_bound_fn=lambda p, m, r: 2 * p + 1,
             live_bound_source="DeepSeek-V3 Table 2: PP + 1 chunk activations, PP = 2p", torch_order="ScheduleDualPipeV",
             min_microbatches_fn=lambda p: 2 * p, published_idle_fn=_dualpipe_idle,
             published_idle_formula="DeepSeek-V3 Table 2: (PP/2−1)(F&B+B−3W), PP = 2p, B = I + W, F&B = F + B unoverlapped"),
    # PipeDream: 1F1B's order, each stage updating its weights after every backward with no flush (weight stashing
    # keeps each micro-batch's backward on the weights its forward used)
    Schedule("pipedream", "PipeDream (async 1F1B)", one_f_one_b, asynchronous=True, live_bound_fn=_p_minus_r,
             live_bound_source="seed 000: p − r"),
)}
