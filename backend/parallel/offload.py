"""CPU offload on a machine with no accelerator: the "device" and the "host" as two accounting pools.

On gloo ranks both pools are this CPU's memory, so what is modelled is the placement, not the hardware: every
tensor a strategy keeps is registered in one pool, and a tensor crosses only through `Pools.move`, which makes
a new copy (its own storage, in the dtype that crosses) and counts its bytes by direction. Memory per pool is
the bytes of the tensors registered there; bytes moved are those of the copies made. ZeRO-Offload
(Ren et al., 2021) keeps the fp32 optimizer states and the Adam step on the host: per step each rank sends its
gradient shard down (2 bytes/param in fp16, 4 in fp32) and takes its updated parameter shard back up.

FSDP2's own CPUOffloadPolicy moves tensors with `Tensor.to(device)` inside torch; `FSDPTransfers` counts those
calls, naming each by the FSDP2 function that made it (on a CPU the call returns the tensor itself: the bytes
counted are those FSDP2 asks to move).
"""
from __future__ import annotations

import sys

import torch


class Pools:
    """The tensors placed in the host pool, by category (every other tensor is the device's), and the bytes each copy
    between the two pools moved."""

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
    """Bytes FSDP2 copies with `Tensor.to(device)` from its offload code: parameter shards host -> device before
    each all-gather (`all_gather_inputs`), gradient shards device -> host after each reduce-scatter
    (`foreach_reduce`). Only calls made from those two functions count. A TorchFunctionMode would miss the
    backward's calls (the autograd engine runs FSDP2's hooks without Python modes), so from `start` to `stop`
    `torch.Tensor.to` is wrapped, and then restored."""

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
        """Counting ends (again: nothing)."""
        if self._to is not None:
            torch.Tensor.to, self._to = self._to, None
