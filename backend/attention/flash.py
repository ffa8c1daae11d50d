"""FlashAttention's algorithm in PyTorch (tiled, for long sequences on a CPU) and its IO model. The Triton
kernels and the references (naive attention, torch SDPA) live together in kernels/flash_attention.py.

`online_softmax_update` is the step the tiled path and the seed's worked example share: given the
running max m, running sum l and unnormalised output acc, fold in one block of scores.
"""
from __future__ import annotations

import math

import torch


def online_softmax_update(m, l, acc, scores, values):
    """m, l: (rows,); acc: (rows, d); scores: (rows, cols) of the new block; values: (cols, d)."""
    m_new = torch.maximum(m, scores.max(dim=-1).values)
    alpha = torch.exp(m - m_new)
    p = torch.exp(scores - m_new[:, None])
    return m_new, l * alpha + p.sum(-1), acc * alpha[:, None] + p @ values, p, alpha


# Seed 000 (FlashAttention, tiling: "举例：分为2块计算, x1 = [1,2], x2 = [3,4]"), its figures as it writes them, each
# e^k given by its exponent k: the running max after each block, each block's f under that max, the factor
# e^(m(x1) - m(x)) that rescales the first block, and the whole f(x) and l(x).
SEED_000_ONLINE_SOFTMAX = {
    "blocks": ((1.0, 2.0), (3.0, 4.0)),
    "m": (2.0, 4.0),                                  # m(x1) = 2, then m(x) = max(m(x1), m(x2)) = 4
    "f_block_exponents": ((-1, 0), (-1, 0)),          # f(x1) = [e^-1, e^0], f(x2) = [e^-1, e^0]
    "rescale_exponent": -2,                           # e^(m(x1) - m(x)) = e^-2
    "f_exponents": (-3, -2, -1, 0),                   # f(x) = [e^-2 (e^-1, e^0), e^0 (e^-1, e^0)]
    "l_exponents": (-3, -2, -1, 0),                   # l(x) = e^-3 + e^-2 + e^-1 + e^0
}


def online_softmax_example(blocks=SEED_000_ONLINE_SOFTMAX["blocks"]) -> list[dict]:
    """Seed 000's example: softmax of [1, 2, 3, 4] in blocks [1, 2] and [3, 4], step by step.
    Values are the identity, so acc is the unnormalised softmax f(x) itself."""
    x = torch.tensor([v for b in blocks for v in b], dtype=torch.float64)
    n = len(x)
    m = torch.tensor([-math.inf], dtype=torch.float64)
    l = torch.zeros(1, dtype=torch.float64)
    acc = torch.zeros(1, n, dtype=torch.float64)
    steps, start = [], 0
    for b in blocks:
        cols = torch.arange(start, start + len(b))
        values = torch.eye(n, dtype=torch.float64)[cols]
        m_old = m.clone()
        m, l, acc, p, alpha = online_softmax_update(m, l, acc, x[cols][None], values)
        steps.append({"block": list(b), "m_before": float(m_old), "m": float(m), "rescale_exp(m_old-m)": float(alpha),
                      "f_block": p[0].tolist(), "l": float(l), "f_so_far": acc[0].tolist()})
        start += len(b)
    softmax = (acc[0] / l).tolist()
    steps.append({"block": "final", "m": float(m), "l": float(l), "f": acc[0].tolist(), "softmax": softmax,
                  "reference_softmax": torch.softmax(x, 0).tolist(),
                  "l_closed_form": sum(math.exp(v - 4.0) for v in x.tolist())})
    return steps


def online_softmax_seed_error(steps: list[dict], tolerance: float = 1e-12) -> tuple[float, str]:
    """The largest difference between the run's worked example and seed 000's figures (and torch.softmax), and
    which figures disagree by more than the tolerance."""
    seed, final = SEED_000_ONLINE_SOFTMAX, steps[-1]
    exp = lambda ks: [math.exp(k) for k in ks]  # noqa: E731
    pairs = [(f"m after block {i + 1}", [s["m"]], [seed["m"][i]]) for i, s in enumerate(steps[:-1])]
    pairs += [(f"f(x{i + 1})", s["f_block"], exp(seed["f_block_exponents"][i])) for i, s in enumerate(steps[:-1])]
    pairs += [("e^(m(x1) - m(x))", [steps[1]["rescale_exp(m_old-m)"]], exp([seed["rescale_exponent"]])),
              ("f(x)", final["f"], exp(seed["f_exponents"])), ("l(x)", [final["l"]], [sum(exp(seed["l_exponents"]))]),
              ("softmax against torch.softmax", final["softmax"], final["reference_softmax"])]
    errors = [(max(abs(a - b) for a, b in zip(mine, theirs)) if len(mine) == len(theirs) else math.inf, name)
              for name, mine, theirs in pairs]
    wrong = [name for error, name in errors if not error <= tolerance]
    return max(error for error, _ in errors), f"{len(pairs)} figures compared" + (f"; differ: {', '.join(wrong)}" if wrong else "")


def tiled_attention(q, k, v, causal=False, block_m=64, block_n=64, on_step=None):
    """FlashAttention's algorithm in PyTorch: O(N·d) memory beyond the inputs. q, k, v: (N, d) or (..., N, d)
    handled per leading index. on_step(i, j, m, l) is called after each (Q tile, K/V tile) step."""
    if q.dim() > 2:
        outs = [tiled_attention(a, b, c, causal, block_m, block_n, on_step) for a, b, c in
                zip(q.reshape(-1, *q.shape[-2:]), k.reshape(-1, *k.shape[-2:]), v.reshape(-1, *v.shape[-2:]))]
        return torch.stack(outs).reshape(q.shape)
    n, d = q.shape
    scale = 1.0 / math.sqrt(d)
    out = torch.empty_like(q)
    for i in range(0, n, block_m):
        qi = q[i:i + block_m].float() * scale
        rows = qi.shape[0]
        m = torch.full((rows,), -math.inf)
        l = torch.zeros(rows)
        acc = torch.zeros(rows, d)
        hi = min(n, i + block_m) if causal else n
        for j in range(0, hi, block_n):
            s = qi @ k[j:j + block_n].float().T
            if causal:
                r = torch.arange(i, i + rows)[:, None]
                c = torch.arange(j, j + s.shape[1])[None, :]
                s = s.masked_fill(c > r, -math.inf)
            m, l, acc, _, _ = online_softmax_update(m, l, acc, s, v[j:j + block_n].float())
            if on_step:
                on_step(i // block_m, j // block_n, m, l)
        out[i:i + block_m] = (acc / l[:, None]).to(q.dtype)
    return out


def io_model(n: int, d: int, elem: int, block_m: int, block_n: int, batch_heads: int = 1, causal: bool = False) -> dict:
    """HBM traffic models (bytes): standard attention Θ(Nd + N²) and FlashAttention Θ(N²d²/M), where M is
    the on-chip bytes one tile step holds (Q tile, K and V tiles, the S/P tile, the accumulator, m and l)."""
    sram = (block_m * d + 2 * block_n * d) * elem + block_m * block_n * 4 + block_m * d * 4 + 2 * block_m * 4
    standard = batch_heads * (4 * n * d * elem + 4 * n * n * elem)  # Q, K, V, O once; S and P written and read
    kv_passes = math.ceil(n / block_m) * (0.5 if causal else 1.0)
    flash = batch_heads * (2 * n * d * elem + 2 * kv_passes * n * d * elem)
    return {"sram_bytes_per_step": sram, "standard_bytes": standard, "flash_bytes": int(flash),
            "flash_theta_N2d2_over_M": batch_heads * n * n * d * d * elem / sram}


def sram_budget(sram_bytes: int, d: int, elem: int) -> dict:
    """Seed 003 / FlashAttention's Algorithm 1: with M words of SRAM, Bc = ⌈M / 4d⌉ (room for the Q, K, V and O
    tiles) and Br = min(Bc, d); then the words on chip at each of the seed's eleven steps of one (K/V tile, Q tile)
    iteration, each step's change counted from the tile shapes (Q_i, O_i: Br x d; K_j, V_j: Bc x d; S, P̃: Br x Bc;
    m, l and their updates: Br each). Returns Br, Bc and the steps (what, change, live words after it)."""
    M = sram_bytes // elem
    bc = math.ceil(M / (4 * d))
    br = min(bc, d)
    steps, live = [], 0

    def step(what, delta):
        nonlocal live
        live += delta
        steps.append({"step": len(steps) + 1, "what": what, "delta_words": delta, "live_words": live, "live_bytes": live * elem})

    step("load K_j, V_j (Bc x d each)", 2 * bc * d)
    step("load Q_i, O_i (Br x d each) and l_i, m_i (Br each)", 2 * br * d + 2 * br)
    step("S = Q_i K_jᵀ (Br x Bc)", br * bc)
    step("release Q_i and K_j", -(br * d + bc * d))
    step("m̃ = rowmax(S), P̃ = exp(S - m̃)", br + br * bc)
    step("release S", -br * bc)
    step("l̃ = rowsum(P̃)", br)
    step("m_new, l_new", 2 * br)
    step("O_i = diag(l_new)⁻¹(diag(l)e^(m-m_new) O_i + e^(m̃-m_new) P̃ V_j) in place, stored; release O_i", -br * d)
    step("store l_new, m_new", -2 * br)
    step("release the rest: V_j, P̃, m̃, l̃, l_i, m_i", -(bc * d + br * bc + 4 * br))
    return {"sram_words": M, "Br": br, "Bc": bc, "steps": steps, "peak_words": max(s["live_words"] for s in steps)}
