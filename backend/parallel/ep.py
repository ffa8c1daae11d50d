"""Expert parallel (Switch Transformers, GShard): an MoE layer whose experts live on different ranks.

Every rank holds the router and the shared expert whole, E/n routed experts, and its own slice of the tokens
(seed 003's "expert and data parallelism"). One layer, on each rank:
  route     softmax(x W_routerᵀ), top-k experts per token; an expert takes at most C = ceil(cf · T · k / E) of
            this rank's T tokens (GShard's per-group capacity: first choices before second, then token order),
            the rest of its assignments are dropped (the token keeps its other experts and the shared one)
  dispatch  all-to-all: each kept (token, expert) row goes to the rank holding the expert, sorted by expert;
            the per-expert counts go first (a small all-to-all) so every rank knows what it will receive
  compute   each local expert runs on the rows it received from every rank
  combine   the reverse all-to-all brings the rows home; each is scaled by its gate and added to its token
The all-to-alls are autograd functions (backward is the all-to-all with the splits swapped), so the same
code trains. `MoE.forward(x, groups)` with a Wire of one rank and groups = n is the single-process reference:
the same routing per group of tokens, every expert local.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
from torch.autograd import Function


class AllToAll(Function):
    @staticmethod
    def forward(ctx, x, send_rows, recv_rows, wire, name):
        ctx.args = (send_rows, recv_rows, wire, name)
        return wire.all_to_all(x, send_rows, recv_rows, "forward", name)

    @staticmethod
    def backward(ctx, grad):
        send_rows, recv_rows, wire, name = ctx.args
        return wire.all_to_all(grad.contiguous(), recv_rows, send_rows, "backward", name), None, None, None, None


def expert_mlp(d: int, f: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(d, f, bias=False, dtype=torch.float64), nn.SiLU(), nn.Linear(f, d, bias=False, dtype=torch.float64))


def capacity(tokens: int, k: int, experts: int, factor: float) -> int:
    return math.ceil(factor * tokens * k / experts)


def route(logits: torch.Tensor, k: int, cap: int):
    """Top-k with a capacity: (token, expert, gate) of every kept assignment, sorted by expert then priority,
    and the number of assignments each expert was routed (kept or not)."""
    gates, experts = torch.softmax(logits, -1).topk(k, dim=-1)          # (T, k)
    token = torch.arange(logits.shape[0]).repeat_interleave(k).view(-1, k)
    # priority: every token's first choice before any second choice, then token order (GShard)
    order = torch.argsort(experts.T.reshape(-1) * logits.shape[0] * k + torch.arange(experts.numel()), stable=True)
    e_flat, t_flat, g_flat = experts.T.reshape(-1)[order], token.T.reshape(-1)[order], gates.T.reshape(-1)[order]
    # position of each assignment among its expert's: index minus where the expert's run starts
    starts = torch.searchsorted(e_flat, e_flat, right=False)
    keep = (torch.arange(len(e_flat)) - starts) < cap
    routed = torch.bincount(e_flat, minlength=logits.shape[1])
    return t_flat[keep], e_flat[keep], g_flat[keep], routed


class MoE(nn.Module):
    def __init__(self, d: int, f: int, experts: int, k: int, factor: float, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.k, self.factor, self.n_experts = k, factor, experts
        self.router = nn.Linear(d, experts, bias=False, dtype=torch.float64)
        self.shared = expert_mlp(d, f)
        self.experts = nn.ModuleList(expert_mlp(d, f) for _ in range(experts))

    def keep_only(self, index: int, n: int) -> None:
        """Rank `index` of n keeps experts index·E/n .. (index+1)·E/n (the others are deleted, not just unused)."""
        per = self.n_experts // n
        self.first = index * per
        self.experts = nn.ModuleList(list(self.experts)[self.first:self.first + per])

    def forward(self, x: torch.Tensor, wire, groups: int = 1) -> tuple[torch.Tensor, dict]:
        """x: this rank's tokens (T, d). With groups > 1 (one rank holding every expert) the tokens are routed
        in that many groups, as that many ranks would route their slices."""
        outs, stats = [], []
        for part in x.tensor_split(groups):
            y, st = self._layer(part, wire)
            outs.append(y)
            stats.append(st)
        return torch.cat(outs), stats

    def _layer(self, x, wire):
        n, per = wire.n, len(self.experts)
        first = getattr(self, "first", 0)
        cap = capacity(x.shape[0], self.k, self.n_experts, self.factor)
        token, expert, gate, routed = route(self.router(x), self.k, cap)
        per_expert = torch.bincount(expert, minlength=self.n_experts)
        send_rows = per_expert.view(n, per).sum(1).tolist()
        # each rank learns how many rows of each of its experts every other rank will send
        recv_counts = wire.all_to_all(per_expert.view(n, per).to(torch.float64), [1] * n, [1] * n, "forward", "counts").long()
        recv_rows = recv_counts.sum(1).tolist()
        rows = AllToAll.apply(x[token], send_rows, recv_rows, wire, "dispatch")
        # rows arrive grouped by source rank, each group sorted by expert: cut them per (source, expert)
        pieces = list(rows.split(recv_counts.reshape(-1).tolist()))
        for j in range(per):
            mine = [pieces[src * per + j] for src in range(n)]
            done = self.experts[j](torch.cat(mine)).split([m.shape[0] for m in mine])
            for src in range(n):
                pieces[src * per + j] = done[src]
        back = AllToAll.apply(torch.cat(pieces), recv_rows, send_rows, wire, "combine")
        y = self.shared(x).index_add(0, token, back * gate[:, None])
        return y, {"capacity": cap, "routed": routed.tolist(), "kept": per_expert.tolist(), "dropped": (routed - per_expert).tolist(),
                   "send_rows": send_rows, "recv_rows": recv_rows, "computed_here": {first + j: int(recv_counts[:, j].sum()) for j in range(per)}}
