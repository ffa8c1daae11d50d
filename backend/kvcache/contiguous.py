"""Contiguous max-length reservations (seed 000's first waste) behind the block manager's interface.

Each request is given `reserve` slots (the maximum model length) in one piece of a linear buffer of
`capacity` slots, first fit. Every reservation has the same size and starts where a freed one or the
buffer's start was, so the pieces never shift: the buffer is capacity // reserve blocks of `reserve`
slots, a request holds exactly one, and the last capacity % reserve slots can never hold one (the
buffer's fragmentation). A reservation never grows, so no watermark is kept at admission and no
request is ever preempted. A scheduler books into it as into the paged KVCacheManager.
"""
from __future__ import annotations

from backend.kvcache.manager import KVCacheManager


class ContiguousAllocator(KVCacheManager):
    def __init__(self, capacity: int, reserve: int):
        if not 1 <= reserve <= capacity:
            raise ValueError(f"a reservation of {reserve} slots does not fit a buffer of {capacity} (allowed: 1 <= reserve <= capacity)")
        super().__init__(capacity // reserve, reserve, prefix_caching=False)
        self.capacity, self.reserve = capacity, reserve
        self.fragment = capacity % reserve  # slots past the last whole reservation
        self.watermark = 0
