"""Our DDP: per-parameter gradient hooks, buckets in reverse parameter order, and an asynchronous all-reduce
launched as soon as a bucket's gradients are all ready, overlapping the rest of the backward (seed 000).
Torch's DistributedDataParallel trains the same workload as the peer (`TorchDDP`).

Per-rank volume: a ring all-reduce sends 2ψ(n-1)/n. gloo chooses its own algorithm inside all_reduce, so
the bytes reported are the logical volume of the ring algorithm, labelled as such.
"""
from __future__ import annotations

import queue
import threading
import time

import torch
import torch.distributed as dist

from backend.parallel.loop import Strategy
from backend.parallel.workload import Adam, flat_params, load_flat


def make_buckets(params: list[torch.nn.Parameter], bucket_bytes: int, item: int | None = None) -> list[list[torch.nn.Parameter]]:
    """Reverse parameter order (the output layer's gradients are ready first), cut when a bucket reaches bucket_bytes
    (`item`: bytes per gradient element on the wire, when they are reduced in another dtype than the parameters')."""
    buckets, current, size = [], [], 0
    for p in reversed(params):
        current.append(p)
        size += p.numel() * (item or p.element_size())
        if size >= bucket_bytes:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets


class FullReplica(Strategy):
    """Every rank holds the whole model and the whole Adam state; gradients are summed before the update."""

    def setup(self, model):
        super().setup(model)
        self.params = list(self.model.parameters())
        self.flat = flat_params(self.model)
        self.m, self.v, self.adam = torch.zeros_like(self.flat), torch.zeros_like(self.flat), Adam(self.workload.lr)

    def before_forward(self, step):
        load_flat(self.model, self.flat)

    def optimizer_step(self, step):
        self.adam.update(self.flat, torch.cat([p.grad.reshape(-1) for p in self.params]), self.m, self.v)

    def memory(self):
        n, item = self.flat.numel(), self.flat.element_size()
        return {"parameters": n * item, "gradients": n * item, "optimizer states": 2 * n * item}

    def final_params(self):
        return self.flat

    def checkpoint_state(self):
        from backend.parallel.checkpoint import param_ranges, replicated

        state = replicated(param_ranges(self.model), {"param": self.flat, "exp_avg": self.m, "exp_avg_sq": self.v})
        return {**state, "optim.step": torch.tensor(self.adam.step)}

    def load_checkpoint_state(self, state):
        self.adam.step = int(state["optim.step"])


class DDP(FullReplica):
    name = "ddp"

    def __init__(self, *args, bucket_kb: int = 25, overlap: bool = True, comm_delay_ms: int = 0, **kw):
        super().__init__(*args, **kw)
        self.bucket_bytes, self.overlap, self.comm_delay_ms = bucket_kb * 1024, overlap, comm_delay_ms
        self.logical_sent = 0

    def setup(self, model):
        super().setup(model)
        self.buckets = make_buckets(self.params, self.bucket_bytes)
        self.bucket_of = {id(p): i for i, b in enumerate(self.buckets) for p in b}
        self.ready, self.pending = [0] * len(self.buckets), []
        self.link = SlowLink(self.comm_delay_ms, self.mesh.group("dp")) if self.comm_delay_ms else None
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._on_grad)

    def _on_grad(self, p):
        i = self.bucket_of[id(p)]
        self.ready[i] += 1
        if self.overlap and self.ready[i] == len(self.buckets[i]):
            self._launch(i)

    def _launch(self, i):
        grads = torch.cat([p.grad.reshape(-1) for p in self.buckets[i]])
        work = self.link.all_reduce(grads) if self.link else dist.all_reduce(grads, group=self.mesh.group("dp"), async_op=True)
        self.pending.append((i, grads, work, self.tracer.now_us()))

    def before_forward(self, step):
        super().before_forward(step)
        self.ready = [0] * len(self.buckets)

    def after_backward(self, step):
        if not self.overlap:
            for i in range(len(self.buckets)):
                self._launch(i)
        for i, grads, work, launched in self.pending:
            work.wait()
            nbytes = grads.numel() * grads.element_size()
            self.tracer.events.append({"name": f"all-reduce bucket {i}", "lane": "collective", "rank": self.mesh.rank,
                                       "ts": launched, "dur": self.tracer.now_us() - launched,
                                       "args": {"bytes": nbytes, "kind": "collective", "note": "launch to observed completion"}})
            self.logical_sent += 2 * (self.world - 1) * nbytes // self.world
            offset = 0
            for p in self.buckets[i]:
                p.grad.copy_(grads[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
        self.pending.clear()

    def sent_bytes(self):
        return self.logical_sent

    def final_params(self):
        if self.link:
            self.link.close()
        return self.flat

    def extra(self):
        return {"buckets": [sum(p.numel() for p in b) for b in self.buckets]}


class TorchDDP(FullReplica):
    """torch's DistributedDataParallel on the same workload (the peer); it averages gradients, so the loss is scaled by n."""
    name = "torch ddp"

    def __init__(self, *args, bucket_kb: int = 25, **kw):
        super().__init__(*args, **kw)
        self.bucket_kb = bucket_kb

    @property
    def loss_multiplier(self):
        return self.world

    def setup(self, model):
        from torch.nn.parallel import DistributedDataParallel

        super().setup(model)
        self.ddp = DistributedDataParallel(self.model, bucket_cap_mb=self.bucket_kb / 1024, process_group=self.mesh.group("dp"))

    def forward(self, x):
        return self.ddp(x)  # the wrapper's hooks all-reduce during backward


def torch_ddp_peer(config, rank: int, world: int) -> dict:
    """torch's DistributedDataParallel training the tiny LLaMA of a dp-only mesh plan (`config`, a MeshConfig) in float64:
    this rank's slice of the global batch (tensor_split over the ranks, as the mesh cuts it), torch.optim.Adam, the
    reference's initial weights. DDP averages the gradients over the ranks, so the local mean loss is weighted by the
    slice's share of the batch times the rank count. Returns the final weights by state_dict name (float64 arrays)."""
    from torch.nn.parallel import DistributedDataParallel

    from backend.parallel.tp_model import reference_model, tokens

    class Loss(torch.nn.Module):  # DDP's reducer syncs only a backward that followed a forward through the wrapper
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, batch):
            return self.model.loss(batch)

    model = reference_model(config)
    ddp = DistributedDataParallel(Loss(model), bucket_cap_mb=config.bucket_kb / 1024)
    opt = torch.optim.Adam(model.parameters(), lr=config.lr, foreach=False)
    mine = tokens(config).tensor_split(world)[rank]
    for _ in range(config.steps):
        opt.zero_grad()
        (ddp(mine) * (mine.shape[0] / config.batch * world)).backward()
        opt.step()
    return {k: v.detach().double().numpy().copy() for k, v in model.state_dict().items()}


class SlowLink:
    """Simulated slow network: one background thread per rank runs the bucket all-reduces in launch order (so every
    rank issues them in the same order), each after `delay_ms` of pretend wire time."""

    def __init__(self, delay_ms: int, group=None):
        self.delay_s, self.group, self.jobs = delay_ms / 1000, group, queue.Queue()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        while (job := self.jobs.get()) is not None:
            tensor, done = job
            time.sleep(self.delay_s)
            dist.all_reduce(tensor, group=self.group)
            done.set()

    def all_reduce(self, tensor):
        done = threading.Event()
        self.jobs.put((tensor, done))
        return _Done(done)

    def close(self):
        self.jobs.put(None)
        self.thread.join()


class _Done:
    def __init__(self, event):
        self.event = event

    def wait(self):
        self.event.wait()
