"""What tensor and sequence parallel should do, predicted without running them: every collective of one training
step with its bytes; and the reference they are checked against, the single-process TinyDecoder (models/llama.py)
in float64, with its tokens.
"""
from __future__ import annotations

import torch

from backend.models.llama import ModelShape, TinyDecoder
from backend.comm.collectives import ring_bytes


def reference_model(config) -> TinyDecoder:
    torch.manual_seed(config.seed)
    shape = ModelShape(vocab=config.vocab, d_model=config.d_model, n_layers=config.layers, n_heads=config.n_heads,
                       n_kv_heads=config.n_kv_heads, d_head=config.d_head, d_ff=config.d_ff, variant="gqa",
                       n_experts=getattr(config, "experts", 0), top_k=getattr(config, "top_k", 2))
    return TinyDecoder(shape).double()


def tokens(config) -> torch.Tensor:
    g = torch.Generator().manual_seed(config.seed * 7919)
    return torch.randint(0, config.vocab, (config.batch, config.seq + 1), generator=g)


def expected_collectives(config, n: int, sp: bool, *, batch: int | None = None, seq: int | None = None,
                         layers: int | None = None, first: bool = True, last: bool = True, index: int = 0,
                         dense_ffn: bool = True, item: int = 8, loss_item: int | None = None) -> list[dict]:
    """Every collective of one forward and backward on rank `index` of n: (phase, op, name, numel, sent_bytes), in
    the order run. By default the whole model on config's batch; a pipeline stage gives its `layers`, whether it is
    the `first` (embedding) and `last` (head, loss), and its micro-batch's `batch` and (context-parallel) `seq`.
    Without `dense_ffn` (MoE blocks: run alike on every tp rank, or under SP each on its sequence shard) the MLP's
    collectives are absent; the norm-gradient rows count the norms only (an MoE layer's gradients are summed too).
    `item`: bytes per element of the activations (8: float64; the mesh's compute dtype); `loss_item`: of the cross
    entropy's (at least fp32: models.llama.at_least_fp32), item if not given."""
    b, s, L = batch or config.batch, seq or config.seq, config.layers if layers is None else layers
    nh, tokens_, h = b * s * config.d_model, b * s, config.d_model
    rows = []

    def add(phase, op, name, numel):
        rows.append({"phase": phase, "op": op, "name": name, "numel": numel})
    linears = ("attention", "mlp") if dense_ffn else ("attention",)  # each column-then-row pair of a block
    summed = "reduce_scatter" if sp else "all_reduce"  # each sum of partial results (g forward, f backward)
    if first:
        add("forward", summed, "embedding", nh)
    for name in linears * L:
        if sp:
            add("forward", "all_gather", name, nh // n)
        add("forward", summed, name, nh)
    if sp and last:
        add("forward", "all_gather", "head", nh // n)
    if last:
        add("forward", "all_gather", "cross entropy: max", tokens_)
        add("forward", "all_reduce", "cross entropy: target logit", tokens_)
        add("forward", "all_reduce", "cross entropy: sum of exp", tokens_)
    for name in ("head",) * last + linears[::-1] * L:
        if sp and name != "head":
            add("backward", "all_gather", name, nh // n)  # g' backward
        if sp:
            add("backward", "all_gather", f"{name} (re-gather)", nh // n)
        add("backward", summed, name, nh)
    if sp:
        if first:
            add("backward", "all_gather", "embedding", nh // n)
        for _ in range(2 * L + last):
            add("backward", "all_reduce", "norm weight gradients", h)
    for r in rows:
        size = (loss_item or item) if r["name"].startswith("cross entropy") else item
        r["sent_bytes"] = ring_bytes(r["op"], r["numel"], n, size, index)
    return rows
