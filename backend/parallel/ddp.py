"""Our DDP: per-parameter gradient hooks, buckets in reverse parameter order, and a ring all-reduce started as soon
as a bucket's gradients are all ready, overlapping the rest of the backward (seed 000; the hooks and the communication
thread are mesh_dp.BucketOverlap's, shared with the mesh). Torch's DistributedDataParallel is the peer:
`torch_ddp_peer` on the tiny LLaMA.

Per-rank volume: a ring all-reduce of a bucket padded to P elements (a multiple of n) sends 2P(n-1)/n, counted on our
Wire's send/recv.
"""
from __future__ import annotations

import torch



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
