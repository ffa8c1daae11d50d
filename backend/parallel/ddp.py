"""Our DDP: per-parameter gradient hooks, buckets in reverse parameter order, and an asynchronous all-reduce
launched as soon as a bucket's gradients are all ready, overlapping the rest of the backward (seed 000).
Torch's DistributedDataParallel trains the same workload as the peer.

Per-rank volume: a ring all-reduce sends 2ψ(n-1)/n. gloo chooses its own algorithm inside all_reduce, so
the bytes reported are the logical volume of the ring algorithm, labelled as such.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from backend.parallel.workload import Adam, activation_bytes, batch, flat_params, load_flat, local_slice, loss_fn, make_model
from backend.trace import Tracer


def make_buckets(params: list[torch.nn.Parameter], bucket_bytes: int) -> list[list[torch.nn.Parameter]]:
    """Reverse parameter order (the output layer's gradients are ready first), cut when a bucket reaches bucket_bytes."""
    buckets, current, size = [], [], 0
    for p in reversed(params):
        current.append(p)
        size += p.numel() * p.element_size()
        if size >= bucket_bytes:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets


def run_rank(rank: int, world: int, config, ctx) -> dict:
    tracer = Tracer(rank)
    tracer.align(dist.barrier)
    model = make_model(config.hidden, config.layers, config.seed)
    params = list(model.parameters())
    buckets = make_buckets(params, config.bucket_kb * 1024)
    bucket_of = {id(p): i for i, b in enumerate(buckets) for p in b}
    flat = flat_params(model)
    m, v, adam = torch.zeros_like(flat), torch.zeros_like(flat), Adam(config.lr)
    pending, ready, logical_sent = [], [0] * len(buckets), 0
    slow_link = SlowLink(config.comm_delay_ms) if config.comm_delay_ms else None

    def launch(i):
        grads = torch.cat([p.grad.reshape(-1) for p in buckets[i]])
        work = slow_link.all_reduce(grads) if slow_link else dist.all_reduce(grads, async_op=True)
        pending.append((i, grads, work, tracer.now_us()))

    def on_grad(p):
        i = bucket_of[id(p)]
        ready[i] += 1
        if config.overlap and ready[i] == len(buckets[i]):
            launch(i)

    for p in params:
        p.register_post_accumulate_grad_hook(on_grad)
    losses, memory = [], {}
    for step in range(config.steps):
        load_flat(model, flat)
        x, y = batch(config, step)
        xs, ys = local_slice(config, rank, world, x), local_slice(config, rank, world, y)
        model.zero_grad(set_to_none=True)
        ready[:] = [0] * len(buckets)
        with tracer.span("compute", f"forward {step}"):
            out, act = activation_bytes(lambda: model(xs))
            loss = loss_fn(config, out, ys)
        with tracer.span("compute", f"backward {step}"):
            loss.backward()
        if not config.overlap:
            for i in range(len(buckets)):
                launch(i)
        for i, grads, work, launched in pending:
            work.wait()
            tracer.events.append({"name": f"all-reduce bucket {i}", "lane": "collective", "rank": rank, "ts": launched,
                                  "dur": tracer.now_us() - launched, "args": {"bytes": grads.numel() * grads.element_size(),
                                                                              "note": "launch to observed completion"}})
            logical_sent += 2 * (world - 1) * grads.numel() * grads.element_size() // world
            offset = 0
            for p in buckets[i]:
                p.grad.copy_(grads[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
        pending.clear()
        with tracer.span("compute", f"adam {step}"):
            adam.update(flat, torch.cat([p.grad.reshape(-1) for p in params]), m, v)
        total = torch.tensor([loss.item()], dtype=torch.float64)
        dist.all_reduce(total)
        losses.append(total.item())
        if step == 0:
            item = flat.element_size()
            memory = {"parameters": flat.numel() * item, "gradients": flat.numel() * item,
                      "optimizer states": 2 * flat.numel() * item, "activations": act}
        if rank == 0:
            ctx.progress((step + 1) / config.steps, f"step {step + 1}")
    if slow_link:
        slow_link.close()
    peer = torch_ddp_peer(rank, world, config)
    return {"rank": rank, "losses": losses, "params": flat.numpy().copy(), "memory": memory, "sent": logical_sent,
            "psi_bytes": flat.numel() * flat.element_size(), "buckets": [sum(p.numel() for p in b) for b in buckets],
            "trace": tracer.payload(), "peer_params": peer}


class SlowLink:
    """Simulated slow network: one background thread per rank runs the bucket all-reduces in launch order (so every
    rank issues them in the same order), each after `delay_ms` of pretend wire time."""

    def __init__(self, delay_ms: int):
        import queue
        import threading

        self.delay_s, self.jobs = delay_ms / 1000, queue.Queue()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        while (job := self.jobs.get()) is not None:
            tensor, done = job
            time.sleep(self.delay_s)
            dist.all_reduce(tensor)
            done.set()

    def all_reduce(self, tensor):
        import threading

        done = threading.Event()
        self.jobs.put((tensor, done))

        class Work:
            def wait(self_inner):
                done.wait()
        return Work()

    def close(self):
        self.jobs.put(None)
        self.thread.join()


def torch_ddp_peer(rank: int, world: int, config):
    """torch's DistributedDataParallel on the same workload; DDP averages gradients, so the local loss is scaled by n."""
    from torch.nn.parallel import DistributedDataParallel

    model = make_model(config.hidden, config.layers, config.seed)
    ddp = DistributedDataParallel(model, bucket_cap_mb=config.bucket_kb / 1024)
    flat = flat_params(model)
    m, v, adam = torch.zeros_like(flat), torch.zeros_like(flat), Adam(config.lr)
    for step in range(config.steps):
        load_flat(model, flat)
        x, y = batch(config, step)
        xs, ys = local_slice(config, rank, world, x), local_slice(config, rank, world, y)
        ddp.zero_grad(set_to_none=True)
        (loss_fn(config, ddp(xs), ys) * world).backward()
        adam.update(flat, torch.cat([p.grad.reshape(-1) for p in model.parameters()]), m, v)
    return flat.numpy().copy()
