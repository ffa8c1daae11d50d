"""Paged KV cache: block pool, block tables, prefix cache, copy-on-write, swapping, a serving scheduler."""
