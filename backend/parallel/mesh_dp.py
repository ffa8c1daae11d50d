"""The data-parallel strategy over the mesh's dp dimension (after the cp and ep sums): how each rank turns its summed
gradients into updated weights, and what it keeps between steps (seed 000's table).

  allreduce  one ring all-reduce of the flat gradient vector, Adam on the whole vector              (2ψ per rank sent)
  ddp        the same sum bucket by bucket (parallel/ddp.py: reverse parameter order, cut at bucket_kb); after the
             pipeline's last backward, or (`overlap`) each as soon as its gradients are final, during the last backward
  zero1      reduce-scatter the gradients, Adam on this rank's 1/dp shard (`ZeroShard`), all-gather the weights  (2ψ)
  zero2      as zero1, but only the gradient shard is kept after the reduce-scatter
  zero3      as zero2, and the weights stay sharded between steps: gathered once per step, kept through its
             micro-batches (torchtitan's FSDP under a pipeline, reshard_after_forward=False); 2ψ, + one report gather
  offload    (zero1, zero2) ZeRO-Offload (Ren et al. 2021): master shard, Adam's m, v and step in the host pool; the
             gradient shard moves down (reduce dtype), the updated shard up cast to the compute dtype: ψ/dp each way
Adam is elementwise, so updating a shard equals updating those elements of the full vector. Gradients are summed in
the reduce dtype; Adam steps the master copy (and m, v) in the master dtype; the model loads the compute dtype (ZeRO
casts the shard, then all-gathers in the compute dtype, as Megatron's distributed optimizer and FSDP's param_dtype do).
The master copy is a tensor of its own only in mixed precision; in fp64 or fp32 it is the compute copy.
"""
from __future__ import annotations

import torch

from backend.comm.collectives import Spec, all_gather_ring, reduce_scatter_ring
from backend.parallel.ddp import BucketOverlap, bucket_ranges, make_buckets
from backend.parallel.offload import Pools
from backend.parallel.precision import FP64, Adam, Precision, named_weights
from backend.parallel.wire import Wire, padded, sum_gradients
from backend.trace import Tracer

STRATEGIES = ("allreduce", "ddp", "zero1", "zero2", "zero3", "fsdp2")  # fsdp2: backend/parallel/fsdp.FullyShardedStages


def data_parallel(config, model, weights: torch.Tensor, params: list, mesh, dp: Wire, tracer,
                  precision: Precision = FP64):
    """This rank's dp strategy for its stage chunks (`model`): ours over the flat vector `weights`, or FSDP2's
    (float64 only). `comm_delay_ms` (DDP): the dp wire, and the overlap thread's, that slow per collective."""
    dp.delay_s = getattr(config, "comm_delay_ms", 0) / 1000
    offload = getattr(config, "offload", False)
    if config.dp_strategy == "fsdp2":
        from backend.parallel.fsdp import FullyShardedStages

        return FullyShardedStages(model, mesh.group("dp"), mesh.rank, dp, tracer, config.lr, offload)
    sync = DataParallel(config.dp_strategy, weights, params, dp, tracer, config.lr, config.bucket_kb, precision,
                        offload)
    if getattr(config, "overlap", False):
        from backend.parallel.pp.schedules import SCHEDULES

        thread_wire = Wire(dp.index, dp.n, dp.p2p.ranks or list(range(dp.n)), Tracer(mesh.rank), dp.delay_s)
        microbatches = SCHEDULES[config.schedule].microbatches(config.microbatches)
        sync.overlap = BucketOverlap(sync.buckets, sync.ranges, thread_wire, tracer, microbatches, precision.reduce)
    return sync


class ZeroShard:
    """ZeRO's cut of a flat vector: zero-padded to a multiple of dp, rank r holding the r-th of dp equal shards."""

    def __init__(self, flat: torch.Tensor, dp: Wire):
        self.numel, self.n, self.comm = flat.numel(), dp.n, dp.p2p
        self.shard = padded(flat, dp.n).tensor_split(dp.n)[dp.index].clone()

    def gather(self, dtype: torch.dtype, shard: torch.Tensor | None = None) -> torch.Tensor:
        """The whole vector in `dtype`, from this rank's shard (or from `shard`, a copy of it held elsewhere)."""
        shard = (self.shard if shard is None else shard).to(dtype)
        return all_gather_ring(self.comm, shard, Spec("all_gather", shard.numel()))[:self.numel]

    def reduce_scatter(self, grad: torch.Tensor) -> torch.Tensor:
        """This rank's shard of the sum of every rank's `grad`."""
        full = padded(grad, self.n)
        return reduce_scatter_ring(self.comm, full, Spec("reduce_scatter", full.numel()))


def nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class DataParallel:
    """One strategy over `dp` for the flat vector `weights` of `params` (this rank's stages, in order)."""

    overlap: BucketOverlap | None = None  # ddp's buckets started during the backward (data_parallel sets it)

    def __init__(self, strategy: str, weights: torch.Tensor, params: list, dp: Wire, tracer, lr: float,
                 bucket_kb: int = 4, precision: Precision = FP64, offload: bool = False):
        self.strategy, self.dp, self.tracer, self.precision = strategy, dp, tracer, precision
        weights = weights.to(precision.master)
        self.zero = ZeroShard(weights, dp) if strategy.startswith("zero") else None
        self.owned = self.zero.shard if self.zero else weights  # the master copy this rank updates
        # the compute copy the model loads (the same tensor unless mixed); zero3 keeps only its master shard
        self.weights = None if strategy == "zero3" else weights.to(precision.compute)
        self.adam, self.m, self.v = Adam(lr), torch.zeros_like(self.owned), torch.zeros_like(self.owned)
        self.buckets = make_buckets(params, bucket_kb * 1024, precision.item("reduce")) if strategy == "ddp" else []
        self.ranges = bucket_ranges(params, self.buckets)
        self.grads_kept, self.grad_item = 0, precision.item("reduce")
        self.pools = Pools() if offload else None  # ZeRO-Offload: what the host pool holds, and the bytes moved
        if self.pools:
            self.pools.place("parameters (master shard)", [self.owned])
            self.pools.place("optimizer states", [self.m, self.v])

    def weights_for_step(self, step: int) -> torch.Tensor | None:
        """The full weights to load before this step's forwards: zero3 gathers them from the shards; None: as loaded."""
        if self.overlap:
            self.overlap.arm()
        if self.strategy != "zero3":
            return None
        with self.tracer.span("collective", f"all-gather weights {step}", kind="collective"):
            return self.zero.gather(self.precision.compute)

    def update(self, grads: torch.Tensor, step: int, skip: bool = False) -> torch.Tensor | None:
        """Sum `grads` over dp, Adam on what this rank owns; returns the weights to load (None: as they are; zero3
        gathers at the next step). `skip` (a loss-scaled step that overflowed, on every rank alike): only the sum."""
        if self.zero:
            with self.tracer.span("collective", f"reduce-scatter gradients {step}", kind="collective"):
                grads = self.zero.reduce_scatter(grads)
        elif self.buckets and not self.overlap:  # (overlap: summed bucket by bucket during the backward)
            for i, (a, b) in enumerate(self.ranges):
                grads[a:b] = sum_gradients(self.dp, grads[a:b], f"data-parallel gradients, bucket {i}")
        elif not self.overlap:
            grads = sum_gradients(self.dp, grads, "data-parallel gradients")
        # zero1 keeps the full gradients (only Adam's state is sharded), zero2/3 the shard, offload none (the host's)
        self.grads_kept = self.zero.numel if self.strategy == "zero1" else 0 if self.pools else grads.numel()
        self.grad_item = grads.element_size()
        if self.pools:
            with self.tracer.span("offload", f"gradient shard to host {step}", kind="offload"):
                grads = self.pools.place("gradients (shard)", [self.pools.move(grads, "host")])[0]
        if skip:
            return None
        with self.tracer.span("compute", f"adam {step}", kind="optimizer"):
            self.adam.update(self.owned, grads.to(self.precision.master), self.m, self.v)
        if self.strategy in ("zero1", "zero2"):
            shard = None
            if self.pools:  # cast on the host, then only the compute dtype's bytes cross
                with self.tracer.span("offload", f"parameter shard to device {step}", kind="offload"):
                    shard = self.pools.move(self.owned, "device", self.precision.compute)
            with self.tracer.span("collective", f"all-gather weights {step}", kind="collective"):
                self.weights = self.zero.gather(self.precision.compute, shard)
        elif not self.zero:
            self.weights = self.compute_weights()
        return self.weights

    def gradients(self) -> torch.Tensor | None:
        """With overlap, this rank's flat gradients already summed over dp; otherwise None (the parameters' own)."""
        return self.overlap.wait() if self.overlap else None

    def close(self) -> None:
        if self.overlap:
            self.overlap.close()

    def compute_weights(self) -> torch.Tensor:
        return self.zero.gather(self.precision.compute) if self.zero else self.owned.to(self.precision.compute)

    def final_named(self, model) -> dict:
        """The trained master weights by name (float64 arrays); ZeRO gathers them once more in the master dtype unless
        its last gather left them whole (reporting, not training)."""
        flat = self.owned
        if self.zero:
            whole = self.strategy != "zero3" and not self.precision.mixed  # the last all-gather left the master whole
            flat = self.weights if whole else self.zero.gather(self.precision.master)
        return named_weights(model, flat)

    def entry(self, chunk):
        """The module a stage's forward is called through: none here (FSDP2's differs)."""
        return None

    def memory(self) -> dict[str, int]:
        """Bytes this rank keeps between steps by category: the compute copy (under ZeRO-3 none, unless not mixed:
        its shard is the one copy), the master copy apart from it (mixed only), the gradients Adam read, Adam's m, v
        (ZeRO-Offload: master shard and Adam's states are the host's)."""
        mixed = self.precision.mixed
        params = nbytes(self.weights) if self.weights is not None else 0 if mixed else nbytes(self.owned)
        out = {"parameters": params, "gradients": self.grads_kept * self.grad_item,
               "optimizer states": 0 if self.pools else nbytes(self.m, self.v)}
        if mixed:
            out["master weights"] = 0 if self.pools else nbytes(self.owned)
        return out

    def host_memory(self) -> dict[str, int]:  # the host pool by category (ZeRO-Offload)
        return self.pools.host_bytes() if self.pools else {}

    def moved(self) -> dict[str, int]:  # bytes copied between the pools over the run, by direction (ZeRO-Offload)
        return dict(self.pools.moved) if self.pools else {}
