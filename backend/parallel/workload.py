"""The workload every data-parallel strategy trains: an MLP stack (Linear+tanh, float64) on deterministic data,
with the same hand-written Adam everywhere, and the single-process reference run they must match.

Loss = squared error summed over the global batch ÷ (global batch · width); each rank takes a contiguous
slice of every step's batch and scales its partial loss the same way, so summing gradients over ranks
gives the single-process gradient. Adam is PyTorch's formula, written out so a shard updates exactly
the elements the full vector would. `Precision` says which dtype computes, which holds the master
weights and Adam's states, and which reduces gradients (float64 throughout, or bf16 mixed precision; the mesh also
runs fp32 throughout and fp16 mixed precision with loss scaling).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from backend.config import Config, ConfigError, setting
from backend.limits import MESSAGE_S, cost

BETAS, EPS = (0.9, 0.999), 1e-8


@dataclasses.dataclass
class WorkloadConfig(Config):
    """The settings every data-parallel experiment shares: the workload's shape and the rank count."""

    world_size: int = setting(4, min=2, max=8, help="data-parallel ranks n")
    hidden: int = setting(64, min=4, max=1024, help="layer width (the MLP), or d_model (the tiny LLaMA)")
    layers: int = setting(4, min=1, max=16, help="Linear+tanh layers (the MLP), or decoder blocks (the tiny LLaMA)")
    batch: int = setting(32, min=1, max=4096, help="global batch per step, split over ranks: rows (the MLP), or 8-token "
                                                   "sequences (the tiny LLaMA)")
    steps: int = setting(5, min=1, max=100, help="training steps")
    lr: float = setting(0.01, min=0.0, max=1.0, help="Adam learning rate")
    seed: int = setting(0, min=0, max=2**31 - 1, help="weights and data")

    cost_drivers = ("batch", "hidden", "steps", "layers", "world_size")

    def estimate(self):
        """float64 MLP: each rank and the single-process reference hold weights, gradients and Adam's two moments
        (torch's own peer doubles it) and activations; every step is 6·batch·params flops for each of them, and
        gradients cross the ranks once per step."""
        params = self.layers * (self.hidden * self.hidden + self.hidden)
        copies = self.world_size + 2
        activations = self.batch * self.hidden * self.layers * 8 * 3
        return cost(data_bytes=copies * (params * 8 * 8 + activations), flops=3 * 6 * self.batch * params * self.steps,
                    moved_bytes=self.steps * params * 8 * 4 * self.world_size,
                    ops=self.steps * self.layers * 100 * copies, ranks=self.world_size + 1)  # ZeRO-1 at the defaults: 2.8 s of CPU measured

    def ring_cpu_s(self, collectives_per_step: float) -> float:
        """CPU seconds of the ring steps of `collectives_per_step` ring collectives a step (a reduce-scatter or an
        all-gather: every rank sends and receives n-1 times; an all-reduce counts two)."""
        return self.steps * collectives_per_step * 2 * (self.world_size - 1) * self.world_size * MESSAGE_S

    def check(self) -> None:
        if self.batch < self.world_size:
            raise ConfigError("batch", f"{self.batch} is smaller than world_size={self.world_size} (allowed: >= world_size)")

    @property
    def workload(self) -> "Workload":
        return Workload(self.hidden, self.layers, self.batch, self.steps, self.lr, self.seed)


@dataclass(frozen=True)
class Workload:
    hidden: int
    layers: int
    batch: int
    steps: int
    lr: float
    seed: int


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


def make_model(w: Workload) -> nn.Sequential:
    torch.manual_seed(w.seed)
    mods = []
    for _ in range(w.layers):
        mods += [nn.Linear(w.hidden, w.hidden, dtype=torch.float64), nn.Tanh()]
    return nn.Sequential(*mods)


def batch(w: Workload, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(w.seed * 7919 + step)
    x = torch.randn(w.batch, w.hidden, generator=g, dtype=torch.float64)
    return x, torch.tanh(x.flip(1))  # a learnable target


def local_slice(t: torch.Tensor, index: int, parts: int) -> torch.Tensor:
    return t.tensor_split(parts)[index]


def loss_fn(w: Workload, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).sum() / (w.batch * w.hidden)


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


def load_flat(model: nn.Module, flat: torch.Tensor) -> None:
    offset = 0
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()


def activation_bytes(fn):
    """Run fn() and return (its result, bytes of the tensors autograd saved for backward)."""
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(saved)


def reference_run(w: Workload, precision: Precision = FP64, slices: int = 1) -> dict:
    """One process, the same Adam: losses per step and the final flat master parameters (as float64).
    The model computes in precision.compute from a copy of the master weights; with `slices` > 1 the batch is
    cut as that many ranks cut it and the slices' gradients are summed in precision.reduce: the arithmetic a
    data-parallel run performs, so a sharded mixed-precision run can be checked bitwise."""
    model = make_model(w).to(precision.compute)
    master = flat_params(make_model(w)).to(precision.master)
    m, v, adam, losses = torch.zeros_like(master), torch.zeros_like(master), Adam(w.lr), []
    for step in range(w.steps):
        load_flat(model, master.to(precision.compute))
        x, y = batch(w, step)
        grad, total = torch.zeros_like(master, dtype=precision.reduce), 0.0
        for xs, ys in zip(x.tensor_split(slices), y.tensor_split(slices)):
            loss = loss_fn(w, model(xs.to(precision.compute)).to(precision.master), ys.to(precision.master))
            model.zero_grad(set_to_none=True)
            loss.backward()
            grad += torch.cat([p.grad.reshape(-1) for p in model.parameters()]).to(precision.reduce)
            total += loss.item()
        adam.update(master, grad.to(precision.master), m, v)
        losses.append(total)
    return {"losses": losses, "params": master.double()}
