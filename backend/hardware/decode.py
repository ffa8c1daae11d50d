"""Why decoding is memory-bound: the bytes and FLOPs of one decode step, and a batched decode step of the tiny LLaMA.

One decode step of a batch of B sequences, each at context c, computes one new token per sequence. It must read
every weight matrix once (the embedding table only for the B rows it gathers) and each sequence's KV cache, and
does 2 FLOPs per weight per sequence plus attention's 4·n_h·d_h·c per layer per sequence:
    bytes ≈ W·e + B·c·(2·L·n_kv·d_h)·e_kv           FLOPs ≈ B·(2·W_mm + 4·L·n_h·d_h·c)
so at B = 1 the intensity is about 2/e FLOP/byte (1 for fp16), far left of any GPU's ridge point (hundreds): the
step takes weight bytes ÷ bandwidth. Batching multiplies the FLOPs by B for the same weight read, which moves the
step right along the roofline until it meets the compute roof; prefill (B·P tokens at once) is already there.
Activations (a few d_model vectors per token) and element-wise work (norms, RoPE, SiLU, softmax) are left out.
"""
from __future__ import annotations

import dataclasses
import math

import torch

from backend.attention.rope import apply_rope, rope_angles
from backend.result import Check


@dataclasses.dataclass(frozen=True)
class LlamaShape:
    """A LLaMA-family decoder: untied embedding and head, SwiGLU feed-forward, GQA, RMSNorm weights."""
    name: str
    vocab: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_ff: int
    source: str = ""
    published_params: int | None = None  # the total its release states (safetensors metadata), to check params()

    @property
    def d_head(self) -> int:
        return self.d_model // self.n_heads

    def layer_matmul_params(self) -> int:
        """q and o (d × d), k and v (d × n_kv·d_h), gate, up and down (d × d_ff)."""
        d, kv = self.d_model, self.n_kv_heads * self.d_head
        return 2 * d * d + 2 * d * kv + 3 * d * self.d_ff

    def matmul_params(self) -> int:
        """Weights multiplied by every token: the layers' projections and the output head."""
        return self.n_layers * self.layer_matmul_params() + self.vocab * self.d_model

    def params(self) -> int:
        """Every parameter: the projections, the embedding table and the RMSNorm weights (2 per layer and a final one)."""
        return self.matmul_params() + self.vocab * self.d_model + (2 * self.n_layers + 1) * self.d_model

    def kv_elements_per_token(self) -> int:
        return 2 * self.n_layers * self.n_kv_heads * self.d_head


# Published configs (config.json of each release on the Hugging Face hub) and their stated parameter counts.
MODELS = {
    "Llama 2 7B": LlamaShape("Llama 2 7B", 32000, 4096, 32, 32, 32, 11008, "meta-llama/Llama-2-7b-hf config.json",
                             6_738_415_616),
    "Llama 2 70B": LlamaShape("Llama 2 70B", 32000, 8192, 80, 64, 8, 28672, "meta-llama/Llama-2-70b-hf config.json",
                              68_976_648_192),
    "Llama 3 8B": LlamaShape("Llama 3 8B", 128256, 4096, 32, 32, 8, 14336, "meta-llama/Meta-Llama-3-8B config.json",
                             8_030_261_248),
}


def decode_bytes(s: LlamaShape, batch: int, context: int, elem: int, kv_elem: int | None = None) -> dict[str, float]:
    """Bytes one decode step moves from device memory: weights once (B embedding rows), each sequence's cache of
    `context` tokens read, its new token's K and V written."""
    kv_elem = elem if kv_elem is None else kv_elem
    weights = (s.matmul_params() + batch * s.d_model + (2 * s.n_layers + 1) * s.d_model) * elem
    kv_read = batch * context * s.kv_elements_per_token() * kv_elem
    kv_write = batch * s.kv_elements_per_token() * kv_elem
    return {"weights": weights, "kv_read": kv_read, "kv_write": kv_write, "total": weights + kv_read + kv_write}


def decode_flops(s: LlamaShape, batch: int, context: int) -> dict[str, float]:
    """FLOPs of one decode step: 2 per matmul weight per sequence; attention q·k and p·v over context + 1 positions."""
    matmul = 2 * s.matmul_params() * batch
    attention = 4 * s.n_layers * s.n_heads * s.d_head * (context + 1) * batch
    return {"matmul": matmul, "attention": attention, "total": matmul + attention}


def prefill_cost(s: LlamaShape, batch: int, prompt: int, elem: int) -> dict[str, float]:
    """Prefill of B prompts of P tokens: weights read once for B·P tokens, causal attention (P(P+1)/2 pairs), the
    cache written."""
    tokens = batch * prompt
    flops = 2 * s.matmul_params() * tokens + 4 * s.n_layers * s.n_heads * s.d_head * batch * prompt * (prompt + 1) / 2
    nbytes = (s.matmul_params() + tokens * s.d_model + (2 * s.n_layers + 1) * s.d_model) * elem \
        + tokens * s.kv_elements_per_token() * elem
    return {"flops": flops, "bytes": nbytes}


def roofline_time(flops: float, nbytes: float, peak: float, bandwidth: float) -> dict[str, float]:
    """The roofline's time: the longer of computing at peak and moving the bytes at full bandwidth."""
    t_compute, t_memory = flops / peak, nbytes / bandwidth
    return {"seconds": max(t_compute, t_memory), "compute_s": t_compute, "memory_s": t_memory,
            "bound": "memory" if t_memory >= t_compute else "compute"}


def tiny_shape(d_model: int, n_layers: int, vocab: int, n_heads: int, n_kv_heads: int, d_ff: int) -> LlamaShape:
    return LlamaShape(f"tiny LLaMA d={d_model}", vocab, d_model, n_layers, n_heads, n_kv_heads, d_ff, "built here")


class BatchedDecoder:
    """A batched decode step over a TinyDecoder's own weights (GQA variant): B sequences, one new token each, every
    weight matrix multiplied once by the (B, d) activations. The cache is (L, B, n_kv, max_len, d_h) for K and V, so
    each query group attends to its K/V head in place (no copy per query head)."""

    def __init__(self, model, batch: int, max_len: int):
        s = model.shape
        self.model, self.batch, self.n_heads, self.n_kv, self.d_head = model, batch, s.n_heads, s.n_kv_heads, s.d_head
        dtype = model.embed.weight.dtype
        self.k = torch.zeros(s.n_layers, batch, s.n_kv_heads, max_len, s.d_head, dtype=dtype)
        self.v = torch.zeros_like(self.k)
        self.length = 0

    def cache_tensors(self) -> list[torch.Tensor]:
        return [self.k, self.v]

    def cache_bytes(self, positions: int) -> int:
        """Bytes of the cache tensors' first `positions` tokens."""
        return sum(t[:, :, :, :positions].nbytes for t in self.cache_tensors())

    def fill(self, keys: list[torch.Tensor], values: list[torch.Tensor], length: int) -> None:
        """Load caches computed elsewhere: per layer (B, length, n_kv, d_h)."""
        for layer, (k, v) in enumerate(zip(keys, values)):
            self.k[layer, :, :, :length], self.v[layer, :, :, :length] = k.transpose(1, 2), v.transpose(1, 2)
        self.length = length

    @torch.no_grad()
    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (B,) at position self.length -> logits (B, vocab); writes each layer's K and V at that position."""
        m, pos, b = self.model, self.length, tokens.shape[0]
        group = self.n_heads // self.n_kv
        cos, sin = rope_angles(torch.tensor([pos]), self.d_head, dtype=self.k.dtype)
        x = m.embed(tokens)                                                              # (B, d)
        for layer, block in enumerate(m.blocks):
            a, h = block.attn, block.attn_norm(x)
            q = apply_rope(a.wq(h).view(b, self.n_kv, group, self.d_head), cos, sin)      # (B, n_kv, group, d_h)
            self.k[layer, :, :, pos] = apply_rope(a.wk(h).view(b, self.n_kv, 1, self.d_head), cos, sin)[:, :, 0]
            self.v[layer, :, :, pos] = a.wv(h).view(b, self.n_kv, self.d_head)
            keys, vals = self.k[layer, :, :, :pos + 1], self.v[layer, :, :, :pos + 1]     # (B, n_kv, c+1, d_h)
            p = torch.softmax(q @ keys.transpose(-1, -2) / math.sqrt(self.d_head), dim=-1)  # (B, n_kv, group, c+1)
            x = x + a.wo((p @ vals).reshape(b, -1))
            x = x + block.ffn(block.ffn_norm(x))
        self.length = pos + 1
        return m.head(m.norm(x))


def prefill_cache_check(model, context: int, batch: int = 2, seed: int = 3) -> Check:
    """The batched step against the model itself: prompts prefilled through the model's own cached forward, loaded
    into a BatchedDecoder, one step taken; its logits must equal the model's uncached forward over prompt + token."""
    g = torch.Generator().manual_seed(seed)
    seqs = torch.randint(0, model.shape.vocab, (batch, context + 1), generator=g)
    keys, vals = [[] for _ in model.blocks], [[] for _ in model.blocks]
    with torch.no_grad():
        for seq in seqs:
            caches = model.new_caches(context)
            model(seq[:context], 0, caches)
            for layer, c in enumerate(caches):
                keys[layer].append(c.tensors["k"][:context])
                vals[layer].append(c.tensors["v"][:context])
        full = torch.stack([model(seq)[-1] for seq in seqs])
    dec = BatchedDecoder(model, batch, context + 1)
    dec.fill([torch.stack(k) for k in keys], [torch.stack(v) for v in vals], context)
    got = dec.step(seqs[:, context])
    err = float((got - full).abs().max() / full.abs().max())
    return Check(f"the batched decode step's logits = the model's own forward ({batch} sequences, context {context})",
                 err, 1e-4, reference="TinyDecoder's uncached forward over the whole sequence, one sequence at a time",
                 detail=f"max |Δ| relative to max |logit|: {err:.2e}")
