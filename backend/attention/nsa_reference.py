"""NSA's block selection computed straight from the paper's definitions (Yuan et al. 2025, eqs. 7-11), one query
at a time in float64, sharing no code with backend/attention/nsa.py: the independent check of its selection.

For query t of KV group g: the compressed keys φ(k_{id : id+l}) (mean of each token plus its intra-block position
embedding, then W_k) for the blocks wholly at or before t (eq. 7); p_cmp = softmax(q_h · K_cmp / √d_h) for each
head h of the group (eq. 8), summed over the group's heads (eq. 10); p_slc[j] = Σ_m Σ_n p_cmp[(l'/d)(j+1) − 1 − m − n]
over m < l'/d, n < l/d (eq. 9, the index counted from block j's last stride-chunk); the first block and the
`local_blocks` latest forced in, then the highest p_slc among the visible blocks until top_n (eq. 11).
"""
from __future__ import annotations

import math

import torch


def compressed_keys(k: torch.Tensor, pos: torch.Tensor, w_k: torch.Tensor, cmp_block: int, cmp_stride: int) -> list[torch.Tensor]:
    """Per group, the list of compressed keys of every whole block, in float64, block by block."""
    k, pos, w_k = k.double(), pos.double(), w_k.double()
    n = k.shape[1]
    out = []
    for kg in k:
        keys = []
        i = 0
        while i * cmp_stride + cmp_block <= n:
            start = i * cmp_stride
            keys.append(sum(kg[start + r] + pos[r] for r in range(cmp_block)) / cmp_block @ w_k)
            i += 1
        out.append(keys)
    return out


def select(q: torch.Tensor, k: torch.Tensor, params: dict, cmp_block: int, cmp_stride: int, sel_block: int, top_n: int,
           local_blocks: int, queries: list[int]) -> tuple[list[dict], list[dict], list[dict]]:
    """q: (H, N, d), k: (G, N, d). Per group, for each query in `queries`: the chosen selection blocks, those of
    them forced in, and p_slc of each selection block up to the query's own."""
    H, _, d = q.shape
    G = k.shape[0]
    per = H // G
    q = q.double()
    kc = compressed_keys(k, params["pos"], params["w_k"], cmp_block, cmp_stride)
    chunks, span = sel_block // cmp_stride, cmp_block // cmp_stride
    chosen, forced_in, scores = [], [], []
    for g in range(G):
        chosen.append({})
        forced_in.append({})
        scores.append({})
        for t in queries:
            visible = [i for i in range(len(kc[g])) if i * cmp_stride + cmp_block - 1 <= t]
            p = [0.0] * len(visible)
            for h in range(g * per, (g + 1) * per):
                logits = [float(q[h, t] @ kc[g][i]) / math.sqrt(d) for i in visible]
                top = max(logits, default=0.0)
                e = [math.exp(x - top) for x in logits]
                for i, x in enumerate(e):
                    p[i] += x / sum(e)
            own = t // sel_block
            p_slc = []
            for j in range(own + 1):
                total = 0.0
                for m in range(chunks):
                    for nn in range(span):
                        i = chunks * (j + 1) - 1 - m - nn
                        if 0 <= i < len(p):
                            total += p[i]
                p_slc.append(total)
            forced = {0} | {own - a for a in range(local_blocks) if own - a >= 0}
            rest = sorted((j for j in range(own + 1) if j not in forced), key=lambda j: -p_slc[j])
            chosen[g][t] = forced | set(rest[:max(0, top_n - len(forced))])
            forced_in[g][t] = forced
            scores[g][t] = p_slc
    return chosen, forced_in, scores


def selection_differences(blocks: torch.Tensor, real: torch.Tensor, importance: torch.Tensor, reference, tie: float) -> tuple[float, int]:
    """(largest |importance − p_slc| over every visible block, queries whose chosen blocks differ from the reference's:
    a forced block missing, or a block chosen in place of one the reference scores more than `tie` higher).
    reference: select(...)'s (chosen, forced, p_slc)."""
    ref_chosen, ref_forced, ref_scores = reference
    worst, differ = 0.0, 0
    for g in range(len(ref_chosen)):
        for t in ref_chosen[g]:
            ref, want, forced = ref_scores[g][t], ref_chosen[g][t], ref_forced[g][t]
            worst = max(worst, max(abs(float(importance[g, t, j]) - ref[j]) for j in range(len(ref))))
            got = {int(b) for b, r in zip(blocks[g, t], real[g, t]) if r}
            if got == want:
                continue
            extra, missing = got - want, want - got
            if len(got) != len(want) or missing & forced or min(ref[j] for j in extra) < max(ref[j] for j in missing) - tie:
                differ += 1
    return worst, differ
