"""CPU offload on a machine with no accelerator: the "device" and the "host" as two accounting pools of one memory.

What is modelled is the placement: every tensor a strategy keeps is registered in one pool, and crosses only through
`Pools.move`, a new copy (in the dtype that crosses) whose bytes count by direction. ZeRO-Offload (Ren et al., 2021)
keeps the fp32 optimizer states and Adam's step on the host: per step each rank sends its gradient shard down (2
bytes/param in fp16, 4 in fp32) and takes its updated parameter shard back up. FSDP2's CPUOffloadPolicy moves with
`Tensor.to(device)`: `FSDPTransfers` counts the bytes FSDP2 asks to move (on a CPU the call returns the tensor itself).
"""
from __future__ import annotations

import sys

import torch


class Pools:
    """The tensors in the host pool by category (every other is the device's), and the bytes each crossing moved."""

    def __init__(self):
        self.host: dict[str, list[torch.Tensor]] = {}
        self.moved = {"device_to_host": 0, "host_to_device": 0}

    def place(self, category: str, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Register `tensors` as the host's `category` (replacing what it held there); returns them."""
        self.host[category] = list(tensors)
        return tensors

    def move(self, tensor: torch.Tensor, to: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A copy of `tensor` in the `to` pool (cast to `dtype` before it crosses, if given); its bytes counted."""
        copy = tensor.detach().to(dtype or tensor.dtype, copy=True)
        self.moved["host_to_device" if to == "device" else "device_to_host"] += copy.numel() * copy.element_size()
        return copy

    def host_bytes(self) -> dict[str, int]:
        return {cat: sum(t.numel() * t.element_size() for t in ts) for cat, ts in self.host.items()}


class FSDPTransfers:
    """Bytes FSDP2 moves with `Tensor.to(device)`, counted only from its two offload sites (SITES): parameter shards
    up before each all-gather, gradient shards down after each reduce-scatter. A TorchFunctionMode would miss the
    backward's calls (autograd runs FSDP2's hooks without Python modes), so `torch.Tensor.to` is wrapped from `start`
    to `stop`."""

    SITES = {"all_gather_inputs": "host_to_device", "foreach_reduce": "device_to_host"}

    def __init__(self):
        self.moved = {"device_to_host": 0, "host_to_device": 0}
        self._to = None

    def start(self) -> "FSDPTransfers":
        self._to = original = torch.Tensor.to

        def counted(tensor, *args, **kwargs):
            direction = self.SITES.get(sys._getframe(1).f_code.co_name)
            if direction and any(isinstance(a, torch.device) for a in args):
                self.moved[direction] += tensor.numel() * tensor.element_size()
            return original(tensor, *args, **kwargs)
        torch.Tensor.to = counted
        return self

    def stop(self) -> None:
        if self._to is not None:
            torch.Tensor.to, self._to = self._to, None
