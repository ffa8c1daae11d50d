"""What a rank holds and how it updates it, for every data-parallel strategy of the mesh. `Precision`: which dtype
computes, which holds the master weights and Adam's states, which reduces gradients (PRECISIONS; fp64 for exact checks
against one process). `Adam` is PyTorch's formula on a flat vector, so a shard updates exactly the elements the full
vector would (ZeRO, the parameter server); `flat_params` / `load_flat` lay a module's parameters out flat.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn

BETAS, EPS = (0.9, 0.999), 1e-8


@dataclass(frozen=True)
class Precision:
    compute: torch.dtype  # forward and backward
    master: torch.dtype   # the weights Adam updates, and Adam's m and v
    reduce: torch.dtype   # gradients on the wire and in the sum

    @property
    def mixed(self) -> bool:
        return self.master != self.compute

    def item(self, which: str) -> int:
        return torch.empty(0, dtype=getattr(self, which)).element_size()


FP64 = Precision(torch.float64, torch.float64, torch.float64)
FP32 = Precision(torch.float32, torch.float32, torch.float32)
BF16_MIXED = Precision(torch.bfloat16, torch.float32, torch.float32)  # as FSDP's MixedPrecision(reduce_dtype=fp32)
FP16_MIXED = Precision(torch.float16, torch.float32, torch.float32)   # with dynamic loss scaling (Micikevicius et al.)
PRECISIONS = {"fp64": FP64, "fp32": FP32, "bf16_mixed": BF16_MIXED, "fp16_mixed": FP16_MIXED}


@dataclass
class Adam:
    """PyTorch's Adam on a flat vector (or a shard of one): identical arithmetic element by element."""
    lr: float
    step: int = 0

    def update(self, param: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor) -> None:
        self.step += 1
        b1, b2 = BETAS
        m.mul_(b1).add_(grad, alpha=1 - b1)
        v.mul_(b2).addcmul_(grad, grad, value=1 - b2)
        step_size = self.lr / (1 - b1 ** self.step)
        denom = (v.sqrt() / math.sqrt(1 - b2 ** self.step)).add_(EPS)
        param.addcdiv_(m, denom, value=-step_size)


def flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def named_weights(model: nn.Module, flat: torch.Tensor | None = None) -> dict:
    """The model's weights by name as float64 arrays: its own, or those of `flat` (laid out as flat_params does)."""
    params = dict(model.named_parameters())
    values = params.values() if flat is None else flat.split([p.numel() for p in params.values()])
    return {n: v.detach().reshape(p.shape).double().numpy().copy() for (n, p), v in zip(params.items(), values)}


def load_flat(model: nn.Module, flat: torch.Tensor) -> None:
    offset = 0
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()

