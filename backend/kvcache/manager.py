"""Block tables over a BlockPool: sequences allocate blocks as tokens arrive, share them by fork and by
prefix hash, copy a shared block before writing into it, and move to CPU memory and back.

Invariants (checked by `check()`, besides the pool's own): a block's ref count equals the number of
block-table entries pointing at it, and no table points at a free block.

With `kv_shape=(n_kv_heads, d_head)` the manager also stores real K and V in a pool tensor
`kv[num_blocks, 2, block_size, n_kv_heads, d_head]`; without it, it tracks only who holds what.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from backend.kvcache.block_pool import BlockPool


@dataclass
class Sequence:
    seq_id: int
    tokens: list[int] = field(default_factory=list)
    table: list[int] = field(default_factory=list)    # logical block i -> physical block
    hashes: list[int] = field(default_factory=list)   # hash chain over the full blocks


@dataclass
class Stats:
    prefix_queried_tokens: int = 0
    prefix_hit_tokens: int = 0
    cow_copies: int = 0
    swaps_out: int = 0
    swaps_in: int = 0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True,
                 kv_shape: tuple[int, int] | None = None, dtype=torch.float32):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.pool, self.block_size, self.prefix_caching = BlockPool(num_blocks), block_size, prefix_caching
        self.kv = torch.zeros(num_blocks, 2, block_size, *kv_shape, dtype=dtype) if kv_shape else None
        self.fill = [0] * num_blocks  # token slots written in each block
        self.seqs: dict[int, Sequence] = {}
        self.swapped: dict[int, tuple[Sequence, torch.Tensor | None]] = {}
        self.stats = Stats()
        self.events: list[dict] = []

    # --- sizing ----------------------------------------------------------------------------------------
    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def capacity_tokens(self) -> int:
        return self.pool.num_blocks * self.block_size

    def _hash(self, parent: int | None, tokens: list[int]) -> int:
        return hash((parent, tuple(tokens)))

    # --- sequences ----------------------------------------------------------------------------------------
    def add(self, seq_id: int, tokens: list[int], kv: torch.Tensor | None = None) -> int:
        """Admit a prompt: reuse cached full blocks of its prefix, allocate the rest. Returns tokens hit.
        Raises MemoryError, changing nothing, if the pool cannot hold it. kv: (len, 2, h, d) or None."""
        if len(tokens) > self.capacity_tokens:
            raise ValueError(f"{len(tokens)} tokens can never fit a pool of {self.capacity_tokens} token slots")
        bs, seq = self.block_size, Sequence(seq_id)
        hits, parent = [], None
        if self.prefix_caching:
            for i in range((len(tokens) - 1) // bs):  # the last token is always computed, so its block is not a hit
                h = self._hash(parent, tokens[i * bs:(i + 1) * bs])
                block = self.pool.lookup(h)
                if block is None:
                    break
                hits.append((block, h))
                parent = h
        new_blocks = self.blocks_for(len(tokens)) - len(hits)
        revived = sum(1 for b, _ in hits if self.pool.ref_count[b] == 0)
        if new_blocks + revived > self.pool.num_free:
            raise MemoryError(f"sequence {seq_id} needs {new_blocks + revived} free blocks, {self.pool.num_free} are free")
        for block, h in hits:
            self.pool.share(block)
            seq.table.append(block)
            seq.hashes.append(h)
        self.stats.prefix_queried_tokens += len(tokens)
        self.stats.prefix_hit_tokens += len(hits) * bs
        seq.tokens = list(tokens[:len(hits) * bs])
        self.seqs[seq_id] = seq
        for j, token in enumerate(tokens[len(hits) * bs:], start=len(hits) * bs):
            self._write(seq, token, None if kv is None else kv[j])
        return len(hits) * bs

    def append(self, seq_id: int, token: int, kv: torch.Tensor | None = None) -> None:
        """One generated token. Raises MemoryError (the caller preempts someone) if a block is needed and none is free."""
        self._write(self.seqs[seq_id], token, kv)

    def _write(self, seq: Sequence, token: int, kv) -> None:
        bs, pos = self.block_size, len(seq.tokens)
        if pos % bs == 0:
            seq.table.append(self.pool.allocate())
        elif self.pool.ref_count[seq.table[-1]] > 1:  # shared partial block: copy before writing
            old = seq.table[-1]
            new = self.pool.allocate()
            if self.kv is not None:
                self.kv[new] = self.kv[old]
            self.fill[new] = self.fill[old]
            self.pool.release(old)
            seq.table[-1] = new
            self.stats.cow_copies += 1
            self.events.append({"op": "copy-on-write", "seq": seq.seq_id, "from": old, "to": new})
        block = seq.table[-1]
        if self.kv is not None and kv is not None:
            self.kv[block, :, pos % bs] = kv
        self.fill[block] = pos % bs + 1
        seq.tokens.append(token)
        if (pos + 1) % bs == 0:
            h = self._hash(seq.hashes[-1] if seq.hashes else None, seq.tokens[-bs:])
            seq.hashes.append(h)
            if self.prefix_caching:
                self.pool.register(block, h)

    def fork(self, parent_id: int, child_id: int) -> None:
        """The child shares every block of the parent (parallel sampling, beam search) until one writes."""
        parent = self.seqs[parent_id]
        for block in parent.table:
            self.pool.share(block)
        self.seqs[child_id] = Sequence(child_id, list(parent.tokens), list(parent.table), list(parent.hashes))

    def free(self, seq_id: int) -> None:
        seq = self.seqs.pop(seq_id)
        for block in reversed(seq.table):  # tail blocks go to the free queue first, so they are evicted first
            self.pool.release(block)
            if self.pool.ref_count[block] == 0 and self.pool.block_hash[block] is None:
                self.fill[block] = 0

    def swap_out(self, seq_id: int) -> None:
        """Copy the sequence's KV to CPU memory and free its blocks."""
        seq = self.seqs[seq_id]
        data = self.kv[seq.table].clone() if self.kv is not None else None
        self.free(seq_id)
        self.swapped[seq_id] = (seq, data)
        self.stats.swaps_out += 1
        self.events.append({"op": "swap-out", "seq": seq_id, "blocks": len(seq.table)})

    def swap_in(self, seq_id: int) -> None:
        seq, data = self.swapped[seq_id]
        if len(seq.table) > self.pool.num_free:
            raise MemoryError(f"sequence {seq_id} needs {len(seq.table)} free blocks to swap in")
        del self.swapped[seq_id]
        last_fill = len(seq.tokens) - (len(seq.table) - 1) * self.block_size
        table = [self.pool.allocate() for _ in seq.table]
        for i, block in enumerate(table):
            self.fill[block] = self.block_size if i < len(table) - 1 else last_fill
        if data is not None:
            self.kv[table] = data
        seq.table = table
        self.seqs[seq_id] = seq
        self.stats.swaps_in += 1
        self.events.append({"op": "swap-in", "seq": seq_id, "blocks": len(table)})

    def gather(self, seq_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Contiguous K and V (len, h, d) of a sequence, read through its block table (the reference path)."""
        seq = self.seqs[seq_id]
        kv = self.kv[seq.table].transpose(1, 2).reshape(-1, 2, *self.kv.shape[3:])[:len(seq.tokens)]
        return kv[:, 0], kv[:, 1]

    # --- measurement and invariants ----------------------------------------------------------------------
    def used_blocks(self) -> int:
        return self.pool.num_blocks - self.pool.num_free

    def filled_slots(self) -> int:
        return sum(self.fill[b] for b in range(self.pool.num_blocks) if self.pool.ref_count[b] > 0)

    def check(self) -> None:
        self.pool.check()
        refs = [0] * self.pool.num_blocks
        for seq in self.seqs.values():
            assert len(seq.table) == self.blocks_for(len(seq.tokens)), f"seq {seq.seq_id}: table/tokens mismatch"
            for block in seq.table:
                refs[block] += 1
        for b, (want, got) in enumerate(zip(refs, self.pool.ref_count)):
            assert want == got, f"block {b}: {want} table entries but ref count {got}"
