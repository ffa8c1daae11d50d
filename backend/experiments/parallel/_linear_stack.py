"""The pipeline page's model, the mesh loop's other choice beside the tiny LLaMA: a uniform stack of Linear+tanh layers
(float64, stage s seeded by s), so every stage costs the same and the bubble formulas, which assume equal stages, apply
(`unequal_stages`: the last stage twice as deep). The last stage returns the squared error's share of the batch mean.
"""
from __future__ import annotations

import torch
import torch.nn as nn
from torch.func import functional_call

from backend.parallel.pp.recompute import MeteredStage


def make_stage(stage: int, hidden: int, layers: int, seed: int) -> nn.Module:
    torch.manual_seed(seed * 1000 + stage)
    mods = []
    for _ in range(layers):
        mods += [nn.Linear(hidden, hidden, dtype=torch.float64), nn.Tanh()]
    return nn.Sequential(*mods)


def make_batch(config) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(config.seed + 12345)  # x, then y
    return tuple(torch.randn(config.batch, config.hidden, generator=g, dtype=torch.float64) for _ in range(2))


def stage_layers(config, stage: int) -> int:
    """Layers in a stage: layers / (p·v), or (unequal_stages) the last stage twice as deep, to show the bottleneck."""
    per = config.layers // config.num_stages
    return per * (2 if config.unequal_stages and stage == config.num_stages - 1 else 1)


class LinearStage(MeteredStage):
    """Stage s for the executor; `params` (PipeDream's stashed weights) runs it on them."""

    def __init__(self, s: int, module: nn.Module, config, xs, ys):
        self.index, self.last, self.xs, self.ys, self.module = s, s == config.num_stages - 1, xs, ys, module
        self.scale = 1.0 / (config.batch * config.hidden)

    def input(self, mb: int) -> torch.Tensor:
        return self.xs[mb].clone()

    def input_like(self, mb: int) -> torch.Tensor:
        return torch.empty(self.xs[mb].shape, dtype=torch.float64)

    def forward(self, x: torch.Tensor, mb: int, params: dict | None = None) -> torch.Tensor:
        with self.recording(mb, x, self.module.parameters()):
            out = functional_call(self.module, params, (x,)) if params else self.module(x)
            return ((out - self.ys[mb]) ** 2).sum() * self.scale if self.last else out


class LinearStack:
    """The loop's model choice for the pipeline page: this rank's stages of the stack and the batch's micro-batches.
    Pipeline only (tp = cp = ep = 1, float64)."""

    def __init__(self, config, mesh, S: int, m: int, tp=None, ep=None, shard=None):
        x, y = make_batch(config)
        self.config, self.xs, self.ys = config, x.chunk(m), y.chunk(m)

    def build(self, stages: list[int]) -> tuple[dict, nn.Module]:
        chunks = {s: make_stage(s, self.config.hidden, stage_layers(self.config, s), self.config.seed) for s in stages}
        return chunks, nn.ModuleDict({f"stage{s}": c for s, c in chunks.items()})

    def stages(self, chunks: dict, entry, dtype: torch.dtype, loss_scale: float) -> dict:
        return {s: LinearStage(s, c, self.config, self.xs, self.ys) for s, c in chunks.items()}

    def layers(self, chunks: dict) -> dict[int, list[int]]:
        """Each stage chunk's layer indices in the whole stack."""
        first = [sum(stage_layers(self.config, t) for t in range(s)) for s in range(self.config.num_stages + 1)]
        return {s: list(range(first[s], first[s] + stage_layers(self.config, s))) for s in chunks}

    def sources(self, chunks: dict) -> dict:
        return {}
