"""Native sparse attention (NSA, DeepSeek 2025; seed 003): each query attends through three branches and
gates their sum, reading a small part of the KV cache instead of all of it.

Seed 003 likens it to reading a long text: skim it (compressed blocks), read the marked paragraphs
closely (the top-n blocks the skim scored highest), and read around where you are (a sliding window).
- compressed: blocks of `cmp_block` keys every `cmp_stride` tokens, each squeezed to one key and one value
  by φ (mean of token + intra-block position embedding, then a linear map); attended causally (a block
  is visible once its last token is).
- selected: the paper's rule (Yuan et al. 2025, eqs. 8-11). The compressed attention probabilities p_cmp,
  summed over the query heads of a GQA group (eq. 10: a group shares one selection and reads one set of KV
  blocks, as the seed notes), scored onto blocks of `sel_block` raw tokens by eq. 9 (each compressed block
  that overlaps a selection block counts once per stride-chunk of it inside that block), and the top-n
  visible blocks (eq. 11), always with the first block and the `local_blocks` latest (the query's own and
  the one before it in the paper), gathered and attended causally.
- window: the last `window` tokens.
- gates: sigmoid of a linear map of the query, one per branch: o = Σ_c g_c · attention_c.
Everything is gathered: the selected and window branches touch only the rows they index, which is what
`kv_rows_read` counts. The selected branch can also run as a Triton kernel (kernels/nsa_selected.py) that
counts the bytes it loads. `masked_dense_reference` computes the same three branches as dense attention
over all keys with boolean masks (torch SDPA), the independent check.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kernels.nsa_selected import selected_attention, selected_reference

BRANCHES = ("compressed", "selected", "window")


def make_params(d: int, cmp_block: int, generator: torch.Generator) -> dict:
    """φ's position embedding and linear maps, and the gate: fixed random weights (no training here)."""
    return {"pos": torch.randn(cmp_block, d, generator=generator) * 0.1,
            "w_k": torch.randn(d, d, generator=generator) / math.sqrt(d),
            "w_v": torch.randn(d, d, generator=generator) / math.sqrt(d),
            "w_gate": torch.randn(d, len(BRANCHES), generator=generator) / math.sqrt(d)}


def compress(x, block: int, stride: int, pos, w):
    """x: (G, N, d) -> one vector per block of `block` tokens every `stride`: (G, n_blocks, d)."""
    blocks = x.unfold(1, block, stride).transpose(-1, -2)   # (G, n_blocks, block, d)
    return (blocks + pos).mean(2) @ w


def _softmax_visible(scores, visible):
    """Softmax over the visible keys only; a row with none gives zeros (it reads nothing)."""
    return torch.softmax(scores.masked_fill(~visible, float("-inf")), -1).nan_to_num(0.0)


def _attend(q, k, v, visible):
    """q: (G, h, N, d); k, v: (G, N, keys, d), gathered per query; visible: (G, N, keys)."""
    p = _softmax_visible(torch.einsum("ghnd,gnkd->ghnk", q, k) / math.sqrt(q.shape[-1]), visible[:, None])
    return torch.einsum("ghnk,gnkd->ghnd", p, v)


def selection_weights(n_cmp: int, cmp_block: int, cmp_stride: int, sel_block: int, n_sel: int) -> torch.Tensor:
    """(n_cmp, n_sel): how often compressed block i is counted for selection block j by NSA's eq. 9,
    p_slc[j] = Σ_{m < l'/d} Σ_{n < l/d} p_cmp[(l'/d)·j − m − n] (l = cmp_block, d = cmp_stride, l' = sel_block),
    its index counted from block j's last stride-chunk, (l'/d)(j + 1) − 1 − m − n, so that the sum covers the
    compressed blocks that overlap block j (counted from its first chunk, as printed, it would score block j mostly
    with the blocks before it; Lai's NSA Triton reference, transform_score, sums the overlapping ones). The pairs
    (m, n) that land on block i are its stride-chunks inside block j: the weight is the overlap in tokens / d,
    l/d for one wholly inside, less for one straddling an edge."""
    starts = torch.arange(n_cmp)[:, None] * cmp_stride
    sel_starts = torch.arange(n_sel)[None, :] * sel_block
    inside = torch.minimum(starts + cmp_block, sel_starts + sel_block) - torch.maximum(starts, sel_starts)
    return (inside.clamp(min=0) // cmp_stride).to(torch.float32)


def select_blocks(p_cmp, n: int, cmp_block: int, cmp_stride: int, sel_block: int, top_n: int, local_blocks: int = 2):
    """p_cmp: (G, h, N, n_cmp) compressed attention. Returns the chosen selection blocks (G, N, top_n), which of
    them are real (G, N, top_n), and the importance per selection block (G, N, n_sel): eq. 9 summed over the
    group's heads (eq. 10); the first block and the `local_blocks` latest forced in, the rest by importance."""
    n_cmp, n_sel = p_cmp.shape[-1], -(-n // sel_block)
    if top_n < min(n_sel, 1 + local_blocks):
        raise ValueError(f"top_n={top_n} cannot hold the first block and {local_blocks} local blocks")
    weights = selection_weights(n_cmp, cmp_block, cmp_stride, sel_block, n_sel).to(p_cmp.dtype)
    importance = p_cmp.sum(1) @ weights                         # summed over the group's heads: one choice per group
    sel_starts = torch.arange(n_sel) * sel_block
    t = torch.arange(n)[:, None]
    behind = t // sel_block - torch.arange(n_sel)[None, :]      # blocks between the query's own and block j
    forced = (sel_starts[None, :] == 0) | ((behind >= 0) & (behind < local_blocks))
    score = importance.masked_fill(forced, float("inf")).masked_fill(sel_starts[None, :] > t, float("-inf"))
    top = score.topk(min(top_n, n_sel), dim=-1)
    return top.indices, top.values > float("-inf"), importance


def nsa_attention(q, k, v, params, cmp_block=16, cmp_stride=8, sel_block=32, top_n=4, window=64, local_blocks=2,
                  selected_counters=None):
    """q: (H, N, d); k, v: (G, N, d) with H a multiple of G. Returns o (H, N, d) and what was chosen and read.
    selected_counters (int64[2]): run the selected branch through the Triton kernel, which counts its K and V bytes."""
    H, n, d = q.shape
    G = k.shape[0]
    qg = q.reshape(G, H // G, n, d)
    t = torch.arange(n)

    kc = compress(k, cmp_block, cmp_stride, params["pos"], params["w_k"])
    vc = compress(v, cmp_block, cmp_stride, params["pos"], params["w_v"])
    ends = torch.arange(kc.shape[1]) * cmp_stride + cmp_block - 1
    cmp_visible = (ends[None, :] <= t[:, None]).expand(G, n, -1)
    p_cmp = _softmax_visible(qg @ kc[:, None].transpose(-1, -2) / math.sqrt(d), cmp_visible[:, None])  # every query, every block
    o_cmp = p_cmp @ vc[:, None]

    blocks, real, importance = select_blocks(p_cmp, n, cmp_block, cmp_stride, sel_block, top_n, local_blocks)
    tokens = (blocks[..., None] * sel_block + torch.arange(sel_block)).flatten(-2)          # (G, N, top_n·sel_block)
    sel_visible = real.repeat_interleave(sel_block, -1) & (tokens <= t[:, None]) & (tokens < n)
    tokens = tokens.clamp(max=n - 1)
    gather = lambda x, idx: torch.stack([x[g][idx[g]] for g in range(G)])  # noqa: E731  (G, N, keys, d)
    if selected_counters is None:
        o_slc = _attend(qg, gather(k, tokens), gather(v, tokens), sel_visible)
    else:
        o_slc = selected_attention(q, k, v, blocks, real, sel_block, selected_counters).reshape(G, H // G, n, d)

    window = min(window, n)                                                                  # no more than the sequence
    win = t[:, None] - window + 1 + torch.arange(window)                                     # (N, window)
    win_visible = (win >= 0).expand(G, n, -1)
    win = win.clamp(min=0).expand(G, n, -1)
    o_win = _attend(qg, gather(k, win), gather(v, win), win_visible)

    gates = torch.sigmoid(q @ params["w_gate"]).reshape(G, H // G, n, len(BRANCHES))
    o = sum(gates[..., i, None] * branch for i, branch in enumerate((o_cmp, o_slc, o_win)))
    rows = {"compressed": cmp_visible.sum(-1), "selected": sel_visible.sum(-1), "window": win_visible.sum(-1)}  # (G, N)
    return o.reshape(H, n, d), {"kc": kc, "vc": vc, "cmp_visible": cmp_visible, "blocks": blocks, "real": real,
                                "sel_tokens": tokens, "sel_visible": sel_visible, "gates": gates.reshape(H, n, -1),
                                "importance": importance, "kv_rows_read": rows,
                                "branch_outputs": {b: o_.reshape(H, n, d) for b, o_ in zip(BRANCHES, (o_cmp, o_slc, o_win))}}


def masked_dense_reference(q, k, v, chosen, sel_block, window):
    """The same three branches as dense attention over every key, each with a boolean mask (torch SDPA), and the
    same gates: no gathering. Masks come from the choices NSA made (which blocks), not from its arithmetic."""
    H, n, d = q.shape
    G = k.shape[0]
    expand = lambda x: x.repeat_interleave(H // G, 0)  # noqa: E731  GQA: each query head sees its group's KV
    t = torch.arange(n)
    dense = lambda keys, values, mask: F.scaled_dot_product_attention(q, expand(keys), expand(values),  # noqa: E731
                                                                       attn_mask=expand(mask)).nan_to_num(0.0)
    o_cmp = dense(chosen["kc"], chosen["vc"], chosen["cmp_visible"])
    o_slc = selected_reference(q, k, v, chosen["blocks"], chosen["real"], sel_block)
    win_mask = ((t[:, None] - t[None, :] >= 0) & (t[:, None] - t[None, :] < window)).expand(G, n, n)
    o_win = dense(k, v, win_mask)
    g = chosen["gates"]
    return g[..., 0, None] * o_cmp + g[..., 1, None] * o_slc + g[..., 2, None] * o_win


def closed_form_rows(n: int, cmp_block: int, cmp_stride: int, sel_block: int, top_n: int, window: int) -> dict:
    """KV rows each query t reads per branch, from the block geometry alone: the visible compressed blocks; the
    selected blocks' tokens up to t (the query's own block is partial, the others lie wholly before it); the window."""
    t = torch.arange(n)
    n_cmp = (n - cmp_block) // cmp_stride + 1
    visible_sel = t // sel_block + 1
    selected = torch.where(visible_sel <= top_n, t + 1, (top_n - 1) * sel_block + t % sel_block + 1)
    return {"compressed": ((t - cmp_block + 1).clamp(min=-1) // cmp_stride + 1).clamp(max=n_cmp),
            "selected": selected, "window": (t + 1).clamp(max=window)}


def kv_bytes_per_query(rows: dict, d: int, elem: int) -> dict:
    """Bytes of K and V each query reads per branch (mean over queries and at the last one) and full causal attention's."""
    n = next(iter(rows.values())).shape[-1]
    out = {}
    for name, r in rows.items():
        out[f"{name}_mean"] = 2 * d * elem * r.float().mean().item()
        out[f"{name}_last"] = 2 * d * elem * r[..., -1].float().mean().item()
    out["nsa_mean"] = sum(out[f"{b}_mean"] for b in BRANCHES)
    out["nsa_last"] = sum(out[f"{b}_last"] for b in BRANCHES)
    out["full_mean"] = 2 * d * elem * (n + 1) / 2
    out["full_last"] = 2 * d * elem * n
    return out
