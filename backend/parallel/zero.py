"""ZeRO stages 1, 2 and 3 on gloo ranks, with Adam, communicating through our own ring collectives
(backend/comm/collectives.py) so every byte moved is counted.

Parameters are laid out flat and cut into segments (stages 1 and 2: one segment, the whole model; stage 3:
one per layer, as FSDP wraps each layer). Each segment is padded to a multiple of n and split into n equal
shards; rank r owns shard r of every segment, and Adam's m and v (and, in mixed precision, the fp32 master
weights) only for those elements.
  stage 1: full parameters and full gradients on every rank. After backward: reduce-scatter the gradients,
           update the owned shard, all-gather the parameters.
  stage 2: as 1, but a rank keeps only its gradient shard after the reduce-scatter.
  stage 3: parameters sharded too: a layer's parameters are all-gathered just before its forward and again
           before its backward, then freed; its gradients are reduce-scattered as soon as they exist.
Per-rank volume sent (seed 000: 2ψ, 2ψ, 3ψ): gradients reduce-scattered in the reduce dtype, parameters
all-gathered in the compute dtype, (n-1)/n of the padded vector each time.
`Sharded` is the mesh's too (mesh_dp.DataParallel, where ZeRO-Offload lives); the `ZeRO` Strategy of loop.py stays for
parallel.checkpoint's MLP runs.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from backend.comm.collectives import Spec, all_gather_ring, reduce_scatter_ring
from backend.comm.p2p import P2P
from backend.parallel.loop import Strategy
from backend.parallel.workload import Adam, activation_bytes, flat_params, load_flat, loss_fn


def padded(numel: int, n: int) -> int:
    return -(-numel // n) * n


class Sharded:
    """The rank's shard of each segment of a flat vector, and the ring collectives over one segment."""

    def __init__(self, segments: list[tuple[int, int]], flat: torch.Tensor, rank: int, world: int, comm: P2P):
        self.rank, self.world, self.comm, self.segs = rank, world, comm, segments
        self.pads = [padded(b - a, world) for a, b in segments]
        self.shards = []
        for (a, b), pad in zip(segments, self.pads):
            full = torch.zeros(pad, dtype=flat.dtype)
            full[:b - a] = flat[a:b]
            self.shards.append(full.tensor_split(world)[rank].clone())

    @property
    def psi_elements(self) -> int:
        return sum(self.pads)

    def gather(self, i: int, dtype: torch.dtype, shard: torch.Tensor | None = None) -> torch.Tensor:
        """All-gather segment i in `dtype`, from this rank's shard (or from `shard`, a copy of it held elsewhere)."""
        a, b = self.segs[i]
        shard = (self.shards[i] if shard is None else shard).to(dtype)
        return all_gather_ring(self.comm, shard, Spec("all_gather", shard.numel()))[:b - a]

    def reduce_scatter(self, i: int, grad: torch.Tensor) -> torch.Tensor:
        full = torch.zeros(self.pads[i], dtype=grad.dtype)
        full[:grad.numel()] = grad
        return reduce_scatter_ring(self.comm, full, Spec("reduce_scatter", self.pads[i]))


class ZeRO(Strategy):
    def __init__(self, *args, stage: int = 1, **kw):
        super().__init__(*args, **kw)
        self.stage, self.name = stage, f"zero{stage}"

    def setup(self, model):
        p = self.precision
        master = flat_params(model).to(p.master)
        super().setup(model)
        self.numel = master.numel()
        h = self.workload.hidden
        layer = h * h + h  # one Linear: weight, then bias
        segments = [(0, self.numel)] if self.stage < 3 else [(i * layer, (i + 1) * layer) for i in range(self.workload.layers)]
        self.comm = P2P(self.rank, self.world, self.tracer, ranks=self.mesh.ranks("dp"))
        self.sh = Sharded(segments, master, self.rank, self.world, self.comm)
        self.m = [torch.zeros_like(s) for s in self.sh.shards]
        self.v = [torch.zeros_like(s) for s in self.sh.shards]
        self.adams = [Adam(self.workload.lr) for _ in self.sh.shards]
        self.flat = master.to(p.compute)  # stages 1 and 2 hold the full parameters in the compute dtype

    def before_forward(self, step):
        if self.stage < 3:
            load_flat(self.model, self.flat)

    def forward_backward(self, xs, ys, step):
        if self.stage < 3:
            return super().forward_backward(xs, ys, step)
        return self._layer_by_layer(xs, ys, step)

    def after_backward(self, step):
        if self.stage == 3:
            return  # each layer's gradient was reduce-scattered inside the backward
        grad = torch.cat([p.grad.reshape(-1) for p in self.model.parameters()]).to(self.precision.reduce)
        with self.tracer.span("collective", f"reduce-scatter grads {step}", kind="collective"):
            self.grad_shards = [self.sh.reduce_scatter(0, grad)]
        if self.stage == 2:
            self.model.zero_grad(set_to_none=True)  # stage 2 keeps only its shard of the gradients

    def optimizer_step(self, step):
        for shard, g, m, v, adam in zip(self.sh.shards, self.grad_shards, self.m, self.v, self.adams):
            adam.update(shard, g.to(self.precision.master), m, v)
        if self.stage < 3:
            with self.tracer.span("collective", f"all-gather params {step}", kind="collective"):
                self.flat = self.sh.gather(0, self.precision.compute)

    def _layer_by_layer(self, xs, ys, step):
        """Stage 3: forward and backward one layer at a time on parameters gathered from the shards, then freed."""
        h, compute = self.workload.hidden, self.precision.compute

        def layer(i):
            with self.tracer.span("collective", f"all-gather layer {i}", kind="collective"):
                w = self.sh.gather(i, compute)
            return w[:h * h].view(h, h), w[h * h:]

        acts = []
        with self.tracer.span("compute", f"forward {step}", kind="forward"):
            x = xs.to(compute)
            for i in range(self.workload.layers):
                weight, bias = layer(i)
                acts.append(x)
                x = torch.tanh(F.linear(x, weight, bias))
                del weight, bias  # freed: only the shard stays resident
            loss = loss_fn(self.workload, x, ys)
        self.grad_shards, saved = [None] * self.workload.layers, 0
        with self.tracer.span("compute", f"backward {step}", kind="backward"):
            g = 2 * (x - ys) / (self.workload.batch * h)
            for i in reversed(range(self.workload.layers)):
                weight, bias = (t.clone().requires_grad_() for t in layer(i))
                inp = acts[i].clone().requires_grad_()
                out, act = activation_bytes(lambda: torch.tanh(F.linear(inp, weight, bias)))
                saved += act
                g, gw, gb = torch.autograd.grad(out, [inp, weight, bias], g)
                with self.tracer.span("collective", f"reduce-scatter layer {i}", kind="collective"):
                    self.grad_shards[i] = self.sh.reduce_scatter(i, torch.cat([gw.reshape(-1), gb]).to(self.precision.reduce))
        return loss, saved

    def memory(self):
        p, owned = self.precision, sum(s.numel() for s in self.sh.shards)
        largest = max(b - a for a, b in self.sh.segs)
        params = self.numel if self.stage < 3 else owned + largest
        grads = self.numel * p.item("compute") if self.stage == 1 else sum(g.numel() for g in self.grad_shards) * p.item("reduce")
        master_copy = owned if p.mixed else 0  # the fp32 master weights exist apart from the compute copy only when mixed
        return {"parameters": params * p.item("compute"), "gradients": grads,
                "optimizer states": (2 * owned + master_copy) * p.item("master")}

    def sent_bytes(self):
        return self.comm.bytes_sent

    def psi_bytes(self):
        return self.sh.psi_elements * self.precision.item("compute")

    def final_params(self):
        return torch.cat([self.sh.gather(i, self.precision.master) for i in range(len(self.sh.segs))])
