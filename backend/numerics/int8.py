"""INT8 inference (seed 002): symmetric 8-bit integers with float scales.

- Weights per output channel: s_j = max_i |W_ji| / 127, q = round(W / s) in -127..127; W ≈ q·s, each element within s/2.
- Activations per token (W8A8): s_t = max_i |x_ti| / 127, likewise.
- W8A8 matmul: Y_tj = s_t · s_j · Σ_i qx_ti · qw_ji, the sum of int8 products accumulated in INT32 (exact: each product is
  at most 127² in magnitude, so k below 2^31 / 127² ≈ 133,000 terms cannot overflow), scaled once at the end.
- Weight-only (W8): the weights are stored in INT8 and widened to float before the matmul; activations stay float.
- INT8 KV cache: K and V stored per token and head with one scale each, dequantised when attention reads them.
Seed 002 keeps the last layer in FP16 for large models; `keep_head` leaves the output head in float likewise.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from backend.attention.variants import KVCache

QMAX = 127


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric INT8 along the last dimension: (q int8, scale float32 per row, shape x.shape[:-1] + (1,))."""
    scale = (x.abs().amax(dim=-1, keepdim=True).float() / QMAX).clamp(min=torch.finfo(torch.float32).tiny)
    q = torch.round(x.float() / scale).clamp(-QMAX, QMAX).to(torch.int8)
    return q, scale


def int8_matmul(qa: torch.Tensor, qb_t: torch.Tensor) -> torch.Tensor:
    """(m, k) int8 @ (n, k)ᵀ int8 -> (m, n) int32, accumulated in INT32 by torch's integer GEMM (torch._int_mm)."""
    return torch._int_mm(qa.contiguous(), qb_t.t().contiguous())


class Int8Linear(nn.Module):
    """A bias-free Linear with its weight stored in INT8 per output channel. mode "w8": weight-only (dequantised to
    float, activations float); "w8a8": activations quantised per token and the product taken in INT32."""

    def __init__(self, linear: nn.Linear, mode: str):
        super().__init__()
        if mode not in ("w8", "w8a8"):
            raise ValueError(f"mode must be w8 or w8a8, got {mode!r}")
        q, scale = quantize_rows(linear.weight.detach())
        self.register_buffer("qweight", q)
        self.register_buffer("scale", scale[:, 0])
        self.mode = mode

    def storage_bytes(self) -> int:
        return self.qweight.nbytes + self.scale.nbytes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode == "w8":
            return x @ (self.qweight.float() * self.scale[:, None]).t()
        flat = x.reshape(-1, x.shape[-1])
        qx, sx = quantize_rows(flat)
        y = int8_matmul(qx, self.qweight).float() * sx * self.scale[None, :]
        return y.reshape(*x.shape[:-1], -1).to(x.dtype)


def quantize_model(model: nn.Module, mode: str, keep_head: bool) -> nn.Module:
    """Replace every nn.Linear of the model (the head too unless keep_head) by an Int8Linear, in place."""
    for name, child in list(model.named_children()):
        if isinstance(child, nn.Linear):
            if not (keep_head and name == "head"):
                setattr(model, name, Int8Linear(child, mode))
        else:
            quantize_model(child, mode, keep_head=False)
    return model


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the weights as stored: float parameters plus INT8 weights and their scales."""
    return sum(p.nbytes for p in model.parameters()) + sum(m.storage_bytes() for m in model.modules() if isinstance(m, Int8Linear))


class Int8KVCache(KVCache):
    """A KVCache whose K and V are stored in INT8 with one float32 scale per token and head; attention reads them
    dequantised. `bytes_per_token()` counts both the integers and the scales (read off the tensors)."""

    def __init__(self, max_len: int, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype):
        self.tensors = {}
        for name, shape in shapes.items():
            self.tensors[name] = torch.zeros(max_len, *shape, dtype=torch.int8)
            self.tensors[name + "_scale"] = torch.zeros(max_len, *shape[:-1], 1, dtype=torch.float32)
        self.names, self.dtype, self.length = tuple(shapes), dtype, 0

    def append(self, start: int, **values: torch.Tensor) -> dict[str, torch.Tensor]:
        end = start + next(iter(values.values())).shape[0]
        for name, v in values.items():
            q, scale = quantize_rows(v)
            self.tensors[name][start:end], self.tensors[name + "_scale"][start:end] = q, scale
        self.length = end
        return {name: (self.tensors[name][:end].float() * self.tensors[name + "_scale"][:end]).to(self.dtype) for name in self.names}
