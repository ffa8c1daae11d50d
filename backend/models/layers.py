"""The LLaMA layers other models build from: RMSNorm (scale by the root mean square, no mean subtracted) and
SwiGLU (down(silu(gate(x)) * up(x))), shared by the dense decoder and the MoE layer's experts."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class SwiGLU(nn.Module):
    def __init__(self, d_model: int, d_ff: int):
        super().__init__()
        self.gate, self.up, self.down = (nn.Linear(d_model, d_ff, bias=False), nn.Linear(d_model, d_ff, bias=False),
                                         nn.Linear(d_ff, d_model, bias=False))
        self.w13: nn.Module | None = None  # gate and up fused, where tensor parallel installs it

    def forward(self, x):
        gate, up = (self.gate(x), self.up(x)) if self.w13 is None else self.w13(x).chunk(2, -1)
        return self.down(F.silu(gate) * up)
