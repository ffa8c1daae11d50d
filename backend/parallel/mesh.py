"""A device mesh: the ranks on named dimensions DIMS, outermost first (tp innermost, so its ranks are neighbours
sharing the fastest links, as Megatron-LM and picotron place them), with one process group per line of the mesh.
Rank r's coordinate on each dimension is its mixed-radix digit; the group of dimension d holds the ranks differing from
r only in d. Every rank must build the same mesh: creating a process group is a collective, made in the same order.

    mesh = DeviceMesh.build(rank, world_size, dp=2, tp=2)
    mesh.size("tp"), mesh.index("tp"), mesh.group("tp"), mesh.ranks("tp")
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

DIMS = ("pp", "dp", "cp", "ep", "tp")  # outermost first


@dataclass
class DeviceMesh:
    rank: int
    shape: dict[str, int]                      # every dimension of DIMS, size 1 where unused
    groups: dict[str, object] = field(default_factory=dict)        # this rank's process group per dimension
    group_ranks: dict[str, list[int]] = field(default_factory=dict)  # and the global ranks in it, by index

    @classmethod
    def layout(cls, world_size: int, **sizes: int) -> dict[str, int]:
        """The full shape: named sizes, every other dimension 1; their product must be world_size."""
        unknown = set(sizes) - set(DIMS)
        if unknown:
            raise ValueError(f"unknown mesh dimensions {sorted(unknown)} (allowed: {', '.join(DIMS)})")
        shape = {d: int(sizes.get(d, 1)) for d in DIMS}
        if math.prod(shape.values()) != world_size:
            raise ValueError(f"mesh {shape} holds {math.prod(shape.values())} ranks, not world_size={world_size}")
        return shape

    @classmethod
    def coords(cls, rank: int, shape: dict[str, int]) -> dict[str, int]:
        """Rank's mixed-radix digits, the innermost dimension the fastest-varying."""
        digits = torch.unravel_index(torch.tensor(rank), tuple(shape[d] for d in DIMS))
        return {d: int(i) for d, i in zip(DIMS, digits)}

    @classmethod
    def lines(cls, shape: dict[str, int], dim: str) -> list[list[int]]:
        """Every group of dimension `dim`: the ranks sharing all other coordinates, in index order."""
        grid = torch.arange(math.prod(shape.values())).view(*(shape[d] for d in DIMS))
        return grid.movedim(DIMS.index(dim), -1).reshape(-1, shape[dim]).tolist()

    @classmethod
    def build(cls, rank: int, world_size: int, **sizes: int) -> "DeviceMesh":
        """Create the process groups (a collective: every rank calls this with the same sizes)."""
        import torch.distributed as dist

        shape = cls.layout(world_size, **sizes)
        mesh = cls(rank, shape)
        for dim in DIMS:
            for members in cls.lines(shape, dim):  # (a group of one has nothing to communicate)
                group = (None if shape[dim] == 1 else dist.group.WORLD if shape[dim] == world_size
                         else dist.new_group(members))
                if rank in members:
                    mesh.groups[dim], mesh.group_ranks[dim] = group, members
        return mesh

    def size(self, dim: str) -> int:
        return self.shape[dim]

    def index(self, dim: str) -> int:
        return self.coords(self.rank, self.shape)[dim]

    def group(self, dim: str):
        return self.groups[dim]

    def ranks(self, dim: str) -> list[int]:
        return self.group_ranks[dim]


def start_rank(rank: int, world_size: int, **mesh_sizes: int):
    """This rank's mesh (all ranks data parallel unless sizes say otherwise) and a tracer aligned across ranks."""
    import torch.distributed as dist

    from backend.trace import Tracer

    mesh = DeviceMesh.build(rank, world_size, **(mesh_sizes or {"dp": world_size}))
    tracer = Tracer(rank)
    tracer.align(dist.barrier)
    return mesh, tracer
