"""One executor for every schedule: each rank walks its action list on real gloo ranks (`execute`), for any stage
objects (the tiny LLaMA's stages, or the pipeline page's uniform Linear stack), run by parallel/mesh_train.train_rank.

Stage s feeds s + 1 on the rank the schedule places it; activations and gradients travel by send/recv with a tag per
(stage, micro-batch, direction), so interleaved stages sharing a pair of ranks never cross. Synchronous schedules
accumulate gradients over the micro-batches; PipeDream updates a stage's weights (SGD) after every backward, with
weight stashing on the weights its forward used, without it on the current ones (and measures how far that is off).
"""
from __future__ import annotations

import ctypes
import sys
import time
from contextlib import nullcontext

import torch

from backend.parallel.pp.recompute import ActivationMeter
from backend.parallel.pp.schedules import SCHEDULES
from backend.parallel.wire import Wire
from backend.trace import Tracer


def keep_freed_memory() -> bool:
    """Have glibc keep what this process frees (no block of up to 32 MiB mmapped on its own, no trim of the heap's top),
    as a GPU framework's caching allocator does; otherwise a freed block of 128 KiB or more goes back to the kernel and
    the next page-faults fresh pages on the CPU clock of the action that asks, so equal actions time unequally. Returns
    whether glibc took both settings."""
    if not sys.platform.startswith("linux"):
        return False
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    return bool(libc.mallopt(M_MMAP_THRESHOLD, 32 << 20) and libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1))


def _tag(stage: int, mb: int, grad: bool, m: int) -> int:
    return (stage * m + mb) * 2 + int(grad)


def execute(order, plan, stages: dict, pp_ranks: list[int], me: int, p: int, m: int, tracer: Tracer,
            recompute: bool = False, pipedream=None, meter: ActivationMeter | None = None) -> dict:
    """Walk one rank's action list for one step over its stages ({stage: object with input, input_like and
    forward(x, mb) -> output, or the loss on the last}); pp_ranks[i]: the global rank of pipeline rank i. I and W are
    torch.distributed.pipelining's own split (I keeps the gradients reaching each weight's consumer, W finishes from
    them: no input-gradient work or collective repeated). A boundary within this rank (a V's turn) is handed over in
    memory. Returns the figures of RankWalk.finish; a meter records the activation bytes autograd holds."""
    walk = RankWalk(plan, stages, pp_ranks, me, p, m, tracer, recompute, pipedream, meter)
    for kind, mb, s in order:
        if kind == "F":
            walk.forward(mb, s)
        elif kind in ("B", "I"):
            walk.backward(kind, mb, s)
        elif kind == "W":
            walk.weight(mb, s)
        walk.timeline.append({"t_us": tracer.now_us(), "live": walk.live})
    return walk.finish()


class RankWalk:
    """One rank's state while it walks its actions; one method per action kind."""

    def __init__(self, plan, stages: dict, pp_ranks: list[int], me: int, p: int, m: int, tracer: Tracer,
                 recompute: bool, pipedream, meter: ActivationMeter | None):
        self.plan, self.stages, self.pp_ranks, self.me, self.p, self.m, self.tracer = plan, stages, pp_ranks, me, p, m, tracer
        self.recompute, self.pipedream, self.meter = recompute, pipedream, meter
        self.saved: dict[tuple[int, int], dict] = {}
        self.local: dict[tuple[int, int, bool], torch.Tensor] = {}  # boundaries inside this rank
        self.pending_sends, self.live, self.peak, self.timeline, self.versions, self.grad_errors = [], 0, 0, [], [], []
        self.loss_sum, self.wire = 0.0, Wire(me, p, pp_ranks, tracer)  # the pp dimension: every message counted there
        self.version = {s: 0 for s in stages}
        self.recompute_cpu_us = []
        if plan.split_backward:  # torch's pipelining package costs seconds to import: only where it is used, before any action
            from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight
            self.backward_input, self.backward_weight = stage_backward_input, stage_backward_weight
        self.history = {s: {0: {k: v.detach().clone() for k, v in st.module.named_parameters()}} for s, st in stages.items()} \
            if pipedream else {}

    def saving(self, key, params=()):
        """The meter's record of what autograd saves for (stage, micro-batch) while the body runs, or nothing."""
        return self.meter.saving(key, [*self.stages[key[0]].module.parameters(), *params]) if self.meter else nullcontext()

    def send(self, t, to_stage, s, mb, grad):
        to = self.plan.rank_of(to_stage, self.p)
        if to == self.me:
            self.local[(s, mb, grad)] = t.detach()
        else:
            self.pending_sends.append(self.wire.send(t, to, _tag(s, mb, grad, self.m), f"send {'grad' if grad else 'act'} {mb}",
                                                     stage=s, mb=mb))

    def recv(self, buf, from_stage, s_tag, mb, grad):
        frm = self.plan.rank_of(from_stage, self.p)
        if frm == self.me:
            return self.local.pop((s_tag, mb, grad))
        name = f"recv {'grad' if grad else 'act'} {mb}"
        return self.wire.recv(buf, frm, _tag(s_tag, mb, grad, self.m), name, stage=from_stage, mb=mb)

    def forward(self, mb: int, s: int):
        """F: receive the input (stage 0: the batch), run the stage, keep what backward needs, send the output on."""
        st = self.stages[s]
        x = st.input(mb) if s == 0 else self.recv(st.input_like(mb), s - 1, s - 1, mb, False).requires_grad_(True)
        params = None
        if self.pipedream:
            use = vertical_version(self.pipedream, self.p, mb) if self.pipedream.vertical_sync else self.version[s]
            params = {k: v.clone().requires_grad_() for k, v in self.history[s][use].items()}
        with self.tracer.span("compute", f"F{mb}", kind="F", stage=s, mb=mb), self.saving((s, mb), (params or {}).values()):
            if self.recompute:  # keep only the stage input; the backward recomputes the rest
                with torch.no_grad():
                    out = st.forward(x, mb)
                if self.meter:
                    self.meter.keep((s, mb), x)
            else:
                out = st.forward(x, mb, params) if params else st.forward(x, mb)
        if st.last:
            self.loss_sum += out.item()
        self.saved[(s, mb)] = {"x": x, "out": out, "params": params}
        if self.pipedream:
            self.versions.append({"stage": s, "mb": mb, "forward_version": use})
        if not st.last:
            self.send(out, s + 1, s, mb, False)
        self.live += 1
        self.peak = max(self.peak, self.live)

    def backward(self, kind: str, mb: int, s: int):
        """B (whole backward) or I (input gradient only); the forward rerun first if only the input was kept."""
        st, sv = self.stages[s], self.saved[(s, mb)]
        grad_out = None if st.last else self.recv(torch.empty(sv["out"].shape, dtype=sv["out"].dtype), s + 1, s, mb, True)
        with self.tracer.span("compute", f"{kind}{mb}", kind=kind, stage=s, mb=mb):
            if self.recompute:  # GPipe's recomputation: the forward again, this time keeping the graph
                cpu_start = time.thread_time_ns()
                with self.saving((s, mb)):
                    sv["out"] = st.forward(sv["x"], mb)
                self.recompute_cpu_us.append((time.thread_time_ns() - cpu_start) / 1e3)
            if self.pipedream:
                _pipedream_backward(self.pipedream, st, sv, grad_out, s, mb, self.version, self.versions, self.grad_errors)
                self.history[s][self.version[s]] = {k: v.detach().clone() for k, v in st.module.named_parameters()}
            elif kind == "B":
                torch.autograd.backward(sv["out"], grad_out)
            elif s > 0:  # I: the input gradient, and what W needs kept
                _, sv["groups"] = self.backward_input([sv["out"]], None if grad_out is None else [grad_out],
                                                       [sv["x"]], st.module.parameters())
            else:  # the first stage has no input gradient: W runs its whole backward
                sv["grad_out"] = grad_out
        if s > 0:
            self.send(sv["x"].grad, s - 1, s - 1, mb, True)
        if kind == "B":
            self.live -= 1
            del self.saved[(s, mb)]
            if self.meter:
                self.meter.free((s, mb))

    def weight(self, mb: int, s: int):
        """W: the weight gradients from what I kept (the first stage: its whole backward); frees the micro-batch."""
        st, sv = self.stages[s], self.saved.pop((s, mb))
        with self.tracer.span("compute", f"W{mb}", kind="W", stage=s, mb=mb):
            if s > 0:
                self.backward_weight(st.module.parameters(), sv["groups"])
            else:
                torch.autograd.backward(sv["out"], sv["grad_out"])
        self.live -= 1
        if self.meter:
            self.meter.free((s, mb))

    def finish(self) -> dict:
        """Wait for the sends in flight; the walk's figures (the loss summed on the last stage, the bytes sent to other
        pipeline ranks, the peak of live activations and their timeline, PipeDream's weight versions and gradient
        errors, each recomputation's CPU time)."""
        for req in self.pending_sends:
            req.wait()
        return {"loss": self.loss_sum, "sent_bytes": self.wire.sent(), "peak_live": self.peak, "timeline": self.timeline,
                "versions": self.versions, "grad_errors": self.grad_errors, "recompute_cpu_us": self.recompute_cpu_us}


def vertical_version(config, p: int, mb: int) -> int:
    """PipeDream's vertical sync: every stage runs micro-batch mb on the weight version stage 0 had when it
    ran mb's forward (the number of backwards stage 0 had finished by then), known from stage 0's order."""
    done = 0
    for action in SCHEDULES[config.schedule].actions(p, config.microbatches)[0]:
        if action.kind == "F" and action.mb == mb:
            return done
        done += action.kind == "B"
    raise ValueError(f"micro-batch {mb} has no forward on stage 0")


def _pipedream_backward(config, st, sv, seed_grad, s, mb, version, versions, grad_errors):
    """Backward with the stashed weights (consistent) and, without stashing, with the current ones; SGD update."""
    def grads(out, weights: dict, x) -> tuple:  # the weights' gradients, and the input's (none on stage 0)
        got = torch.autograd.grad(out, [*weights.values(), *([x] if s > 0 else [])], seed_grad)
        return got[:len(weights)], (got[-1] if s > 0 else None)
    consistent, gx = grads(sv["out"], sv["params"], sv["x"])
    used = consistent
    if not config.weight_stashing:  # the forward again on the weights as they are now: PipeDream without stashing
        current = {k: v.detach().clone().requires_grad_() for k, v in st.module.named_parameters()}
        x = sv["x"].detach().requires_grad_(s > 0)
        used, gx = grads(st.forward(x, mb, current), current, x)
        error = torch.stack([torch.dist(a, b) for a, b in zip(used, consistent)]).norm()
        size = torch.stack([b.norm() for b in consistent]).norm()
        grad_errors.append({"stage": s, "mb": mb, "relative_error": float(error / size)})
    if s > 0:
        sv["x"].grad = gx
    record = next(v for v in versions if v["stage"] == s and v["mb"] == mb)
    record["backward_version"] = record["forward_version"] if config.weight_stashing else version[s]
    with torch.no_grad():
        for prm, g in zip(st.module.parameters(), used):
            prm -= config.lr * g
    version[s] += 1
