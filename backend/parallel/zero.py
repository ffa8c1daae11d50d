"""ZeRO stages 1, 2 and 3 on gloo ranks, with Adam, communicating through our own ring collectives
(backend/comm/collectives.py) so every byte moved is counted.

Parameters are laid out flat and cut into segments (stages 1 and 2: one segment, the whole model; stage 3:
one per layer, as FSDP wraps each layer). Each segment is padded to a multiple of n and split into n equal
shards; rank r owns shard r of every segment, and Adam's m and v only for those elements.
  stage 1: full parameters and full gradients on every rank. After backward: reduce-scatter the gradients,
           update the owned shard, all-gather the parameters.
  stage 2: as 1, but a rank keeps only its gradient shard after the reduce-scatter.
  stage 3: parameters sharded too: a layer's parameters are all-gathered just before its forward and again
           before its backward, then freed; its gradients are reduce-scattered as soon as they exist.
Per-rank volume sent (seed 000: 2ψ, 2ψ, 3ψ): 2ψ(n-1)/n, 2ψ(n-1)/n, 3ψ(n-1)/n, ψ the padded parameter bytes.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from backend.comm.collectives import Spec, all_gather_ring, reduce_scatter_ring
from backend.comm.p2p import P2P
from backend.parallel.workload import Adam, activation_bytes, batch, flat_params, load_flat, local_slice, loss_fn, make_model
from backend.trace import Tracer


def _padded(numel: int, n: int) -> int:
    return -(-numel // n) * n


def segments(config, numel: int) -> list[tuple[int, int]]:
    if config.stage < 3:
        return [(0, numel)]
    size = config.hidden * config.hidden + config.hidden  # one Linear: weight, then bias
    return [(i * size, (i + 1) * size) for i in range(config.layers)]


class Sharded:
    """The rank's shard of each segment, and the ring collectives over one segment."""

    def __init__(self, config, flat: torch.Tensor, rank: int, world: int, comm: P2P):
        self.rank, self.world, self.comm = rank, world, comm
        self.segs = segments(config, flat.numel())
        self.pads = [_padded(b - a, world) for a, b in self.segs]
        parts = []
        for (a, b), pad in zip(self.segs, self.pads):
            padded = torch.zeros(pad, dtype=flat.dtype)
            padded[:b - a] = flat[a:b]
            parts.append(padded.tensor_split(world)[rank].clone())
        self.shards = parts

    @property
    def psi_elements(self) -> int:
        return sum(self.pads)

    def gather(self, i: int) -> torch.Tensor:
        a, b = self.segs[i]
        return all_gather_ring(self.comm, self.shards[i], Spec("all_gather", self.shards[i].numel()))[:b - a]

    def reduce_scatter(self, i: int, grad: torch.Tensor) -> torch.Tensor:
        padded = torch.zeros(self.pads[i], dtype=grad.dtype)
        padded[:grad.numel()] = grad
        return reduce_scatter_ring(self.comm, padded, Spec("reduce_scatter", self.pads[i]))


def run_rank(rank: int, world: int, config, ctx) -> dict:
    if getattr(config, "precision", "fp64") == "bf16_mixed":
        return run_rank_mixed(rank, world, config, ctx)
    tracer = Tracer(rank)
    tracer.align(dist.barrier)
    comm = P2P(rank, world, tracer)
    model = make_model(config.hidden, config.layers, config.seed)
    flat = flat_params(model)
    numel, item = flat.numel(), flat.element_size()
    sh = Sharded(config, flat, rank, world, comm)
    m = [torch.zeros_like(s) for s in sh.shards]
    v = [torch.zeros_like(s) for s in sh.shards]
    adams = [Adam(config.lr) for _ in sh.shards]
    losses, memory = [], {}
    for step in range(config.steps):
        x, y = batch(config, step)
        xs, ys = local_slice(config, rank, world, x), local_slice(config, rank, world, y)
        if config.stage < 3:
            load_flat(model, flat)
            with tracer.span("compute", f"forward {step}"):
                out, act = activation_bytes(lambda: model(xs))
                loss = loss_fn(config, out, ys)
            model.zero_grad(set_to_none=True)
            with tracer.span("compute", f"backward {step}"):
                loss.backward()
            grad = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
            with tracer.span("collective", f"reduce-scatter grads {step}"):
                grad_shards = [sh.reduce_scatter(0, grad)]
            grads_held = numel if config.stage == 1 else grad_shards[0].numel()
            if config.stage == 2:
                model.zero_grad(set_to_none=True)  # stage 2 keeps only its shard of the gradients
        else:
            loss, act, grad_shards = _stage3_step(config, sh, tracer, xs, ys, step)
            grads_held = sum(g.numel() for g in grad_shards)
        with tracer.span("compute", f"adam {step}"):
            for shard, g, mi, vi, adam in zip(sh.shards, grad_shards, m, v, adams):
                adam.update(shard, g, mi, vi)
        if config.stage < 3:
            with tracer.span("collective", f"all-gather params {step}"):
                flat = sh.gather(0)
        total = torch.tensor([loss.item()], dtype=torch.float64)
        dist.all_reduce(total)
        losses.append(total.item())
        if step == 0:
            owned = sum(s.numel() for s in sh.shards)
            largest = max(b - a for a, b in sh.segs)
            memory = {"parameters": (numel if config.stage < 3 else owned + largest) * item,
                      "gradients": grads_held * item, "optimizer states": 2 * owned * item, "activations": act}
        if rank == 0:
            ctx.progress((step + 1) / config.steps, f"step {step + 1}")
    sent, recv = comm.bytes_sent, comm.bytes_recv
    final = flat if config.stage < 3 else torch.cat([sh.gather(i) for i in range(len(sh.segs))])
    return {"rank": rank, "losses": losses, "params": final.numpy().copy(), "memory": memory, "sent": sent, "recv": recv,
            "psi_bytes": sh.psi_elements * item, "param_bytes": numel * item, "trace": tracer.payload()}


def _stage3_step(config, sh: Sharded, tracer, xs, ys, step):
    """Forward and backward one layer at a time on parameters gathered from the shards, then freed."""
    h_dim = config.hidden

    def layer(i):
        with tracer.span("collective", f"all-gather layer {i}"):
            w = sh.gather(i)
        return w[:h_dim * h_dim].view(h_dim, h_dim), w[h_dim * h_dim:]

    acts = []
    with tracer.span("compute", f"forward {step}"):
        h = xs
        for i in range(config.layers):
            weight, bias = layer(i)
            acts.append(h)
            h = torch.tanh(F.linear(h, weight, bias))
            del weight, bias  # freed: only the shard stays resident
        loss = loss_fn(config, h, ys)
    grad_shards = [None] * config.layers
    saved = 0
    with tracer.span("compute", f"backward {step}"):
        g = 2 * (h - ys) / (config.batch * config.hidden)
        for i in reversed(range(config.layers)):
            weight, bias = (t.clone().requires_grad_() for t in layer(i))
            inp = acts[i].clone().requires_grad_()
            out, act = activation_bytes(lambda: torch.tanh(F.linear(inp, weight, bias)))
            saved += act
            g, gw, gb = torch.autograd.grad(out, [inp, weight, bias], g)
            with tracer.span("collective", f"reduce-scatter layer {i}"):
                grad_shards[i] = sh.reduce_scatter(i, torch.cat([gw.reshape(-1), gb]))
    return loss, saved, grad_shards


def run_rank_mixed(rank: int, world: int, config, ctx) -> dict:
    """bf16 mixed precision (seed 000's (2 + 2 + K)ψ, K = 12): bf16 parameters and gradients for compute, an fp32
    master copy and Adam's m and v for the owned shard only; gradients are reduce-scattered in fp32 (as FSDP's
    MixedPrecision(reduce_dtype=float32) does) and parameters all-gathered in bf16. Stages 1 and 2."""
    tracer = Tracer(rank)
    tracer.align(dist.barrier)
    comm = P2P(rank, world, tracer)
    model = make_model(config.hidden, config.layers, config.seed).to(torch.bfloat16)
    master_full = flat_params(make_model(config.hidden, config.layers, config.seed)).float()
    numel = master_full.numel()
    sh = Sharded(config, master_full, rank, world, comm)  # fp32 master shard
    master = sh.shards[0]
    m, v, adam = torch.zeros_like(master), torch.zeros_like(master), Adam(config.lr)
    flat16 = master_full.bfloat16()
    losses, memory = [], {}
    for step in range(config.steps):
        x, y = batch(config, step)
        xs, ys = local_slice(config, rank, world, x), local_slice(config, rank, world, y)
        load_flat(model, flat16)
        with tracer.span("compute", f"forward {step}"):
            out, act = activation_bytes(lambda: model(xs.bfloat16()))
            loss = loss_fn(config, out.float(), ys.float())
        model.zero_grad(set_to_none=True)
        with tracer.span("compute", f"backward {step}"):
            loss.backward()
        grad16 = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        with tracer.span("collective", f"reduce-scatter fp32 grads {step}"):  # bf16 grads, reduced in fp32
            padded = torch.zeros(sh.pads[0], dtype=torch.float32)
            padded[:numel] = grad16
            grad_shard = reduce_scatter_ring(comm, padded, Spec("reduce_scatter", sh.pads[0]))
        if config.stage == 2:
            model.zero_grad(set_to_none=True)
        with tracer.span("compute", f"adam on the fp32 master {step}"):
            adam.update(master, grad_shard.float(), m, v)
        with tracer.span("collective", f"all-gather bf16 params {step}"):
            flat16 = all_gather_ring(comm, master.bfloat16(), Spec("all_gather", master.numel()))[:numel]
        total = torch.tensor([loss.item()], dtype=torch.float64)
        dist.all_reduce(total)
        losses.append(total.item())
        if step == 0:
            memory = {"parameters": numel * 2, "gradients": numel * 2 if config.stage == 1 else grad_shard.numel() * grad_shard.element_size(),
                      "optimizer states": 3 * master.numel() * 4, "activations": act}
        if rank == 0:
            ctx.progress((step + 1) / config.steps, f"step {step + 1}")
    final = all_gather_ring(comm, master, Spec("all_gather", master.numel()))[:numel]
    sent_allgather_fp32 = master.numel() * 4 * (world - 1)  # the final fp32 gather is reporting, not training
    return {"rank": rank, "losses": losses, "params": final.double().numpy().copy(), "memory": memory,
            "sent": comm.bytes_sent - sent_allgather_fp32, "recv": comm.bytes_recv - sent_allgather_fp32,
            "psi_bytes": sh.psi_elements * 2, "param_bytes": numel * 2, "trace": tracer.payload(), "precision": "bf16_mixed"}
