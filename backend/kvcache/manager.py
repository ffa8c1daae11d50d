"""Block tables over a BlockPool: the manager only books. Sequences take blocks as their tokens are
scheduled, share full blocks by prefix hash and by fork, copy a shared partial block before writing
into it, and give their blocks up when swapped out. It holds no tensors: whatever moves KV data
(a copy-on-write copy, a swap) is returned as block ids for the KV tensor store to carry out.

Invariants (asserted by `check_invariants()`, besides the pool's): a block's ref count equals the
number of block-table entries pointing at it; a sequence of n tokens holds ceil(n / block_size)
blocks, every one full but the last, which holds the rest; a swapped-out sequence holds none.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence as TokenIds

from backend.kvcache.block_pool import Block, BlockPool


@dataclass
class Sequence:
    seq_id: int
    num_tokens: int = 0                                  # token slots booked
    table: list[Block] = field(default_factory=list)     # logical block i -> physical block
    hashes: list[int] = field(default_factory=list)      # hash chain over the full blocks (prefix caching)


@dataclass
class Stats:
    prefix_queried_tokens: int = 0
    prefix_hit_tokens: int = 0
    cow_copies: int = 0
    swaps_out: int = 0
    swaps_in: int = 0


def admission_watermark(num_blocks: int) -> int:
    """Blocks a scheduler keeps free when it admits a request, so the running ones can still grow (vLLM's 1%)."""
    return max(1, num_blocks // 100)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True):
        self.pool, self.block_size, self.prefix_caching = BlockPool(num_blocks, block_size), block_size, prefix_caching
        self.watermark = admission_watermark(num_blocks)
        self.seqs: dict[int, Sequence] = {}
        self.swapped: dict[int, Sequence] = {}
        self.stats = Stats()
        self.events: list[dict] = []

    # --- sizing ------------------------------------------------------------------------------------------
    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def capacity_tokens(self) -> int:
        return self.pool.num_blocks * self.block_size

    def block_ids(self, seq_id: int) -> list[int]:
        return [b.id for b in self.seqs[seq_id].table]

    def slots(self, seq_id: int, start: int, end: int) -> list[int]:
        """Flat slot (block id * block_size + offset) of positions start..end-1: where the store writes them."""
        bs, table = self.block_size, self.seqs[seq_id].table
        return [table[p // bs].id * bs + p % bs for p in range(start, end)]

    # --- booking -----------------------------------------------------------------------------------------
    def _prefix_hits(self, tokens: TokenIds) -> list[tuple[Block, int]]:
        hits, parent, bs = [], None, self.block_size
        if self.prefix_caching:
            for i in range((len(tokens) - 1) // bs):  # the last token is always computed, so its block is no hit
                h = hash((parent, tuple(tokens[i * bs:(i + 1) * bs])))
                block = self.pool.lookup(h)
                if block is None:
                    break
                hits.append((block, h))
                parent = h
        return hits

    def cached_prefix(self, tokens: TokenIds) -> int:
        """Tokens of this prompt whose KV is already cached (whole blocks); books nothing."""
        return len(self._prefix_hits(tokens)) * self.block_size

    def add(self, seq_id: int, tokens: TokenIds, num_tokens: int | None = None) -> int:
        """Admit a sequence: share the cached full blocks of its prefix, then book up to `num_tokens`
        (default all) of `tokens`. Returns the tokens hit. Raises MemoryError, changing nothing, if the
        pool cannot hold them; ValueError if the pool never could."""
        num_tokens = len(tokens) if num_tokens is None else num_tokens
        if len(tokens) > self.capacity_tokens:
            raise ValueError(f"{len(tokens)} tokens can never fit a pool of {self.capacity_tokens} token slots")
        hits = self._prefix_hits(tokens)
        hit_tokens = len(hits) * self.block_size
        revived = sum(1 for b, _ in hits if b.ref_count == 0)
        need = self.blocks_for(max(num_tokens, hit_tokens)) - len(hits) + revived
        if need > self.pool.num_free:
            raise MemoryError(f"sequence {seq_id} needs {need} free blocks, {self.pool.num_free} are free")
        seq = Sequence(seq_id, hit_tokens)
        for block, h in hits:
            self.pool.share(block)
            seq.table.append(block)
            seq.hashes.append(h)
        self.stats.prefix_queried_tokens += len(tokens)
        self.stats.prefix_hit_tokens += hit_tokens
        self.seqs[seq_id] = seq
        self.grow(seq_id, num_tokens, tokens)
        return hit_tokens

    def grow(self, seq_id: int, num_tokens: int, tokens: TokenIds | None) -> list[tuple[int, int]]:
        """Book slots up to `num_tokens` (tokens[i] is the id at position i, read to hash blocks that fill; None
        without prefix caching, which hashes nothing).
        Returns the block copies (src, dst) the store must make first: a shared partial block is copied
        before it is written (copy-on-write). Raises MemoryError, changing nothing, if blocks run out."""
        seq, bs = self.seqs[seq_id], self.block_size
        old, num_blocks = seq.num_tokens, -(-num_tokens // bs)
        if num_tokens <= old:
            return []
        if num_tokens == old + 1 and old % bs and seq.table[-1].ref_count == 1:
            # One decode token into the last block's free slot, owned by this sequence alone: the step a
            # serving loop takes most, kept to a few operations (no allocation, no copy).
            seq.table[-1].num_tokens += 1
            seq.num_tokens = num_tokens
            if self.prefix_caching and num_tokens % bs == 0:
                self._hash_full_blocks(seq, num_tokens, tokens)
            return []
        copy_on_write = old % bs != 0 and seq.table[-1].ref_count > 1
        need = num_blocks - len(seq.table) + copy_on_write
        if need > self.pool.num_free:
            raise MemoryError(f"sequence {seq_id} needs {need} free blocks, {self.pool.num_free} are free")
        copies = []
        if copy_on_write:
            shared, new = seq.table[-1], self.pool.allocate()
            new.num_tokens = shared.num_tokens
            self.pool.release(shared)
            seq.table[-1] = new
            copies.append((shared.id, new.id))
            self.stats.cow_copies += 1
            self.events.append({"op": "copy-on-write", "seq": seq_id, "from": shared.id, "to": new.id})
        for _ in range(num_blocks - len(seq.table)):
            seq.table.append(self.pool.allocate())
        for i in range(old // bs, len(seq.table)):
            seq.table[i].num_tokens = min(bs, num_tokens - i * bs)
        if self.prefix_caching:
            self._hash_full_blocks(seq, num_tokens, tokens)
        seq.num_tokens = num_tokens
        return copies

    def _hash_full_blocks(self, seq: Sequence, num_tokens: int, tokens: TokenIds) -> None:
        """Register every block that `num_tokens` fills, under the hash chain of its tokens (the prefix cache)."""
        bs = self.block_size
        for i in range(len(seq.hashes), num_tokens // bs):
            h = hash((seq.hashes[-1] if seq.hashes else None, tuple(tokens[i * bs:(i + 1) * bs])))
            seq.hashes.append(h)
            self.pool.register(seq.table[i], h)

    def fork(self, parent_id: int, child_id: int) -> None:
        """The child shares every block of the parent (parallel sampling, beam search) until one writes."""
        parent = self.seqs[parent_id]
        for block in parent.table:
            self.pool.share(block)
        self.seqs[child_id] = Sequence(child_id, parent.num_tokens, list(parent.table), list(parent.hashes))

    def free(self, seq_id: int) -> None:
        seq = self.seqs.pop(seq_id)
        for block in reversed(seq.table):  # tail blocks go to the free queue first, so they are evicted first
            self.pool.release(block)

    def swap_out(self, seq_id: int) -> list[int]:
        """Give up the sequence's blocks, keeping its bookkeeping. Returns the block ids whose KV the store
        must copy to CPU memory now, before anything else takes them."""
        seq = self.seqs[seq_id]
        ids = [b.id for b in seq.table]
        self.free(seq_id)
        seq.table = []
        self.swapped[seq_id] = seq
        self.stats.swaps_out += 1
        self.events.append({"op": "swap-out", "seq": seq_id, "blocks": len(ids)})
        return ids

    def swap_in(self, seq_id: int) -> list[int]:
        """Fresh blocks for a swapped-out sequence; returns their ids, for the store to copy its KV into."""
        seq = self.swapped[seq_id]
        need = self.blocks_for(seq.num_tokens)
        if need > self.pool.num_free:
            raise MemoryError(f"sequence {seq_id} needs {need} free blocks to swap in")
        del self.swapped[seq_id]
        seq.table = [self.pool.allocate() for _ in range(need)]
        for i, block in enumerate(seq.table):
            block.num_tokens = min(self.block_size, seq.num_tokens - i * self.block_size)
        self.seqs[seq_id] = seq
        self.stats.swaps_in += 1
        self.events.append({"op": "swap-in", "seq": seq_id, "blocks": need})
        return [b.id for b in seq.table]

    # --- measurement and invariants ----------------------------------------------------------------------
    def used_blocks(self) -> int:
        return self.pool.num_blocks - self.pool.num_free

    def filled_slots(self) -> int:
        return sum(b.num_tokens for b in self.pool.blocks if b.ref_count > 0)

    def check_invariants(self) -> None:
        self.pool.check_invariants()
        bs, refs = self.block_size, [0] * self.pool.num_blocks
        for seq in self.seqs.values():
            assert len(seq.table) == self.blocks_for(seq.num_tokens), f"seq {seq.seq_id}: table/tokens mismatch"
            for i, block in enumerate(seq.table):
                refs[block.id] += 1
                want = min(bs, seq.num_tokens - i * bs)
                assert block.num_tokens == want, f"seq {seq.seq_id} block {i}: holds {block.num_tokens}, expected {want}"
        for seq in self.swapped.values():
            assert not seq.table, f"swapped-out seq {seq.seq_id} still holds blocks"
        for block in self.pool.blocks:
            assert refs[block.id] == block.ref_count, f"block {block.id}: {refs[block.id]} table entries but ref count {block.ref_count}"
