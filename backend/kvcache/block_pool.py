"""A pool of fixed-size KV blocks: each `Block` record carries its id, ref count, hash and the tokens it
holds; the pool owns them, with an O(1) LRU free queue and a prefix-cache map (vLLM v1's block_pool).

Invariants (asserted by `check_invariants()`):
- a block is free (ref_count 0, in the free queue) or used (ref_count > 0, not in it); free + used = all;
- `cached[h]` is a block whose hash is h, and every block with a hash is in `cached`;
- a block holds 0..block_size tokens; a hashed block is full.
A freed block keeps its hash and contents: it is "cached but free" until the free queue hands it out
again (least recently freed first), when it leaves `cached`.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class Block:
    id: int
    ref_count: int = 0
    hash: int | None = None   # set once the block is full and registered in the prefix cache
    num_tokens: int = 0       # token slots written


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))  # head = next out
        self.cached: dict[int, int] = {}  # hash -> block id
        self.evictions = 0

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    def allocate(self) -> Block:
        """Take the least recently freed block (evicting its cached contents); raises MemoryError if none."""
        if not self.free_queue:
            raise MemoryError("no free KV block")
        block = self.blocks[self.free_queue.popitem(last=False)[0]]
        if block.hash is not None:
            del self.cached[block.hash]
            self.evictions += 1
        block.ref_count, block.hash, block.num_tokens = 1, None, 0
        return block

    def share(self, block: Block) -> None:
        """One more table points at `block` (a fork, or a prefix-cache hit that may revive a free block)."""
        if block.ref_count == 0:
            del self.free_queue[block.id]
        block.ref_count += 1

    def release(self, block: Block) -> None:
        assert block.ref_count > 0, f"block {block.id} released while free"
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free_queue[block.id] = None  # tail: evicted last
            if block.hash is None:
                block.num_tokens = 0  # nobody can find its contents again

    def register(self, block: Block, block_hash: int) -> None:
        """Record a full block's hash, unless another block already caches the same contents."""
        if block_hash not in self.cached:
            block.hash = block_hash
            self.cached[block_hash] = block.id

    def lookup(self, block_hash: int) -> Block | None:
        block_id = self.cached.get(block_hash)
        return None if block_id is None else self.blocks[block_id]

    def check_invariants(self) -> None:
        free = set(self.free_queue)
        for b in self.blocks:
            assert (b.id in free) == (b.ref_count == 0), f"block {b.id}: ref {b.ref_count}, in free queue {b.id in free}"
            assert 0 <= b.num_tokens <= self.block_size, f"block {b.id} holds {b.num_tokens} tokens"
            assert b.hash is None or b.num_tokens == self.block_size, f"block {b.id} is hashed but not full"
        assert len(free) + sum(b.ref_count > 0 for b in self.blocks) == self.num_blocks
        for h, b in self.cached.items():
            assert self.blocks[b].hash == h, f"cached hash {h} points at block {b} whose hash is {self.blocks[b].hash}"
        assert sum(b.hash is not None for b in self.blocks) == len(self.cached)
