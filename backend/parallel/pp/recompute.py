"""What a rank holds for backward, measured as the loop runs, per (stage, micro-batch), live and peak (checked
against the model in experiments/parallel/_recompute.py)."""
from __future__ import annotations

from contextlib import contextmanager

import torch


class ActivationMeter:
    """Bytes held for backward per (stage, micro-batch): unique storages, so a tensor saved twice counts once."""

    def __init__(self):
        self.held: dict[tuple[int, int], dict[int, int]] = {}
        self.live = self.peak = 0

    def _add(self, key, tensor: torch.Tensor, skip: set[int]) -> None:
        storage = tensor.untyped_storage()
        ptr, storages = storage.data_ptr(), self.held.setdefault(key, {})
        if ptr not in skip and ptr not in storages:
            storages[ptr] = storage.nbytes()
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)

    @contextmanager
    def saving(self, key, parameters):
        """Count what autograd saves inside the block (parameters are weights, not activations)."""
        skip = {p.untyped_storage().data_ptr() for p in parameters}

        def pack(t):
            self._add(key, t, skip)
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield

    def keep(self, key, tensor: torch.Tensor) -> None:
        """A tensor kept for backward outside autograd (the stage input, under recomputation)."""
        self._add(key, tensor, set())

    def free(self, key) -> None:
        self.live -= sum(self.held.pop(key, {}).values())


@contextmanager
def saved_activations(parameters):
    """An ActivationMeter of what autograd saves inside the block, under one key (`live`: its bytes)."""
    meter = ActivationMeter()
    with meter.saving(0, list(parameters)):
        yield meter


class MeteredStage:
    """A pipeline stage that records, while `activations` and `kept` are dicts (the loop sets them), each forward run
    with gradients: per micro-batch the bytes autograd saves in the recorded body and the bytes of the stage input,
    what full recomputation keeps instead (its F runs without gradients and records nothing)."""

    activations: dict[int, int] | None = None
    kept: dict[int, int] | None = None

    @contextmanager
    def recording(self, mb: int, x: torch.Tensor, parameters):
        if self.activations is None or not torch.is_grad_enabled():
            yield
            return
        with saved_activations(parameters) as meter:
            yield
        self.activations[mb], self.kept[mb] = meter.live, x.numel() * x.element_size()
