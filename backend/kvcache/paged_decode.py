"""The tiny decoder generating with its K and V in the paged pool, one sequence at a time, round-robin.

`PagedLayerCache` is what a GQA layer sees as its cache: it asks the manager where positions go,
has the store write K and V there, and attends through the block table: the Triton paged-attention
kernel for one query token, gather + SDPA for a prompt. `decode_paged` interleaves several
sequences in one pool, optionally forking one (copy-on-write) and swapping one out and back.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from backend.kvcache.manager import KVCacheManager
from backend.kvcache.tensor_store import KVTensorStore


class PagedLayerCache:
    def __init__(self, manager: KVCacheManager, store: KVTensorStore, seq_id: int, layer: int):
        self.manager, self.store, self.seq_id, self.layer = manager, store, seq_id, layer

    def attend(self, q, k, v, start):
        """q: (H, t, D); k, v: (t, HKV, D) for positions start.. (slots already booked by the manager)."""
        from kernels.paged_attention import paged_decode

        t, n = k.shape[0], start + k.shape[0]
        self.store.write(self.layer, torch.tensor(self.manager.slots(self.seq_id, start, n)), k, v)
        table = self.manager.block_ids(self.seq_id)
        if t == 1:
            tables, lens = torch.tensor([table], dtype=torch.int32), torch.tensor([n], dtype=torch.int32)
            return paged_decode(q.transpose(0, 1).contiguous(), self.store.layer(self.layer), tables, lens).transpose(0, 1)
        keys, values = self.store.gather(self.layer, table, n)
        group = q.shape[0] // keys.shape[1]
        keys = keys.transpose(0, 1).repeat_interleave(group, dim=0)
        values = values.transpose(0, 1).repeat_interleave(group, dim=0)
        mask = torch.ones(t, n, dtype=torch.bool).tril(diagonal=start)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)


@torch.no_grad()
def decode_paged(model, prompts, new_tokens, block_size, num_blocks, fork_and_swap=False, child_first=False):
    """Round-robin greedy decoding of all prompts through one paged pool. Returns tokens, logits, manager,
    store, a log of the fork and swap, the history (the pool after the prefill, the fork, the swap and every step) and
    the swap (step, block ids out and in, and the largest change of its K/V across the round trip). With
    child_first, the forked child takes its turn before the others, so it is the one that copies the shared block."""
    s = model.shape
    m = KVCacheManager(num_blocks, block_size, prefix_caching=False)
    store = KVTensorStore(s.n_layers, num_blocks, block_size, s.n_kv_heads, s.d_head)
    caches = lambda sid: [PagedLayerCache(m, store, sid, layer) for layer in range(s.n_layers)]  # noqa: E731
    tokens, logits, log, history, swap = {}, {}, [], [], None
    for sid, prompt in enumerate(prompts):
        m.add(sid, prompt.tolist())
        logits[sid] = [model(prompt, 0, caches(sid))]
        tokens[sid] = prompt.tolist()
    history.append(snapshot(m, 0, "prefill"))
    if fork_and_swap:  # the child shares the parent's blocks; its first write copies the shared last block
        child = len(prompts)
        m.fork(0, child)
        fork_at = len(tokens[0])
        log.append(f"sequence {child} forked from sequence 0 at {fork_at} tokens: "
                   f"{fork_at // block_size} full blocks shared, {'one partial block shared until a write' if fork_at % block_size else 'no partial block'}")
        tokens[child], logits[child] = list(tokens[0]), [logits[0][-1]]
        history.append(snapshot(m, 0, f"fork: sequence {child} shares sequence 0's blocks"))
    for step in range(new_tokens):
        if fork_and_swap and step == new_tokens // 2 and len(prompts) > 1:
            before = [store.gather(layer, m.block_ids(1), m.seqs[1].num_tokens) for layer in range(s.n_layers)]
            out_ids = m.swap_out(1)
            store.swap_out(1, out_ids)
            log.append(f"step {step}: sequence 1 swapped out ({store.swapped[1].shape[1]} blocks to CPU)")
            history.append(snapshot(m, step, "sequence 1 swapped out to CPU"))
            in_ids = m.swap_in(1)
            store.swap_in(1, in_ids)
            after = [store.gather(layer, in_ids, m.seqs[1].num_tokens) for layer in range(s.n_layers)]
            gap = max((a - b).abs().max().item() for x, y in zip(before, after) for a, b in zip(x, y))
            log.append(f"step {step}: sequence 1 swapped back in")
            swap = {"step": step, "out": out_ids, "in": in_ids, "kv_gap": gap}
            history.append(snapshot(m, step, "sequence 1 swapped back in"))
        order = sorted(tokens, key=lambda sid: (not (child_first and fork_and_swap and sid == len(prompts)), sid))
        for sid in order:
            nxt = int(logits[sid][-1][-1].argmax()) if not (fork_and_swap and sid == len(prompts) and step == 0) \
                else int(logits[sid][-1][-1].argsort()[-2])  # the child samples differently, so it diverges
            pos = len(tokens[sid])
            tokens[sid].append(nxt)
            store.copy(m.grow(sid, pos + 1, tokens[sid]))
            logits[sid].append(model(torch.tensor([nxt]), pos, caches(sid)))
        m.check_invariants()
        history.append(snapshot(m, step + 1, f"decode step {step + 1}"))
    return tokens, {k: torch.cat(v) for k, v in logits.items()}, m, store, log, history, swap


def snapshot(m: KVCacheManager, step: int, label: str) -> dict:
    """The manager's state as data: each sequence's block table, each physical block's ref count, fill and owners."""
    owners = {}
    for sid in sorted(m.seqs):
        for b in m.seqs[sid].table:
            owners.setdefault(b.id, []).append(sid)
    return {"step": step, "label": label,
            "tables": [{"seq": sid, "logical": i, "physical": b.id, "tokens": b.num_tokens}
                       for sid in sorted(m.seqs) for i, b in enumerate(m.seqs[sid].table)],
            "swapped": sorted(m.swapped),
            "pool": [{"block": b.id, "ref_count": b.ref_count, "tokens": b.num_tokens,
                      "owners": ",".join(map(str, owners.get(b.id, [])))} for b in m.pool.blocks]}


@torch.no_grad()
def reservation_waste(model, tokens: torch.Tensor, max_len: int, block_size: int) -> dict:
    """Seed 000's first waste: one short sequence (its "我爱中国", 4 tokens) in a cache reserved at the maximum length,
    against the same sequence in pages. Both caches hold real K/V; bytes are read off their tensors."""
    s = model.shape
    contiguous = model.new_caches(max_len)
    model(tokens, 0, contiguous)
    reserved = sum(t.numel() * t.element_size() for c in contiguous for t in c.tensors.values())
    held = sum(c.bytes_used() for c in contiguous)
    m = KVCacheManager(-(-max_len // block_size), block_size, prefix_caching=False)
    store = KVTensorStore(s.n_layers, m.pool.num_blocks, block_size, s.n_kv_heads, s.d_head)
    m.add(0, tokens.tolist())
    model(tokens, 0, [PagedLayerCache(m, store, 0, layer) for layer in range(s.n_layers)])
    per_slot = store.kv[:, 0].numel() * store.kv.element_size() // block_size  # K and V of one token, every layer
    return {"tokens": len(tokens), "max_len": max_len, "block_size": block_size,
            "contiguous_reserved_slots": reserved // (held // len(tokens)), "contiguous_bytes": reserved, "contiguous_used_bytes": held,
            "paged_blocks": m.used_blocks(), "paged_reserved_slots": m.used_blocks() * block_size,
            "paged_bytes": m.used_blocks() * block_size * per_slot, "paged_used_bytes": len(tokens) * per_slot}


@torch.no_grad()
def seed_copy_on_write(model, block_size: int, seed: int = 0) -> dict:
    """Seed 000's copy-on-write, "page 3 copied to page 5": sequence A fills pages 0-3 (page 3 partly), sequence B
    takes page 4, C forks from A and shares pages 0-3; C's first token lands in the shared page 3, so the manager
    copies it to the next free page, 5, and only C's table changes. Real K/V: the copy's slots are compared."""
    s = model.shape
    m = KVCacheManager(8, block_size, prefix_caching=False)
    store = KVTensorStore(s.n_layers, 8, block_size, s.n_kv_heads, s.d_head)
    caches = lambda sid: [PagedLayerCache(m, store, sid, layer) for layer in range(s.n_layers)]  # noqa: E731
    g = torch.Generator().manual_seed(seed + 7)
    a = torch.randint(0, s.vocab, (3 * block_size + max(1, block_size // 2),), generator=g)
    b = torch.randint(0, s.vocab, (max(1, block_size // 2),), generator=g)
    m.add(0, a.tolist())
    model(a, 0, caches(0))
    m.add(1, b.tolist())
    model(b, 0, caches(1))
    m.fork(0, 2)
    shared = snapshot(m, 0, "C forked from A")
    page3_before = store.kv[:, m.seqs[0].table[-1].id].clone()
    pos = len(a)
    copies = m.grow(2, pos + 1, None)
    store.copy(copies)
    model(torch.tensor([int(b[0])]), pos, caches(2))  # C writes its first own token
    m.check_invariants()
    src, dst = copies[0] if copies else (None, None)
    filled = pos % block_size
    copy_gap = (store.kv[:, dst, :, :filled] - page3_before[:, :, :filled]).abs().max().item() if copies else float("inf")
    parent_gap = (store.kv[:, src] - page3_before).abs().max().item() if copies else float("inf")
    return {"copies": copies, "parent_table": m.block_ids(0), "child_table": m.block_ids(2),
            "ref_counts": {blk.id: blk.ref_count for blk in m.pool.blocks}, "copy_gap": copy_gap, "parent_gap": parent_gap,
            "shared": shared, "after": snapshot(m, 1, "C wrote a token: page 3 copied")}
