"""A tiny LLaMA-style decoder: token embedding, pre-norm blocks (RMSNorm -> attention -> residual,
RMSNorm -> SwiGLU -> residual), final RMSNorm, output head. Attention is pluggable (variants.py).
Sequences are unbatched (t, d) in generation; `loss` calls forward once per sequence of the batch. The batched
training path (embed, run_blocks, head_loss on (b, t, d)) is the one backend/parallel/parallelize.py transforms
(tensor, sequence, context, expert parallel and the pipeline's stages); `loss`, through the generation path and
SDPA, stays the independent single-process reference it is checked against."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from backend.attention.variants import GroupedQueryAttention, KVCache, MultiHeadLatentAttention
from backend.models.layers import RMSNorm, SwiGLU
from backend.models.moe import MoELayer


@dataclass(frozen=True)
class ModelShape:
    vocab: int = 64
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 4
    d_head: int = 16
    d_c: int = 32
    d_rope: int = 8
    d_cq: int = 32
    d_ff: int = 128
    variant: str = "mha"  # mha | mqa | gqa | mla
    mla_mode: str = "absorbed"
    n_experts: int = 0    # > 0: every feed-forward is an MoE layer (backend/models/moe.py), dropless top_k routing
    top_k: int = 2
    n_shared: int = 1     # shared experts every token passes through (DeepSeek), each d_ff wide


def make_attention(s: ModelShape) -> nn.Module:
    if s.variant == "mla":
        return MultiHeadLatentAttention(s.d_model, s.n_heads, s.d_head, s.d_c, s.d_rope, s.d_cq, s.mla_mode == "absorbed")
    kv = {"mha": s.n_heads, "mqa": 1, "gqa": s.n_kv_heads}[s.variant]
    return GroupedQueryAttention(s.d_model, s.n_heads, kv, s.d_head)


def make_ffn(s: ModelShape) -> nn.Module:
    if s.n_experts:
        return MoELayer(s.d_model, s.d_ff, s.n_experts, s.n_shared, s.top_k)
    return SwiGLU(s.d_model, s.d_ff)


class Block(nn.Module):
    def __init__(self, s: ModelShape):
        super().__init__()
        self.attn_norm, self.attn = RMSNorm(s.d_model), make_attention(s)
        self.ffn_norm, self.ffn = RMSNorm(s.d_model), make_ffn(s)

    def forward(self, x, start, cache):
        x = x + self.attn(self.attn_norm(x), start, cache)
        return x + self.ffn(self.ffn_norm(x))

    def batched(self, x):
        """The training path on (b, s, d)."""
        x = x + self.attn.batched(self.attn_norm(x))
        return x + self.ffn(self.ffn_norm(x))


class TinyDecoder(nn.Module):
    def __init__(self, s: ModelShape):
        super().__init__()
        self.shape = s
        self.embed = nn.Embedding(s.vocab, s.d_model)
        self.blocks = nn.ModuleList(Block(s) for _ in range(s.n_layers))
        self.norm, self.head = RMSNorm(s.d_model), nn.Linear(s.d_model, s.vocab, bias=False)
        self.cross_entropy = nn.CrossEntropyLoss()  # the batched path's loss (tensor parallel: on vocabulary shards)

    def new_caches(self, max_len: int) -> list[KVCache]:
        dtype = self.embed.weight.dtype
        return [b.attn.new_cache(max_len, dtype) for b in self.blocks]

    def forward(self, tokens: torch.Tensor, start: int = 0, caches: list[KVCache] | None = None) -> torch.Tensor:
        """tokens: (t,) -> logits (t, vocab). With caches, tokens are positions start..start+t-1."""
        x = self.embed(tokens)
        for i, block in enumerate(self.blocks):
            x = block(x, start, caches[i] if caches else None)
        return self.head(self.norm(x))

    def loss(self, batch: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy over a (b, t) batch."""
        logits = torch.stack([self(seq[:-1]) for seq in batch])
        return F.cross_entropy(at_least_fp32(logits.reshape(-1, logits.shape[-1])), batch[:, 1:].reshape(-1))

    def run_blocks(self, x: torch.Tensor) -> torch.Tensor:
        """The batched training path through the blocks: x (b, t, d) -> (b, t, d)."""
        for block in self.blocks:
            x = block.batched(x)
        return x

    def head_loss(self, x: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Final norm, head and mean cross entropy of x (b, t, d) against targets (b, t): (loss, logits)."""
        logits = self.head(self.norm(x))
        return self.cross_entropy(at_least_fp32(logits.reshape(-1, logits.shape[-1])), targets.reshape(-1)), logits


def at_least_fp32(logits: torch.Tensor) -> torch.Tensor:
    """The loss's input in fp32 when the model computes in bf16 or fp16 (as autocast and Megatron-LM compute the cross
    entropy; fp16's exp overflows, and a half-precision mean of many tokens rounds); fp32 and fp64 unchanged."""
    return logits.to(torch.promote_types(logits.dtype, torch.float32))
