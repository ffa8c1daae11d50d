"""The one token split: which tokens of a step's global batch (`batch` sequences of `seq` positions, each position's
target the next token) the rank at mesh coordinates (dp, ep, cp, tp) holds, on every one of its pipeline stages:
  sequences     the batch cut into dp x ep near-equal slices (dp outer, ep inner: ep ranks are data-parallel for all
                but the experts), its slice cut again into the schedule's micro-batches
  positions     of each sequence its cp shard: zigzag, chunks r and 2cp-1-r of 2cp (cp.positions: equal causal work);
                what its embedding, loss and attention see
  sp_positions  under SP the tp-th of tp contiguous shares of `positions` (SP's reduce-scatter leaves rank t chunk t):
                what its norms, stage boundaries and MoE layers hold (so the tokens it routes); else `positions`
mesh_train feeds each rank these tokens; the experiment's byte, memory and routing models read the same split.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from backend.parallel.cp import positions as cp_positions


@dataclass(frozen=True)
class TokenSplit:
    sequences: list[torch.Tensor]  # per micro-batch, the global batch's sequence indices
    positions: torch.Tensor        # the positions of each sequence under cp (stage input, attention)
    sp_positions: torch.Tensor     # those its sequence-parallel regions hold (= positions without SP)

    @property
    def microbatch_sizes(self) -> list[int]:
        return [len(s) for s in self.sequences]


def token_split(batch: int, seq: int, microbatches: int, sizes: dict[str, int], coords: dict[str, int],
                sp: bool = False) -> TokenSplit:
    """The tokens the rank at `coords` holds (`sizes`, `coords`: by mesh dimension; dp, ep, cp and tp are read, a
    missing one is 1 and 0)."""
    size, at = (lambda d: sizes.get(d, 1)), (lambda d: coords.get(d, 0))
    mine = torch.arange(batch).tensor_split(size("dp") * size("ep"))[at("dp") * size("ep") + at("ep")]
    cp = size("cp")
    held = cp_positions(seq, at("cp"), cp, "zigzag") if cp > 1 else torch.arange(seq)
    return TokenSplit(sequences=list(mine.tensor_split(microbatches)), positions=held,
                      sp_positions=held.tensor_split(size("tp"))[at("tp")] if sp else held)
