"""Attention variants and the KV cache each one keeps.

- GroupedQueryAttention: n_kv_heads K/V heads shared by groups of query heads. n_kv_heads = n_heads is
  MHA, 1 is MQA, anything between is GQA. Caches K and V: 2·n_kv·d_h elements per token per layer.
- MultiHeadLatentAttention (DeepSeek-V2/V3): K and V come from one latent c_KV = W^DKV h (d_c); keys
  k^C = W^UK c_KV, values v = W^UV c_KV; queries from their own latent c_Q = W^DQ h; RoPE goes on a
  separate key k^R = RoPE(W^KR h) (d_rope, shared by the heads) and query part q^R = RoPE(W^QR c_Q),
  because RoPE between q and W^UK would stop W^UK folding into the query.
    naive:    expand, then attend; caches per-head K = [k^C; k^R] and V: n_h·(2·d_h + d_rope) elements.
    absorbed: caches only c_KV and k^R: d_c + d_rope elements. W^UK folds into the query
              (q^C·k^C = (W^UK_i^T q^C_i)·c_KV) and W^UV into the output (Σ p·W^UV c = W^UV Σ p·c).
Each cache is a set of preallocated tensors; `bytes_per_token()` is read off those tensors.
"""
from __future__ import annotations

import functools
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from backend.attention.rope import apply_rope, rope_angles


class KVCache:
    """Named per-token tensors of shape (max_len, ...) filled up to `length`."""

    def __init__(self, max_len: int, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype):
        self.tensors = {name: torch.zeros(max_len, *shape, dtype=dtype) for name, shape in shapes.items()}
        self.length = 0

    def append(self, start: int, **values: torch.Tensor) -> dict[str, torch.Tensor]:
        end = start + next(iter(values.values())).shape[0]
        for name, v in values.items():
            self.tensors[name][start:end] = v
        self.length = end
        return {name: t[:end] for name, t in self.tensors.items()}

    def bytes_per_token(self) -> int:
        return sum(t[0].numel() * t.element_size() for t in self.tensors.values())

    def bytes_used(self) -> int:
        return self.length * self.bytes_per_token()


def _attend(q, k, v, causal_offset: int):
    """q: (h, t, d), k/v: (h, s, d'); position of query i is causal_offset + i."""
    t, s = q.shape[1], k.shape[1]
    mask = torch.ones(t, s, dtype=torch.bool).tril(diagonal=causal_offset)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@functools.lru_cache(maxsize=16)
def _whole_rope(s: int, d_head: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return rope_angles(torch.arange(s), d_head, dtype=dtype)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(QKᵀ/√d + causal)·V over (b, heads, s, d), k and v already repeated over their GQA groups: the core
    whose a·s²·b scores Korthikanti's selective recompute drops."""
    s = q.shape[-2]
    causal = torch.full((s, s), float("-inf"), dtype=q.dtype).triu(1)
    return torch.softmax(q @ k.transpose(-1, -2) * (1 / math.sqrt(q.shape[-1])) + causal, dim=-1) @ v


class CausalCore:
    """The batched training path's attention over whole sequences: positions 0..s-1 (one RoPE table shared by the
    layers), the causal softmax written out rather than SDPA, so that what backward saves is the textbook list
    (q and k after RoPE, v, each repeated over its GQA group, and the s x s softmax) that
    backend/parallel/sp.activation_elements counts. Context parallel puts a ring over sequence shards in its place
    (backend/parallel/cp.py: SequenceShard, the same two methods)."""

    def rope(self, s: int, d_head: int, dtype: torch.dtype):
        return _whole_rope(s, d_head, dtype)

    def attend(self, q, k, v):
        """q (b, heads, s, d), k and v (b, kv_heads, s, d) -> (b, heads, s, d)."""
        group = q.shape[1] // k.shape[1]
        return self.core(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1))

    core = staticmethod(causal_attention)  # what selective recompute (backend/parallel/recompute.py) replaces


class GroupedQueryAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int, d_head: int):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.d_head = n_heads, n_kv_heads, d_head
        self.wq = nn.Linear(d_model, n_heads * d_head, bias=False)
        self.wk = nn.Linear(d_model, n_kv_heads * d_head, bias=False)
        self.wv = nn.Linear(d_model, n_kv_heads * d_head, bias=False)
        self.wo = nn.Linear(n_heads * d_head, d_model, bias=False)
        self.wqkv: nn.Module | None = None  # one fused q/k/v projection, where tensor parallel installs one
        self.core = CausalCore()

    def new_cache(self, max_len: int, dtype) -> KVCache:
        return KVCache(max_len, {"k": (self.n_kv_heads, self.d_head), "v": (self.n_kv_heads, self.d_head)}, dtype)

    def project(self, x):
        """q, k and v of x (..., d_model): three linears, or the fused one (a column-parallel linear communicates
        its input once for all three: backend/parallel/tp.py)."""
        if self.wqkv is None:
            return self.wq(x), self.wk(x), self.wv(x)
        return self.wqkv(x).split([self.n_heads * self.d_head] + [self.n_kv_heads * self.d_head] * 2, -1)

    def batched(self, x):
        """The training path: x (b, s, d_model) -> (b, s, d_model), RoPE and attention from self.core."""
        q, k, v = self.project(x)
        b, s = q.shape[:2]
        q, k, v = (t.view(b, s, -1, self.d_head).transpose(1, 2) for t in (q, k, v))
        cos, sin = self.core.rope(s, self.d_head, x.dtype)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return self.wo(self.core.attend(q, k, v).transpose(1, 2).reshape(b, s, -1))

    def cache_elements(self) -> int:
        return 2 * self.n_kv_heads * self.d_head

    def forward(self, x, start: int, cache: KVCache | None = None):
        t = x.shape[0]
        cos, sin = rope_angles(torch.arange(start, start + t), self.d_head, dtype=x.dtype)
        q = apply_rope(self.wq(x).view(t, self.n_heads, self.d_head).transpose(0, 1), cos, sin)
        k = apply_rope(self.wk(x).view(t, self.n_kv_heads, self.d_head).transpose(0, 1), cos, sin).transpose(0, 1)
        v = self.wv(x).view(t, self.n_kv_heads, self.d_head)
        if cache is not None and hasattr(cache, "attend"):  # a paged cache attends through its block table
            return self.wo(cache.attend(q, k, v, start).transpose(0, 1).reshape(t, -1))
        if cache is not None:
            kv = cache.append(start, k=k, v=v)
            k, v = kv["k"], kv["v"]
        group = self.n_heads // self.n_kv_heads
        k = k.transpose(0, 1).repeat_interleave(group, dim=0)
        v = v.transpose(0, 1).repeat_interleave(group, dim=0)
        o = _attend(q, k, v, start)
        return self.wo(o.transpose(0, 1).reshape(t, -1))


class MultiHeadLatentAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int, d_head: int, d_c: int, d_rope: int, d_cq: int, absorbed: bool = False):
        super().__init__()
        self.n_heads, self.d_head, self.d_c, self.d_rope, self.absorbed = n_heads, d_head, d_c, d_rope, absorbed
        self.w_dkv = nn.Linear(d_model, d_c, bias=False)          # W^DKV
        self.w_uk = nn.Linear(d_c, n_heads * d_head, bias=False)   # W^UK
        self.w_uv = nn.Linear(d_c, n_heads * d_head, bias=False)   # W^UV
        self.w_kr = nn.Linear(d_model, d_rope, bias=False)         # W^KR (decoupled RoPE key, shared by heads)
        self.w_dq = nn.Linear(d_model, d_cq, bias=False)           # W^DQ
        self.w_uq = nn.Linear(d_cq, n_heads * d_head, bias=False)  # W^UQ
        self.w_qr = nn.Linear(d_cq, n_heads * d_rope, bias=False)  # W^QR
        self.wo = nn.Linear(n_heads * d_head, d_model, bias=False)
        self.scale = 1.0 / math.sqrt(d_head + d_rope)

    def new_cache(self, max_len: int, dtype) -> KVCache:
        if self.absorbed:
            return KVCache(max_len, {"c_kv": (self.d_c,), "k_rope": (self.d_rope,)}, dtype)
        return KVCache(max_len, {"k": (self.n_heads, self.d_head + self.d_rope), "v": (self.n_heads, self.d_head)}, dtype)

    def cache_elements(self) -> int:
        return self.d_c + self.d_rope if self.absorbed else self.n_heads * (2 * self.d_head + self.d_rope)

    def _queries(self, x, cos, sin):
        t, h = x.shape[0], self.n_heads
        c_q = self.w_dq(x)
        q_c = self.w_uq(c_q).view(t, h, self.d_head).transpose(0, 1)                       # (h, t, d_h)
        q_r = apply_rope(self.w_qr(c_q).view(t, h, self.d_rope).transpose(0, 1), cos, sin)  # (h, t, d_rope)
        return q_c, q_r

    def forward(self, x, start: int, cache: KVCache | None = None):
        t, h = x.shape[0], self.n_heads
        cos, sin = rope_angles(torch.arange(start, start + t), self.d_rope, dtype=x.dtype)
        q_c, q_r = self._queries(x, cos, sin)
        c_kv = self.w_dkv(x)                                   # (t, d_c)
        k_r = apply_rope(self.w_kr(x)[None], cos, sin)[0]      # (t, d_rope)
        if self.absorbed:
            if cache is not None:
                got = cache.append(start, c_kv=c_kv, k_rope=k_r)
                c_kv, k_r = got["c_kv"], got["k_rope"]
            w_uk = self.w_uk.weight.view(h, self.d_head, self.d_c)       # k^C_i = W^UK_i c
            q_latent = torch.einsum("htd,hdc->htc", q_c, w_uk)           # W^UK folded into the query
            scores = (torch.einsum("htc,sc->hts", q_latent, c_kv) + torch.einsum("htr,sr->hts", q_r, k_r)) * self.scale
            s = c_kv.shape[0]
            mask = torch.ones(t, s, dtype=torch.bool).tril(diagonal=start)
            p = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
            o_latent = torch.einsum("hts,sc->htc", p, c_kv)               # attend in the latent space
            w_uv = self.w_uv.weight.view(h, self.d_head, self.d_c)
            o = torch.einsum("htc,hdc->htd", o_latent, w_uv)              # W^UV applied once per head
            return self.wo(o.transpose(0, 1).reshape(t, -1))
        k_c = self.w_uk(c_kv).view(t, h, self.d_head)
        k = torch.cat([k_c, k_r[:, None, :].expand(t, h, self.d_rope)], dim=-1)
        v = self.w_uv(c_kv).view(t, h, self.d_head)
        if cache is not None:
            got = cache.append(start, k=k, v=v)
            k, v = got["k"], got["v"]
        q = torch.cat([q_c, q_r], dim=-1)
        o = F.scaled_dot_product_attention(q, k.transpose(0, 1), v.transpose(0, 1),
                                           attn_mask=torch.ones(t, k.shape[0], dtype=torch.bool).tril(diagonal=start),
                                           scale=self.scale)
        return self.wo(o.transpose(0, 1).reshape(t, -1))


def cache_formula_elements(variant: str, n_heads: int, n_kv_heads: int, d_head: int, d_c: int, d_rope: int,
                           n_layers: int, mla_mode: str = "absorbed") -> int:
    """KV-cache elements per token over all layers, as the seeds write them (seed 000/003)."""
    per_layer = {
        "mha": 2 * n_heads * d_head,
        "gqa": 2 * n_kv_heads * d_head,
        "mqa": 2 * d_head,
        "mla": (d_c + d_rope) if mla_mode == "absorbed" else n_heads * (2 * d_head + d_rope),
    }[variant]
    return per_layer * n_layers


def mla_dataflow(n_heads: int, d_head: int, d_c: int, d_rope: int, d_cq: int, d_model: int, absorbed: bool):
    """MLA's dataflow for one token as a networkx DAG; nodes carry shapes, cached tensors are marked."""
    import networkx as nx

    cached = "#ffd9a8"
    g = nx.DiGraph()
    add = lambda n, label, **kw: g.add_node(n, label=label, **kw)  # noqa: E731
    add("h", f"h_t\n[{d_model}]")
    add("c_q", f"c_t^Q = W^DQ h\n[{d_cq}]")
    add("q_c", f"q^C = W^UQ c^Q\n[{n_heads}×{d_head}]")
    add("q_r", f"q^R = RoPE(W^QR c^Q)\n[{n_heads}×{d_rope}]")
    add("c_kv", f"c_t^KV = W^DKV h\n[{d_c}]" + ("\ncached" if absorbed else ""), fillcolor=cached if absorbed else "#f4f6fa")
    add("k_r", f"k^R = RoPE(W^KR h)\n[{d_rope}] shared by heads\ncached", fillcolor=cached)
    add("attn", "softmax(q·k / √(d_h + d_h^R))", shape="ellipse")
    add("out", f"u_t = W^O o\n[{d_model}]")
    for u, v in (("h", "c_q"), ("c_q", "q_c"), ("c_q", "q_r"), ("h", "c_kv"), ("h", "k_r"), ("q_r", "attn"), ("k_r", "attn")):
        g.add_edge(u, v)
    if absorbed:
        add("q_lat", f"q̃ = W^UK_iᵀ q^C\n[{n_heads}×{d_c}]  (W^UK absorbed)")
        add("o_lat", f"ō = Σ p·c^KV\n[{n_heads}×{d_c}]")
        add("o", f"o_i = W^UV_i ō_i\n[{n_heads}×{d_head}]  (W^UV absorbed)")
        for u, v in (("q_c", "q_lat"), ("q_lat", "attn"), ("c_kv", "attn"), ("attn", "o_lat"), ("c_kv", "o_lat"), ("o_lat", "o"), ("o", "out")):
            g.add_edge(u, v)
    else:
        add("k_c", f"k^C = W^UK c^KV\n[{n_heads}×{d_head}]")
        add("k", f"k = [k^C; k^R]\n[{n_heads}×{d_head + d_rope}]\ncached", fillcolor=cached)
        add("v", f"v = W^UV c^KV\n[{n_heads}×{d_head}]\ncached", fillcolor=cached)
        add("o", f"o = Σ p·v\n[{n_heads}×{d_head}]")
        for u, v in (("c_kv", "k_c"), ("k_c", "k"), ("k_r", "k"), ("c_kv", "v"), ("q_c", "attn"), ("k", "attn"),
                     ("attn", "o"), ("v", "o"), ("o", "out")):
            g.add_edge(u, v)
    return g
