"""The tiny LLaMA parallelized as torchtitan does it: one model (backend/models/llama.py), each strategy a transform
applied to this rank's copy of it:
    split_stages  pipeline: keep stage s of S's blocks (embedding on the first, norm, head and loss on the last)
    apply_tp      tensor (and sequence) parallel: the linears, embedding and loss swapped for shards (tp.py)
    apply_ep      expert parallel: each MoE layer keeps its own experts, all-to-all dispatch and combine (ep.py)
    apply_cp      context parallel: attention over this rank's sequence shard by ring attention (cp.py)
Every parameter is tagged with the reference tensors it holds (`source`: a dim and the (name, slice) pieces
concatenated along it), so one process's weights or gradients can be cut as this rank's were (`expected`).
"""
from __future__ import annotations

import copy

import torch
import torch.nn as nn

from backend.models.llama import TinyDecoder
from backend.parallel.cp import apply_cp
from backend.parallel.ep import apply_ep
from backend.parallel.tp import apply_tp, cut, part


def parallelize(reference: TinyDecoder, tp, sp: bool = False, stage: int = 0, stages: int = 1, ep=None, cp=None) -> TinyDecoder:
    """This rank's model: a copy of `reference`, every transform applied (`tp`, `ep`: Wires; `cp`: a SequenceShard)."""
    model = tag_sources(copy.deepcopy(reference))
    model.zero_grad(set_to_none=True)
    split_stages(model, stage, stages)
    apply_tp(model, tp, sp)
    if model.shape.n_experts:
        apply_ep(model, ep)
    if cp is not None:
        apply_cp(model, cp)
    return model


def split_stages(model: TinyDecoder, stage: int, stages: int) -> TinyDecoder:
    """Stage `stage` of `stages`, in place (the executor runs each stage's embed / run_blocks / head_loss)."""
    model.blocks = model.blocks[part(model.shape.n_layers, stage, stages)]
    if stage > 0:
        model.embed = None
    if stage < stages - 1:
        model.norm = model.head = model.cross_entropy = None
    return model


def tag_sources(module: nn.Module) -> nn.Module:
    """Tag each parameter of a whole (not yet transformed) module with its own name: what the transforms cut from."""
    for name, p in module.named_parameters():
        p.source = (None, [(name, slice(None))])
    return module


def sources(model) -> dict[str, tuple]:
    """Each parameter's reference pieces, by this model's parameter name."""
    return {name: p.source for name, p in model.named_parameters()}


def expected(model, reference_tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Reference tensors (weights or gradients, by reference name) cut as this rank's parameters were."""
    return cut(reference_tensors, sources(model))
