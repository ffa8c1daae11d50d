"""A pool of fixed-size KV blocks with reference counts, an O(1) LRU free queue and a prefix-cache map.

Invariants (checked by `check()`):
- every block is either free (ref_count 0, in the free queue) or used (ref_count > 0, not in the queue);
- free + used = num_blocks;
- a block with a hash is reachable from `cached[hash]`, and `cached` holds no block without that hash.
A freed block keeps its hash and contents: it is "cached but free" until the free queue hands it
out again (least recently freed first), when it is evicted from `cached`.
"""
from __future__ import annotations

from collections import OrderedDict


class BlockPool:
    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_count = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.free_queue: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))  # head = next out
        self.cached: dict[int, int] = {}  # hash -> block
        self.evictions = 0

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    def allocate(self) -> int:
        """Take the least recently freed block (evicting its cached contents); raises MemoryError if none."""
        if not self.free_queue:
            raise MemoryError("no free KV block")
        block, _ = self.free_queue.popitem(last=False)
        if self.block_hash[block] is not None:
            del self.cached[self.block_hash[block]]
            self.block_hash[block] = None
            self.evictions += 1
        self.ref_count[block] = 1
        return block

    def share(self, block: int) -> None:
        """One more table points at `block` (a fork, or a prefix-cache hit that may revive a free block)."""
        if self.ref_count[block] == 0:
            del self.free_queue[block]
        self.ref_count[block] += 1

    def release(self, block: int) -> None:
        assert self.ref_count[block] > 0, f"block {block} released while free"
        self.ref_count[block] -= 1
        if self.ref_count[block] == 0:
            self.free_queue[block] = None  # tail: evicted last

    def register(self, block: int, block_hash: int) -> int:
        """Record a full block's hash. If the hash is already cached in another block, keep that one."""
        if block_hash in self.cached:
            return self.cached[block_hash]
        self.block_hash[block] = block_hash
        self.cached[block_hash] = block
        return block

    def lookup(self, block_hash: int) -> int | None:
        return self.cached.get(block_hash)

    def check(self) -> None:
        free = set(self.free_queue)
        for b in range(self.num_blocks):
            assert (b in free) == (self.ref_count[b] == 0), f"block {b}: ref {self.ref_count[b]}, in free queue {b in free}"
        assert len(free) + sum(1 for r in self.ref_count if r > 0) == self.num_blocks
        for h, b in self.cached.items():
            assert self.block_hash[b] == h, f"cached hash {h} points at block {b} whose hash is {self.block_hash[b]}"
        assert sum(h is not None for h in self.block_hash) == len(self.cached)
