"""Rotary position embedding (RoPE), applied to queries and keys only.

Pairs of channels (i, i + d/2) are rotated by angle m·θ_i, θ_i = base^(-2i/d), at position m.
Because rotations compose, <R_m q, R_n k> = <q, R_(n-m) k>: the score depends on m - n only.
"""
from __future__ import annotations

import torch


def rope_angles(positions: torch.Tensor, dim: int, base: float = 10000.0, dtype=torch.float32):
    if dim % 2:
        raise ValueError(f"RoPE needs an even dimension, got {dim}")
    inv_freq = base ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    return torch.cos(angles).to(dtype), torch.sin(angles).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (..., seq, dim); cos/sin: (seq, dim/2)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def relative_position_error(dim: int = 16, offsets=(0, 1, 5, 17), positions=(0, 3, 50, 400), seed: int = 0) -> float:
    """max over offsets d of the spread of <R_m q, R_(m+d) k> across m: zero if scores depend on m - n only."""
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(dim, generator=g, dtype=torch.float64), torch.randn(dim, generator=g, dtype=torch.float64)
    worst = 0.0
    for d in offsets:
        scores = []
        for m in positions:
            cos, sin = rope_angles(torch.tensor([m, m + d]), dim, dtype=torch.float64)
            qm = apply_rope(q[None], cos[:1], sin[:1])[0]
            kn = apply_rope(k[None], cos[1:], sin[1:])[0]
            scores.append(float(qm @ kn))
        worst = max(worst, max(scores) - min(scores))
    return worst
