"""One executor for every schedule: each rank walks its action list on real gloo ranks.

Stage s is a stack of Linear+tanh layers (float64, seeded by s); stage s feeds s + 1, which lives on rank
(s + 1) % p. Forward activations and backward gradients travel by send/recv with a tag per
(stage, micro-batch, direction), so interleaved stages sharing a pair of ranks never cross. Every action
and every send/recv wait is a trace event; the live activations of each rank are counted as actions run.

Synchronous schedules accumulate gradients over the micro-batches (one step's worth). PipeDream instead
updates a stage's weights (SGD) after every backward; with weight stashing its backward uses the weights
its forward used, without it the current ones, and the executor measures how far that gradient is off.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.func import functional_call

from backend.parallel.pp.recompute import ActivationMeter, stage_flops
from backend.parallel.pp.schedules import SCHEDULES
from backend.trace import Tracer


def make_stage(stage: int, hidden: int, layers: int, seed: int) -> nn.Module:
    torch.manual_seed(seed * 1000 + stage)
    mods = []
    for _ in range(layers):
        mods += [nn.Linear(hidden, hidden, dtype=torch.float64), nn.Tanh()]
    return nn.Sequential(*mods)


def make_batch(config) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(config.seed + 12345)
    x = torch.randn(config.batch, config.hidden, generator=g, dtype=torch.float64)
    y = torch.randn(config.batch, config.hidden, generator=g, dtype=torch.float64)
    return x, y


def stage_layers(config, stage: int) -> int:
    """Layers in a stage: layers / (p·v), or (unequal_stages) the last stage twice as deep, to show the bottleneck."""
    per = config.layers // config.num_stages
    return per * (2 if config.unequal_stages and stage == config.num_stages - 1 else 1)


def _tag(stage: int, mb: int, grad: bool, m: int) -> int:
    return (stage * m + mb) * 2 + int(grad)


def run_rank(rank: int, p: int, config, ctx) -> dict:
    plan = SCHEDULES[config.schedule]
    S, m = config.num_stages, plan.microbatches(config.microbatches)
    tracer = Tracer(rank)
    stages = {s: make_stage(s, config.hidden, stage_layers(config, s), config.seed) for s in range(rank, S, p)}
    x_all, y_all = make_batch(config)
    xs, ys = x_all.chunk(m), y_all.chunk(m)
    for module in stages.values():  # warm up outside the measurement: the first weight-gradient GEMM of a
        for needs_input_grad in (False, True):  # process costs ~0.4 s of one-time library set-up on this CPU
            out = module(xs[0].clone().requires_grad_(needs_input_grad))
            out.backward(torch.randn_like(out))
        module.zero_grad(set_to_none=True)
    flops = {s: stage_flops(module, xs[0], s > 0) for s, module in stages.items()}  # one micro-batch, per stage
    meter, executed, recompute_cpu_us = ActivationMeter(), {s: {"F": 0, "R": 0, "B": 0} for s in stages}, []
    tracer.align(dist.barrier)
    scale = 1.0 / (config.batch * config.hidden)  # loss = mean squared error over the whole batch
    saved: dict[tuple[int, int], dict] = {}
    pending_sends, live, peak, timeline, versions = [], 0, 0, [], []
    version = {s: 0 for s in stages}
    history = {s: {0: {k: v.detach().clone() for k, v in mod.named_parameters()}} for s, mod in stages.items()}  # version -> weights
    grad_errors = []
    order = plan.actions(p, m, config.virtual_stages)[rank]
    for action in order:
        kind, mb, s = action
        module = stages[s]
        if kind == "F":
            if s == 0:
                x = xs[mb].clone()
            else:
                x = torch.empty(xs[mb].shape, dtype=torch.float64)
                with tracer.span("recv", f"recv act {mb}", stage=s, mb=mb):
                    dist.recv(x, (s - 1) % p, tag=_tag(s - 1, mb, False, m))
                x.requires_grad_(True)
            params = None
            if plan.asynchronous:
                use = vertical_version(config, p, mb) if config.vertical_sync else version[s]
                params = {k: v.clone() for k, v in history[s][use].items()}
            with tracer.span("compute", f"F{mb}", kind="F", stage=s, mb=mb), \
                    meter.saving((s, mb), [*module.parameters(), *(params or {}).values()]):
                if config.recompute:  # keep only the stage input; the backward recomputes the rest
                    with torch.no_grad():
                        out = module(x)
                    meter.keep((s, mb), x)
                else:
                    out = functional_call(module, {k: v.requires_grad_() for k, v in params.items()}, (x,)) if params else module(x)
                loss = ((out - ys[mb]) ** 2).sum() * scale if s == S - 1 else None
            executed[s]["F"] += 1
            saved[(s, mb)] = {"x": x, "out": out, "loss": loss, "params": params}
            if plan.asynchronous:
                versions.append({"stage": s, "mb": mb, "forward_version": use})
            if s < S - 1:
                pending_sends.append(dist.isend(out.detach().contiguous(), (s + 1) % p, tag=_tag(s, mb, False, m)))
            live += 1
            peak = max(peak, live)
        elif kind in ("B", "I"):
            st = saved[(s, mb)]
            grad_out = None
            if s < S - 1:
                grad_out = torch.empty(st["out"].shape, dtype=torch.float64)
                with tracer.span("recv", f"recv grad {mb}", stage=s, mb=mb):
                    dist.recv(grad_out, (s + 1) % p, tag=_tag(s, mb, True, m))
            with tracer.span("compute", f"{kind}{mb}", kind=kind, stage=s, mb=mb):
                if config.recompute:  # GPipe's recomputation: the forward again, this time keeping the graph
                    cpu_start = time.thread_time_ns()
                    with meter.saving((s, mb), module.parameters()):
                        st["out"] = module(st["x"])
                        if s == S - 1:
                            st["loss"] = ((st["out"] - ys[mb]) ** 2).sum() * scale
                    recompute_cpu_us.append((time.thread_time_ns() - cpu_start) / 1e3)
                    executed[s]["R"] += 1
                executed[s]["B"] += 1
                root, seed_grad = (st["loss"], None) if s == S - 1 else (st["out"], grad_out)
                if plan.asynchronous:
                    _pipedream_backward(config, module, st, root, seed_grad, s, mb, version, versions, grad_errors, ys, scale, S)
                    history[s][version[s]] = {k: v.detach().clone() for k, v in module.named_parameters()}
                elif kind == "B":
                    torch.autograd.backward(root, seed_grad)
                else:  # I: input gradient only; W later
                    if s > 0:
                        (gx,) = torch.autograd.grad(root, [st["x"]], seed_grad, retain_graph=True)
                        st["x"].grad = gx
                    st["root"], st["seed_grad"] = root, seed_grad
            if s > 0:
                pending_sends.append(dist.isend(st["x"].grad.contiguous(), (s - 1) % p, tag=_tag(s - 1, mb, True, m)))
            if kind == "B":
                live -= 1
                del saved[(s, mb)]
                meter.free((s, mb))
        elif kind == "W":
            st = saved.pop((s, mb))
            with tracer.span("compute", f"W{mb}", kind="W", stage=s, mb=mb):
                params = list(module.parameters())
                grads = torch.autograd.grad(st["root"], params, st["seed_grad"])
                for prm, gr in zip(params, grads):
                    prm.grad = gr if prm.grad is None else prm.grad + gr
            live -= 1
            meter.free((s, mb))
        timeline.append({"t_us": tracer.now_us(), "live": live})
    for req in pending_sends:
        req.wait()
    dist.barrier()
    if rank == 0:
        ctx.progress(0.8, "gathering gradients")
    # numpy, not tensors: a tensor crosses processes by a shared-memory handle that dies with its rank
    grads = {s: [prm.grad.numpy().copy() if prm.grad is not None else None for prm in mod.parameters()] for s, mod in stages.items()}
    return {"rank": rank, "trace": tracer.payload(), "peak_live": peak, "timeline": timeline, "grads": grads,
            "order": [str(a) for a in order], "versions": versions, "grad_errors": grad_errors,
            "activation_peak_bytes": meter.peak, "executed": executed, "flops": flops, "recompute_cpu_us": recompute_cpu_us}


def vertical_version(config, p: int, mb: int) -> int:
    """PipeDream's vertical sync: every stage runs micro-batch mb on the weight version stage 0 had when it
    ran mb's forward (the number of backwards stage 0 had finished by then), known from stage 0's order."""
    done = 0
    for action in SCHEDULES[config.schedule].actions(p, config.microbatches)[0]:
        if action.kind == "F" and action.mb == mb:
            return done
        done += action.kind == "B"
    raise ValueError(f"micro-batch {mb} has no forward on stage 0")


def _pipedream_backward(config, module, st, root, seed_grad, s, mb, version, versions, grad_errors, ys, scale, S):
    """Backward with the stashed weights (consistent) and, without stashing, with the current ones; SGD update."""
    names = [k for k, _ in module.named_parameters()]
    stashed = st["params"]
    consistent = torch.autograd.grad(root, [stashed[k] for k in names] + ([st["x"]] if s > 0 else []), seed_grad)
    g_consistent, gx = consistent[:len(names)], (consistent[-1] if s > 0 else None)
    used = g_consistent
    if not config.weight_stashing:  # recompute the forward on the weights as they are now: what PipeDream without stashing does
        current = {k: v.detach().clone().requires_grad_() for k, v in module.named_parameters()}
        x = st["x"].detach().requires_grad_(s > 0)
        out = functional_call(module, current, (x,))
        root2 = ((out - ys[mb]) ** 2).sum() * scale if s == S - 1 else out
        res = torch.autograd.grad(root2, [current[k] for k in names] + ([x] if s > 0 else []), seed_grad)
        used, gx = res[:len(names)], (res[-1] if s > 0 else None)
        num = sum(((a - b) ** 2).sum() for a, b in zip(used, g_consistent)) ** 0.5
        den = sum((b ** 2).sum() for b in g_consistent) ** 0.5
        grad_errors.append({"stage": s, "mb": mb, "relative_error": float(num / den)})
    if s > 0:
        st["x"].grad = gx
    forward_version = next(v["forward_version"] for v in versions if v["stage"] == s and v["mb"] == mb)
    b_version = forward_version if config.weight_stashing else version[s]
    for v in versions:
        if v["stage"] == s and v["mb"] == mb:
            v["backward_version"] = b_version
    with torch.no_grad():
        for prm, g in zip(module.parameters(), used):
            prm -= config.lr * g
    version[s] += 1
