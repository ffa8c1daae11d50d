"""Pipeline schedules as data: for every rank, the ordered list of actions it performs.

An action is (kind, microbatch, stage): F forward; B backward (input and weight gradients); I the
input-gradient half of a split backward and W its weight-gradient half (zero-bubble). `stage` is the
virtual stage id; with v virtual stages per rank, rank r holds stages r, r + p, r + 2p, ...
Sends and receives are implied by the stage graph (stage s feeds s + 1) and added by the executor.
"""
from __future__ import annotations

from typing import NamedTuple


class Action(NamedTuple):
    kind: str  # F | B | I | W
    mb: int
    stage: int

    def __str__(self) -> str:  # torch.distributed.pipelining's _Action prints "{stage}{kind}{mb}"
        return f"{self.stage}{self.kind}{self.mb}"


def naive(p: int, m: int, r: int) -> list[Action]:
    """No micro-batching: the whole batch as one, so one stage works at a time."""
    return [Action("F", 0, r), Action("B", 0, r)]


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


SCHEDULES = {"naive": naive, "gpipe": gpipe, "1f1b": one_f_one_b, "interleaved_1f1b": interleaved_1f1b,
             "zb_h1": zb_h1, "pipedream": pipedream}


def build(name: str, p: int, m: int, v: int = 1) -> dict[int, list[Action]]:
    if name == "interleaved_1f1b":
        return {r: interleaved_1f1b(p, m, r, v) for r in range(p)}
    return {r: SCHEDULES[name](p, 1 if name == "naive" else m, r) for r in range(p)}


def bubble_model(name: str, p: int, m: int, v: int = 1) -> float:
    """Idle fraction each stage spends, with equal F, B (and W = B/2... see notes) costs: the textbook formulas."""
    if name == "naive":
        return (p - 1) / p
    if name == "interleaved_1f1b":
        return (p - 1) / (v * m + p - 1)
    if name == "zb_h1":  # F = I = W: the bubble shrinks to a third of 1F1B's (Qi et al., 2023)
        return (p - 1) / (3 * m + p - 1)
    return (p - 1) / (m + p - 1)


def live_activations(order: list[Action]) -> int:
    """Peak activations a rank's order keeps: +1 at F, -1 at B or W (I keeps them for its W)."""
    live = peak = 0
    for a in order:
        live += 1 if a.kind == "F" else (-1 if a.kind in ("B", "W") else 0)
        peak = max(peak, live)
    return peak


def peak_live_bound(name: str, p: int, m: int, r: int, v: int = 1) -> int:
    """Seed 000's bounds: GPipe holds all m micro-batches' activations, 1F1B (and PipeDream) at most p - r;
    for interleaved and ZB-H1, the peak their order implies."""
    if name == "gpipe":
        return m
    if name == "naive":
        return 1
    if name in ("1f1b", "pipedream"):
        return min(m, p - r)
    return live_activations(build(name, p, m, v)[r])
