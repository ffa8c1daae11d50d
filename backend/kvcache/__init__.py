"""Paged KV cache. block_pool.py: Block records, ref counts, the free queue, the prefix-cache map.
manager.py: block tables, prefix hits, copy-on-write, swap bookkeeping (books only, holds no tensors).
tensor_store.py: the K/V tensors, the only writer of them. paged_decode.py: the tiny decoder generating
through them. serving.py: a step-level scheduler comparing paged blocks with contiguous reservations."""
