"""Our DDP: per-parameter gradient hooks, buckets in reverse parameter order, and a ring all-reduce started as soon
as a bucket's gradients are all ready, overlapping the rest of the backward (seed 000; the hooks and the communication
thread are mesh_dp.BucketOverlap's, shared with the mesh). Torch's DistributedDataParallel is the peer:
`torch_ddp_peer` on the tiny LLaMA. (`DDP`, the Strategy of loop.py, stays for parallel.checkpoint's MLP runs.)

Per-rank volume: a ring all-reduce of a bucket padded to P elements (a multiple of n) sends 2P(n-1)/n, counted on our
Wire's send/recv.
"""
from __future__ import annotations

import torch

from backend.parallel.loop import Strategy
from backend.parallel.mesh_dp import BucketOverlap, bucket_ranges
from backend.parallel.wire import Wire
from backend.parallel.workload import Adam, flat_params, load_flat
from backend.trace import Tracer


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


class DDP(FullReplica):
    """The MLP loop's DDP: mesh_dp.BucketOverlap's hooks and buckets (the mesh's DDP) over this loop's dp ranks, each
    bucket's ring all-reduce on our Wire (every byte counted), during the backward or (`overlap` off) after it."""
    name = "ddp"

    def __init__(self, *args, bucket_kb: int = 25, overlap: bool = True, **kw):
        super().__init__(*args, **kw)
        self.bucket_bytes, self.overlap = bucket_kb * 1024, overlap

    def setup(self, model):
        super().setup(model)
        self.buckets = bucket_ranges(self.params, self.bucket_bytes, self.flat.element_size())
        wire = Wire(self.rank, self.world, self.mesh.ranks("dp"), Tracer(self.mesh.rank))
        self.sync = BucketOverlap(self.params, self.buckets, wire, self.tracer, 1, self.flat.dtype)

    def before_forward(self, step):
        super().before_forward(step)
        self.sync.arm(live=self.overlap)

    def after_backward(self, step):
        self.summed = self.sync.wait()

    def optimizer_step(self, step):
        self.adam.update(self.flat, self.summed, self.m, self.v)

    def sent_bytes(self):
        return self.sync.wire.sent()

    def final_params(self):
        self.sync.close()
        return self.flat

    def extra(self):
        return {"buckets": [b - a for a, b in self.buckets]}


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
