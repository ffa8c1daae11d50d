"""Why RoPE breaks MLA's weight absorption, and how decoupled RoPE fixes it (seeds 000 and 003), in float64.

MLA caches the latent c_KV = W^DKV h and folds W^UK into the query: q^T k = (W^UQ c_Q)^T (W^UK c_KV)
= c_Q^T (W^UQ^T W^UK) c_KV, one merged matrix. With RoPE on the keys, the naive score is
    (R_m W^UQ c_Q)^T (R_n W^UK c_KV) = c_Q^T W^UQ^T R_(n-m) W^UK c_KV,
whose middle depends on n - m, so no single W_merge exists. Seed 000's absorbed attempt rotates the latents,
(R_m c_Q)^T W_merge (R_n c_KV), which is not that product because matrices do not commute: it equals the
naive score only at m = n = 0 (R_0 = I). Decoupled RoPE keeps the compressed path rotation-free and adds a
small rotated part shared by the heads, k = [W^UK c_KV; R_n W^KR h], q = [W^UQ c_Q; R_m W^QR c_Q]; the absorbed
form caches (c_KV, k^R) and scores c_Q^T W_merge c_KV + q^R . k^R, equal to the naive one up to rounding.
"""
from __future__ import annotations

import torch

from backend.attention.rope import apply_rope, rope_angles


def weights(d_model: int, d_c: int, d_cq: int, n_heads: int, d_head: int, d_rope: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64) / shape[-1] ** 0.5  # noqa: E731
    return {"dkv": w(d_c, d_model), "dq": w(d_cq, d_model), "uk": w(n_heads, d_head, d_c), "uq": w(n_heads, d_head, d_cq),
            "kr": w(d_rope, d_model), "qr": w(n_heads, d_rope, d_cq)}


def rotate(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """RoPE over the last dimension of x (..., T, d) at the given positions."""
    cos, sin = rope_angles(positions, x.shape[-1], dtype=torch.float64)
    return apply_rope(x, cos, sin)


def compressed_key(W: dict, c_kv: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The per-head key from the latent, (h, T, d_h): W^UK c_KV, no rotation (decoupled RoPE keeps this path plain)."""
    return torch.einsum("hdc,tc->htd", W["uk"], c_kv)


def scores(W: dict, h: torch.Tensor, path: str, form: str) -> torch.Tensor:
    """Attention logits (heads, T, T) of every query position m against every key position n.
    path: 'compressed' (RoPE on W^UK c_KV and W^UQ c_Q) or 'decoupled'; form: 'naive' or 'absorbed'."""
    pos = torch.arange(h.shape[0])
    c_kv, c_q = h @ W["dkv"].T, h @ W["dq"].T                    # (T, d_c), (T, d_cq): what MLA caches / computes
    merge = torch.einsum("hdq,hdc->hqc", W["uq"], W["uk"])        # W^UQ_i^T W^UK_i, per head (d_cq, d_c)
    if path == "compressed":
        if form == "naive":
            q = rotate(torch.einsum("hdq,tq->htd", W["uq"], c_q), pos)
            k = rotate(torch.einsum("hdc,tc->htd", W["uk"], c_kv), pos)
            return q @ k.transpose(1, 2)
        return torch.einsum("mq,hqc,nc->hmn", rotate(c_q, pos), merge, rotate(c_kv, pos))  # seed 000's (R_m c_Q)^T W_merge (R_n c_KV)
    q_r = rotate(torch.einsum("hrq,tq->htr", W["qr"], c_q), pos)    # (h, T, d_rope)
    k_r = rotate((h @ W["kr"].T)[None], pos)[0]                     # (T, d_rope), shared by the heads, cached
    if form == "naive":
        q = torch.cat([torch.einsum("hdq,tq->htd", W["uq"], c_q), q_r], dim=-1)
        k = torch.cat([compressed_key(W, c_kv, pos), k_r[None].expand(len(W["uk"]), -1, -1)], dim=-1)
        return q @ k.transpose(1, 2)
    return torch.einsum("mq,hqc,nc->hmn", c_q, merge, c_kv) + q_r @ k_r.T


def absorption_errors(T: int = 32, d_model: int = 64, d_c: int = 16, d_cq: int = 24, n_heads: int = 4, d_head: int = 16,
                      d_rope: int = 8, seed: int = 0) -> dict:
    """Absorbed against naive scores for both RoPE paths: per query position the largest |difference| (causal: n <= m),
    relative to the largest naive score."""
    W = weights(d_model, d_c, d_cq, n_heads, d_head, d_rope, seed)
    h = torch.randn(T, d_model, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    out, rows = {}, []
    for path in ("compressed", "decoupled"):
        naive, absorbed = scores(W, h, path, "naive"), scores(W, h, path, "absorbed")
        gap = ((absorbed - naive).abs() * causal).amax(dim=(0, 2))  # per query position m
        scale = (naive.abs() * causal).max().item()
        out[path] = {"max_abs": gap.max().item(), "relative": gap.max().item() / scale, "at_origin": gap[0].item(), "scale": scale}
        rows += [{"path": path, "query_position": m, "max_abs_error": e, "relative_error": e / scale} for m, e in enumerate(gap.tolist())]
    out["rows"] = rows
    return out
