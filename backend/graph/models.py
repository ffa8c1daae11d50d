"""The functions the fusion experiment captures, with their inputs (fp32, seeded)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

MODELS = ("ln_gelu", "mlp", "attention", "block")


def model(name: str, rows: int, width: int):
    g = torch.Generator().manual_seed(0)

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=g) * scale

    if name == "ln_gelu":
        def fn(x, w, b):
            return F.gelu(F.layer_norm(x, (width,), w, b))
        return fn, [randn(rows, width), randn(width), randn(width)]
    if name == "mlp":
        def fn(x, w1, w2):
            return F.gelu(x @ w1) @ w2
        return fn, [randn(rows, width), randn(width, 2 * width, scale=width ** -0.5), randn(2 * width, width, scale=width ** -0.5)]
    if name == "attention":
        def fn(q, k, v):
            return torch.softmax(q @ k.T / width ** 0.5, dim=-1) @ v
        return fn, [randn(rows, width) for _ in range(3)]
    if name == "block":  # pre-norm transformer block, one head, no mask
        def fn(x, wqkv, wo, w1, w2):
            h = F.layer_norm(x, (width,))
            q, k, v = (h @ wqkv).split(width, dim=-1)
            x = x + torch.softmax(q @ k.T / width ** 0.5, dim=-1) @ v @ wo
            return x + F.gelu(F.layer_norm(x, (width,)) @ w1) @ w2
        s = width ** -0.5
        return fn, [randn(rows, width), randn(width, 3 * width, scale=s), randn(width, width, scale=s),
                    randn(width, 4 * width, scale=s), randn(4 * width, width, scale=s * 0.5)]
    raise ValueError(f"unknown model {name!r}")
