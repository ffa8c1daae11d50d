"""Paged KV cache. block_pool.py: Block records, ref counts, the free queue, the prefix-cache map.
manager.py: block tables, prefix hits, copy-on-write, swap bookkeeping (books only, holds no tensors).
contiguous.py: max-length reservations behind the manager's interface. tensor_store.py: the K/V tensors,
the only writer of them. paged_decode.py: the tiny decoder generating through them. The scheduler that
books into them is backend/serving/scheduler.py (kvcache.serve: backend/serving/allocator_sim.py)."""
