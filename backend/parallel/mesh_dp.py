"""The data-parallel strategy over the mesh's dp dimension (after the cp and ep sums): how each rank turns its
summed-over-micro-batches gradients into updated weights, and what it keeps between steps (seed 000's table).

  allreduce  one ring all-reduce of the flat gradient vector, Adam on the whole vector    (2ψ per rank sent)
  ddp        the same sum bucket by bucket (backend/parallel/ddp.make_buckets: reverse parameter order, cut at
             bucket_kb), one ring all-reduce per bucket; issued after the pipeline's last backward (no overlap)
  zero1      reduce-scatter the gradients, Adam on this dp rank's 1/dp shard, all-gather the weights
             (backend/parallel/zero.Sharded's shards and ring collectives)                   (2ψ)
  zero2      as zero1, but only the gradient shard is kept after the reduce-scatter
  zero3      as zero2, and the weights too stay sharded between steps: all-gathered once at the start of each step
             and kept through its micro-batches (torchtitan's FSDP under a pipeline: reshard_after_forward=False,
             so the gather is not repeated per micro-batch); 2ψ per step, plus one gather to report the weights
Adam is elementwise, so updating a shard equals updating those elements of the full vector.
"""
from __future__ import annotations

import torch

from backend.parallel.ddp import make_buckets
from backend.parallel.wire import Wire
from backend.parallel.workload import Adam, load_flat
from backend.parallel.zero import Sharded

STRATEGIES = ("allreduce", "ddp", "zero1", "zero2", "zero3", "fsdp2")  # fsdp2: backend/parallel/fsdp.FullyShardedStages


def data_parallel(config, model, weights: torch.Tensor, params: list, mesh, dp: Wire, tracer):
    """This rank's dp strategy for its stage chunks (`model`, a ModuleDict): ours over the flat vector, or FSDP2's."""
    if config.dp_strategy == "fsdp2":
        from backend.parallel.fsdp import FullyShardedStages

        return FullyShardedStages(model, mesh.group("dp"), mesh.rank, dp, tracer, config.lr)
    return DataParallel(config.dp_strategy, weights, params, dp, tracer, config.lr, config.bucket_kb)


def sum_gradients(wire: Wire, flat: torch.Tensor, what: str) -> torch.Tensor:
    """Ring all-reduce of a flat gradient vector over one mesh dimension (zero-padded to equal chunks)."""
    if wire.n == 1:
        return flat
    padded = torch.zeros(-(-flat.numel() // wire.n) * wire.n, dtype=flat.dtype)
    padded[:flat.numel()] = flat
    return wire.all_reduce(padded, "backward", what)[:flat.numel()]


class DataParallel:
    """One strategy over `dp` for the flat vector `weights` of `params` (this rank's stages, in order)."""

    def __init__(self, strategy: str, weights: torch.Tensor, params: list, dp: Wire, tracer, lr: float, bucket_kb: int = 4):
        self.strategy, self.dp, self.tracer = strategy, dp, tracer
        self.zero = Sharded([(0, weights.numel())], weights, dp.index, dp.n, dp.p2p) if strategy.startswith("zero") else None
        self.owned = self.zero.shards[0] if self.zero else weights
        self.weights = None if strategy == "zero3" else weights  # zero3 keeps only its shard between steps
        self.adam, self.m, self.v = Adam(lr), torch.zeros_like(self.owned), torch.zeros_like(self.owned)
        offsets, at = {}, 0
        for p in params:
            offsets[id(p)], at = at, at + p.numel()
        self.buckets = [(min(offsets[id(p)] for p in b), max(offsets[id(p)] + p.numel() for p in b))
                        for b in make_buckets(params, bucket_kb * 1024)] if strategy == "ddp" else []
        self.grads_kept = 0

    def weights_for_step(self, step: int) -> torch.Tensor | None:
        """The full weights to load before this step's forwards: zero3 gathers them from the shards; None: as loaded."""
        if self.strategy != "zero3":
            return None
        with self.tracer.span("collective", f"all-gather weights {step}", kind="collective"):
            return self.zero.gather(0, torch.float64)

    def update(self, grads: torch.Tensor, step: int) -> torch.Tensor | None:
        """Sum `grads` over dp as the strategy does, Adam on what this rank owns; the full weights to load after the
        step (None for zero3, which gathers them at the next step's start)."""
        if self.zero:
            with self.tracer.span("collective", f"reduce-scatter gradients {step}", kind="collective"):
                grads = self.zero.reduce_scatter(0, grads)
        elif self.buckets:
            for i, (a, b) in enumerate(self.buckets):
                grads[a:b] = sum_gradients(self.dp, grads[a:b], f"data-parallel gradients, bucket {i}")
        else:
            grads = sum_gradients(self.dp, grads, "data-parallel gradients")
        self.grads_kept = grads.numel()  # zero2/zero3: the shard only (the full gradients are freed)
        if self.strategy == "zero1":
            self.grads_kept = self.zero.segs[0][1]  # zero1 keeps the full gradients; only Adam's state is sharded
        with self.tracer.span("compute", f"adam {step}", kind="optimizer"):
            self.adam.update(self.owned, grads, self.m, self.v)
        if self.strategy in ("zero1", "zero2"):
            with self.tracer.span("collective", f"all-gather weights {step}", kind="collective"):
                self.weights = self.zero.gather(0, torch.float64)
        return self.weights

    def final_weights(self) -> torch.Tensor:
        return self.weights if self.weights is not None else self.zero.gather(0, torch.float64)

    def load_final(self, model) -> None:
        """The trained weights into `model`, to report them (zero3: one more all-gather)."""
        load_flat(model, self.final_weights())

    def entry(self, chunk):
        """The module a stage's forward is called through: none, the chunk's own methods are (FSDP2's differs)."""
        return None

    def memory(self) -> dict[str, int]:
        """Bytes this rank keeps between steps by category (float64 throughout)."""
        params = self.owned.numel() if self.strategy == "zero3" else self.zero.segs[0][1] if self.zero else self.owned.numel()
        return {"parameters": params * 8, "gradients": self.grads_kept * 8,
                "optimizer states": sum(t.numel() * t.element_size() for t in (self.m, self.v))}
