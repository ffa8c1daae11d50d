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
`Sharded` holds a rank's shards and runs the ring collectives over one segment; the mesh's data parallel
(mesh_dp.DataParallel, where ZeRO-Offload lives) drives it.
"""
from __future__ import annotations

import torch

from backend.comm.collectives import Spec, all_gather_ring, reduce_scatter_ring
from backend.comm.p2p import P2P


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

    def gather(self, i: int, dtype: torch.dtype, shard: torch.Tensor | None = None) -> torch.Tensor:
        """All-gather segment i in `dtype`, from this rank's shard (or from `shard`, a copy of it held elsewhere)."""
        a, b = self.segs[i]
        shard = (self.shards[i] if shard is None else shard).to(dtype)
        return all_gather_ring(self.comm, shard, Spec("all_gather", shard.numel()))[:b - a]

    def reduce_scatter(self, i: int, grad: torch.Tensor) -> torch.Tensor:
        full = torch.zeros(self.pads[i], dtype=grad.dtype)
        full[:grad.numel()] = grad
        return reduce_scatter_ring(self.comm, full, Spec("reduce_scatter", self.pads[i]))
