"""The routers and the MoE layer again, one token at a time in plain Python (lists, sorted, math.exp): no topk,
scatter, gather, bincount or masks, so agreement with backend/models/moe.py checks those steps.
Each router returns, per token, {expert: weight} for the experts that process it.
"""
from __future__ import annotations

import math
from decimal import Decimal

import torch


def _softmax(row: list[float]) -> list[float]:
    top = max(row)
    e = [math.exp(v - top) for v in row]
    return [v / sum(e) for v in e]


def _best(candidates, key, k: int) -> list:
    return sorted(candidates, key=key, reverse=True)[:k]


def softmax_topk(logits: list[list[float]], k: int, renormalize: bool) -> list[dict[int, float]]:
    out = []
    for row in logits:
        p = _softmax(row)
        chosen = _best(range(len(p)), lambda e: p[e], k)
        total = sum(p[e] for e in chosen) if renormalize else 1.0
        out.append({e: p[e] / total for e in chosen})
    return out


def capacity(tokens: int, k: int, n_experts: int, capacity_factor: float) -> int:
    """The least whole C with C · E >= cf · T · k, cf = m / 10^d as written in decimal: integers only, no floats."""
    m, d = Decimal(repr(float(capacity_factor))).as_integer_ratio()
    return -(-(m * tokens * k) // (d * n_experts))


def switch_top1(logits: list[list[float]], capacity_factor: float) -> list[dict[int, float]]:
    """Tokens in order; a token whose expert is full (capacity(T, 1, E, cf) taken) gets no expert."""
    cap = capacity(len(logits), 1, len(logits[0]), capacity_factor)
    taken = [0] * len(logits[0])
    out = []
    for row in logits:
        p = _softmax(row)
        e = max(range(len(p)), key=lambda i: p[i])
        if taken[e] < cap:
            taken[e] += 1
            out.append({e: p[e]})
        else:
            out.append({})
    return out


def deepseek_v3(logits: list[list[float]], bias: list[float], k: int, n_groups: int, topk_groups: int,
                route_scale: float) -> list[dict[int, float]]:
    size = len(bias) // n_groups
    out = []
    for row in logits:
        score = [1 / (1 + math.exp(-v)) for v in row]
        biased = [s + b for s, b in zip(score, bias)]
        group_score = [sum(_best(biased[g * size:(g + 1) * size], lambda v: v, 2)) for g in range(n_groups)]
        groups = _best(range(n_groups), lambda g: group_score[g], topk_groups)
        candidates = [g * size + j for g in groups for j in range(size)]
        chosen = _best(candidates, lambda e: biased[e], k)
        total = sum(score[e] for e in chosen)
        out.append({e: score[e] / total * route_scale for e in chosen})
    return out


def balance_loss(choices: list[list[int]], probs: list[list[float]], n_experts: int) -> float:
    """N · Σ_i f_i P_i from per-token expert lists and per-token probabilities."""
    slots = sum(len(c) for c in choices)
    f = [sum(c.count(i) for c in choices) / slots for i in range(n_experts)]
    p = [sum(row[i] for row in probs) / len(probs) for i in range(n_experts)]
    return n_experts * sum(fi * pi for fi, pi in zip(f, p))


def layer(x: torch.Tensor, routes: list[dict[int, float]], experts, shared) -> torch.Tensor:
    """Each token through each of its experts alone, weighted and summed, plus the shared expert."""
    rows = []
    for t, route in enumerate(routes):
        y = shared(x[t:t + 1])[0] if shared is not None else torch.zeros_like(x[t])
        for e, w in route.items():
            y = y + w * experts[e](x[t:t + 1])[0]
        rows.append(y)
    return torch.stack(rows)
