"""The KV tensors of a paged cache, and the only code that writes them.

One pool tensor kv[n_layers, num_blocks, 2, block_size, n_kv_heads, head_dim]; `layer(l)` is the
(num_blocks, 2, block_size, n_kv_heads, head_dim) view the paged-attention kernel reads. Tokens are
written at flat slots (block id * block_size + offset) that the manager hands out; block copies and
swaps are carried out from the block ids the manager returns. Swapped-out KV waits in CPU memory.
"""
from __future__ import annotations

import torch


class KVTensorStore:
    def __init__(self, n_layers: int, num_blocks: int, block_size: int, n_kv_heads: int, head_dim: int,
                 dtype=torch.float32, device="cpu"):
        self.block_size = block_size
        self.kv = torch.zeros(n_layers, num_blocks, 2, block_size, n_kv_heads, head_dim, dtype=dtype, device=device)
        self.swapped: dict[int, torch.Tensor] = {}

    def layer(self, layer: int) -> torch.Tensor:
        return self.kv[layer]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: (n, n_kv_heads, head_dim) for the tokens at `slots` (n,)."""
        blocks, offsets = slots // self.block_size, slots % self.block_size
        self.kv[layer, blocks, 0, offsets] = k
        self.kv[layer, blocks, 1, offsets] = v

    def copy(self, copies: list[tuple[int, int]]) -> None:
        for src, dst in copies:
            self.kv[:, dst] = self.kv[:, src]

    def swap_out(self, key: int, block_ids: list[int]) -> None:
        self.swapped[key] = self.kv[:, block_ids].to("cpu", copy=True)

    def swap_in(self, key: int, block_ids: list[int]) -> None:
        self.kv[:, block_ids] = self.swapped.pop(key).to(self.kv.device)

    def gather(self, layer: int, block_ids: list[int], num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Contiguous K and V (num_tokens, n_kv_heads, head_dim) read through a block table."""
        kv = self.kv[layer, block_ids].transpose(1, 2).reshape(-1, 2, *self.kv.shape[-2:])[:num_tokens]
        return kv[:, 0], kv[:, 1]
