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
def decode_paged(model, prompts, new_tokens, block_size, num_blocks, fork_and_swap=False):
    """Round-robin greedy decoding of all prompts through one paged pool. Returns tokens, logits,
    manager, store and a log of the fork and swap."""
    s = model.shape
    m = KVCacheManager(num_blocks, block_size, prefix_caching=False)
    store = KVTensorStore(s.n_layers, num_blocks, block_size, s.n_kv_heads, s.d_head)
    caches = lambda sid: [PagedLayerCache(m, store, sid, layer) for layer in range(s.n_layers)]  # noqa: E731
    tokens, logits, log = {}, {}, []
    for sid, prompt in enumerate(prompts):
        m.add(sid, prompt.tolist())
        logits[sid] = [model(prompt, 0, caches(sid))]
        tokens[sid] = prompt.tolist()
    if fork_and_swap:  # the child shares the parent's blocks; its first write copies the shared last block
        child = len(prompts)
        m.fork(0, child)
        fork_at = len(tokens[0])
        log.append(f"sequence {child} forked from sequence 0 at {fork_at} tokens: "
                   f"{fork_at // block_size} full blocks shared, {'one partial block shared until a write' if fork_at % block_size else 'no partial block'}")
        tokens[child], logits[child] = list(tokens[0]), [logits[0][-1]]
    for step in range(new_tokens):
        if fork_and_swap and step == new_tokens // 2 and len(prompts) > 1:
            store.swap_out(1, m.swap_out(1))
            log.append(f"step {step}: sequence 1 swapped out ({store.swapped[1].shape[1]} blocks to CPU)")
            store.swap_in(1, m.swap_in(1))
            log.append(f"step {step}: sequence 1 swapped back in")
        for sid in list(tokens):
            nxt = int(logits[sid][-1][-1].argmax()) if not (fork_and_swap and sid == len(prompts) and step == 0) \
                else int(logits[sid][-1][-1].argsort()[-2])  # the child samples differently, so it diverges
            pos = len(tokens[sid])
            tokens[sid].append(nxt)
            store.copy(m.grow(sid, pos + 1, tokens[sid]))
            logits[sid].append(model(torch.tensor([nxt]), pos, caches(sid)))
        m.check_invariants()
    return tokens, {k: torch.cat(v) for k, v in logits.items()}, m, store, log
