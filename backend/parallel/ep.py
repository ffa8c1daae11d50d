"""Expert parallel (Switch Transformers, GShard; seed 003's "expert and data parallelism"): the MoE layer of
models/moe.py with its routed experts split over the ep ranks; every rank holds the router and the shared expert
whole, E/n routed experts and its own slice of the tokens. One layer, on each rank:
  route     the router on this rank's T tokens (GShard's top-k, gates renormalised; with a capacity factor an expert
            takes at most ceil(cf · T · k / E) of them, first choices first, the rest dropped)
  dispatch  all-to-all of each kept (token, expert) row to its expert's rank, sorted by expert, after a small
            all-to-all of the per-expert counts (so every rank knows what it will receive)
  compute   each local expert on the rows it received from every rank
  combine   the reverse all-to-all brings the rows home, each scaled by its gate and added to its token
The all-to-alls are autograd functions (backward: the all-to-all with the splits swapped), so the same code trains.
"""
from __future__ import annotations

import torch
import torch.nn as nn
from torch.autograd import Function

from backend.models.moe import MoELayer, capacity_topk
from backend.parallel.tp import part


class AllToAll(Function):
    @staticmethod
    def forward(ctx, x, send_rows, recv_rows, wire, name):
        ctx.args = (send_rows, recv_rows, wire, name)
        return wire.all_to_all(x, send_rows, recv_rows, "forward", name)

    @staticmethod
    def backward(ctx, grad):
        send_rows, recv_rows, wire, name = ctx.args
        return wire.all_to_all(grad.contiguous(), recv_rows, send_rows, "backward", name), None, None, None, None


def apply_ep(model, wire):
    """Every MoE layer of the model, in place, split by expert over the ep `wire`. The experts' gradients need no
    collective (the combine's backward brought every rank's tokens); the router's and shared expert's are summed."""
    for block in model.blocks:
        if isinstance(block.ffn, MoELayer):
            block.ffn = ExpertParallelMoE(block.ffn, wire)
    return model


class ExpertParallelMoE(nn.Module):
    """Rank wire.index of wire.n of `layer` (taken over, not copied): the router and shared expert, and only its own
    experts kept."""

    def __init__(self, layer: MoELayer, wire):
        super().__init__()
        self.wire, self.n_experts = wire, len(layer.experts)
        self.top_k, self.capacity_factor = layer.top_k, layer.capacity_factor
        self.mine = range(self.n_experts)[part(self.n_experts, wire.index, wire.n)]
        self.router, self.shared = layer.router, layer.shared
        self.experts = nn.ModuleList(layer.experts[e] for e in self.mine)
        self.stats: list[dict] = []  # one per call: what was routed, kept, sent and computed

    def replicated_parameters(self) -> list[nn.Parameter]:
        """The parameters every ep rank holds whole (their gradients are summed over the ep ranks' tokens)."""
        return list(self.router.parameters()) + (list(self.shared.parameters()) if self.shared is not None else [])

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens: (..., d), this rank's."""
        x = tokens.reshape(-1, tokens.shape[-1])
        wire, n, per = self.wire, self.wire.n, len(self.mine)
        routing = capacity_topk(self.router(x), self.top_k, self.capacity_factor)
        token, slot = torch.where(routing.kept)
        expert = routing.indices[token, slot]
        order = torch.argsort(expert, stable=True)  # rows grouped by expert, so by destination rank
        token, slot, expert = token[order], slot[order], expert[order]
        per_expert = torch.bincount(expert, minlength=self.n_experts)
        send_rows = per_expert.view(n, per).sum(1).tolist()
        # each rank learns how many rows of each of its experts every other rank will send
        # (int64 whatever the activations' dtype: bf16 holds integers exactly only up to 256)
        recv_counts = wire.all_to_all(per_expert.view(n, per), [1] * n, [1] * n, "forward", "counts").long()
        recv_rows = recv_counts.sum(1).tolist()
        rows = AllToAll.apply(x[token], send_rows, recv_rows, wire, "dispatch")
        # rows arrive grouped by source rank, each group sorted by expert: cut them per (source, expert)
        pieces = list(rows.split(recv_counts.reshape(-1).tolist()))
        for j in range(per):
            arrived = [pieces[src * per + j] for src in range(n)]
            done = self.experts[j](torch.cat(arrived)).split([a.shape[0] for a in arrived])
            for src in range(n):
                pieces[src * per + j] = done[src]
        back = AllToAll.apply(torch.cat(pieces), recv_rows, send_rows, wire, "combine")
        y = torch.zeros_like(x) if self.shared is None else self.shared(x)
        y = y.index_add(0, token, back * routing.weights[token, slot, None])
        routed = torch.bincount(routing.indices.flatten(), minlength=self.n_experts)
        if torch.is_grad_enabled():  # one per call: a no-grad forward (full recompute's first pass) is rerun in B
            self.stats.append({"tokens": x.shape[0], "routed": routed.tolist(), "kept": per_expert.tolist(),
                               "dropped": (routed - per_expert).tolist(), "send_rows": send_rows,
                               "recv_rows": recv_rows,
                               "computed_here": {e: int(recv_counts[:, j].sum()) for j, e in enumerate(self.mine)}})
        return y.view_as(tokens)


def moe_activation_elements(tokens: int, rows_here: int, d: int, d_ff: int, experts: int, k: int,
                            shared: int) -> dict[str, float]:
    """Elements one ExpertParallelMoE call saves for backward (dropless: tokens·k assignments leave this rank, and
    `rows_here` arrive for its experts), its input (the norm's output) not counted. Counted from what autograd
    keeps: softmax output and top-k indices; per assignment its token and slot indices and its gate; the combined
    rows twice (the gate's product and the index_add); per received row its input and SwiGLU's four d_ff tensors;
    the shared experts' four per token."""
    assignments = tokens * k
    return {"router softmax and top-k indices": tokens * (experts + k),
            "assignment indices and gates": 3 * assignments,
            "combined rows (gate product, index_add)": 2 * assignments * d,
            "routed experts' input and SwiGLU": rows_here * (d + 4 * d_ff),
            "shared experts' SwiGLU": 4 * tokens * d_ff * shared}

