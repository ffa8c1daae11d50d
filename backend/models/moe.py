"""Mixture-of-experts: routers (softmax top-k, Switch top-1 with capacity, DeepSeek-V3 group-limited) and the
MoE layer that sends each token to its chosen SwiGLU experts and adds a shared expert.

The routers are written as seed 003 shows DeepSeek's code: torch.topk picks, scatter builds masks, gather
reads the chosen scores, bincount counts the load per expert. A router returns a Routing; the layer only
needs that, so an expert-parallel layer can run `routed(x, routing, experts=its_range)` on its own experts
and sum the partial outputs across ranks (as DeepSeek's all_reduce of y does).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

import torch
import torch.nn as nn

from backend.models.layers import SwiGLU


@dataclass
class Routing:
    indices: torch.Tensor  # (tokens, k) expert of each slot
    weights: torch.Tensor  # (tokens, k) its gate weight
    kept: torch.Tensor     # (tokens, k) False where the slot was dropped (Switch over capacity)
    probs: torch.Tensor    # (tokens, n_experts) the normalised router probabilities, for the balance loss

    def load(self, n_experts: int) -> torch.Tensor:
        """Tokens each expert processes."""
        return torch.bincount(self.indices[self.kept], minlength=n_experts)


def softmax_topk(logits: torch.Tensor, k: int, renormalize: bool) -> Routing:
    """Each token's k most probable experts; Mixtral (and GShard's top-2) renormalise their k weights to sum to 1,
    DeepSeek-V2 and Qwen1.5-MoE (norm_topk_prob = false) keep the softmax probabilities."""
    probs = logits.softmax(dim=-1)
    weights, indices = torch.topk(probs, k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return Routing(indices, weights, torch.ones_like(indices, dtype=torch.bool), probs)


def expert_capacity(tokens: int, k: int, n_experts: int, capacity_factor: float) -> int:
    """GShard's per-group capacity: ceil(cf · T · k / E) assignments per expert (Switch's, with k = 1). Exact: cf is
    taken as the decimal it was written as (1.1 is 11/10, not the double 1.100000000000000088...), so that a product
    that is a whole number in decimal (1.1 · 100 / 10 = 11) is not rounded up to the next one by a binary excess."""
    return math.ceil(Fraction(repr(float(capacity_factor))) * tokens * k / n_experts)


def capacity_topk(logits: torch.Tensor, k: int, capacity_factor: float | None, renormalize: bool = True) -> Routing:
    """GShard (Algorithm 1): each token's k most probable experts, their gates divided by their sum (renormalize;
    with k = 1, Switch, the gate stays the probability, else it would be 1 and the router would get no gradient);
    an expert takes at most expert_capacity(...) assignments, every token's first choice before any second choice,
    then in token order, and drops the rest (the token keeps its other experts, whose gates are not renormalised
    again: GShard normalises before the capacity test, fairscale and DeepSpeed over the kept gates).
    capacity_factor None: nothing dropped."""
    probs = logits.softmax(dim=-1)
    weights, indices = torch.topk(probs, k, dim=-1)
    if renormalize and k > 1:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if capacity_factor is None:
        return Routing(indices, weights, torch.ones_like(indices, dtype=torch.bool), probs)
    one_hot = torch.zeros(k, *probs.shape, dtype=torch.long).scatter_(2, indices.T.unsqueeze(-1), 1)  # (k, T, E)
    arrival = one_hot.flatten(0, 1).cumsum(dim=0).view_as(one_hot)  # choice-major, then token order
    position = (arrival * one_hot).sum(dim=-1).T - 1                # (T, k): place in its expert's queue
    kept = position < expert_capacity(logits.shape[0], k, logits.shape[1], capacity_factor)
    return Routing(indices, weights, kept, probs)


def switch_top1(logits: torch.Tensor, capacity_factor: float) -> Routing:
    """Switch Transformer: each token to its most probable expert, weighted by that probability; an expert takes
    at most capacity = ceil(cf · tokens / experts) tokens, in token order, and drops the rest (they skip the layer)."""
    return capacity_topk(logits, 1, capacity_factor)


def deepseek_v3(logits: torch.Tensor, bias: torch.Tensor, k: int, n_groups: int, topk_groups: int,
                route_scale: float) -> Routing:
    """DeepSeek-V3's Gate: sigmoid scores; the bias shifts scores for choosing only; experts in n_groups groups,
    a group scored by the sum of its top-2 biased scores; the topk_groups best groups kept; the top k experts
    among them; weights are the unbiased scores of the chosen, normalised to 1, times route_scale."""
    scores = logits.sigmoid()
    choice = (scores + bias).view(scores.shape[0], n_groups, -1)
    group_scores = choice.topk(2, dim=-1)[0].sum(dim=-1)
    top_groups = group_scores.topk(topk_groups, dim=-1)[1]
    dropped_groups = torch.ones_like(group_scores, dtype=torch.bool).scatter_(1, top_groups, False)
    choice = choice.masked_fill(dropped_groups.unsqueeze(-1), float("-inf")).flatten(1)
    indices = torch.topk(choice, k, dim=-1)[1]
    weights = scores.gather(1, indices)
    weights = weights / weights.sum(dim=-1, keepdim=True) * route_scale
    return Routing(indices, weights, torch.ones_like(indices, dtype=torch.bool), scores / scores.sum(-1, keepdim=True))


def balance_loss(routing: Routing, n_experts: int) -> torch.Tensor:
    """N · Σ_i f_i · P_i, f_i the share of routed slots that chose expert i (before capacity drops), P_i the mean
    router probability of expert i (Switch eq. 4; DeepSeek-V3's sequence-wise loss without its α). 1 when uniform."""
    tokens, k = routing.indices.shape
    f = torch.bincount(routing.indices.flatten(), minlength=n_experts).to(routing.probs.dtype) / (tokens * k)
    return n_experts * (f * routing.probs.mean(dim=0)).sum()


def update_bias(bias: torch.Tensor, load: torch.Tensor, rate: float) -> torch.Tensor:
    """DeepSeek-V3's auxiliary-loss-free balancing: lower the bias of overloaded experts, raise the underloaded."""
    return bias + rate * torch.sign(load.to(bias.dtype).mean() - load.to(bias.dtype))


class MoELayer(nn.Module):
    """Routed SwiGLU experts plus shared SwiGLU experts that every token passes through. Called without a routing,
    it routes itself: GShard's top_k (gates renormalised) with capacity_factor (None: dropless), over whatever
    tokens it is given."""

    def __init__(self, d_model: int, d_ff: int, n_experts: int, n_shared: int, top_k: int = 2,
                 capacity_factor: float | None = None):
        super().__init__()
        self.top_k, self.capacity_factor = top_k, capacity_factor
        self.routing_log: list[torch.Tensor] | None = None  # set to a list to record every call's expert choices
        self.router = nn.Linear(d_model, n_experts, bias=False)
        self.experts = nn.ModuleList(SwiGLU(d_model, d_ff) for _ in range(n_experts))
        self.shared = SwiGLU(d_model, d_ff * n_shared) if n_shared else None

    def route(self, x: torch.Tensor) -> Routing:
        routing = capacity_topk(self.router(x), self.top_k, self.capacity_factor)
        if self.routing_log is not None:
            self.routing_log.append(routing.indices)
        return routing

    def routed(self, x: torch.Tensor, routing: Routing, experts: range | None = None) -> torch.Tensor:
        """Σ over the chosen (and kept) experts in `experts` of weight · expert(x), for every token."""
        y = torch.zeros_like(x)
        load = routing.load(len(self.experts)).tolist()
        for e in experts or range(len(self.experts)):
            if load[e] == 0:
                continue
            token, slot = torch.where((routing.indices == e) & routing.kept)
            y.index_add_(0, token, self.experts[e](x[token]) * routing.weights[token, slot, None])
        return y

    def forward(self, x: torch.Tensor, routing: Routing | None = None) -> torch.Tensor:
        """x: (tokens, d), or (..., d) when the layer routes itself."""
        if routing is None:
            return self(x.reshape(-1, x.shape[-1]), self.route(x.reshape(-1, x.shape[-1]))).view_as(x)
        y = self.routed(x, routing)
        return y + self.shared(x) if self.shared is not None else y
