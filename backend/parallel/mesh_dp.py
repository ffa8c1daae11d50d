"""The data-parallel strategy over the mesh's dp dimension (after the cp and ep sums): how each rank turns its
summed-over-micro-batches gradients into updated weights, and what it keeps between steps (seed 000's table).

  allreduce  one ring all-reduce of the flat gradient vector, Adam on the whole vector    (2ψ per rank sent)
  ddp        the same sum bucket by bucket (backend/parallel/ddp.py: reverse parameter order, cut at bucket_kb), one
             ring all-reduce per bucket; issued after the pipeline's last backward, or (`overlap`, `BucketOverlap`)
             each as soon as its gradients are final, during the last micro-batch's backward
  zero1      reduce-scatter the gradients, Adam on this dp rank's 1/dp shard (`ZeroShard`: the flat vector padded to
             a multiple of dp, cut in dp equal shards), all-gather the weights                (2ψ)
  zero2      as zero1, but only the gradient shard is kept after the reduce-scatter
  zero3      as zero2, and the weights too stay sharded between steps: all-gathered once at the start of each step
             and kept through its micro-batches (torchtitan's FSDP under a pipeline: reshard_after_forward=False,
             so the gather is not repeated per micro-batch); 2ψ per step, plus one gather to report the weights
  offload    (zero1, zero2) ZeRO-Offload (Ren et al. 2021): the master shard, Adam's m and v and the Adam step live in
             the host pool (backend/parallel/offload.Pools); the gradient shard moves down after the reduce-scatter
             (in the reduce dtype), the updated shard moves up cast to the compute dtype before the all-gather: ψ/dp
             each way
Adam is elementwise, so updating a shard equals updating those elements of the full vector.
Precision (precision.Precision): the gradients arrive in the reduce dtype and are summed in it; Adam steps the master
copy (and keeps m, v) in the master dtype; the weights the model loads are cast to the compute dtype (ZeRO: the shard
is cast, then all-gathered in the compute dtype, as Megatron's distributed optimizer and FSDP's param_dtype do). In
mixed precision the master copy is a tensor of its own beside the compute copy; in fp64 or fp32 they are one tensor.
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
    """This rank's dp strategy for its stage chunks (`model`, a ModuleDict): ours over the flat (master) vector
    `weights`, or FSDP2's (float64 only: MeshConfig refuses another precision with it). `comm_delay_ms` (DDP): the dp
    wire, and the overlap thread's, made that slow per collective."""
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
    """ZeRO's cut of a flat vector over the dp ranks: zero-padded to a multiple of dp, rank r holding the r-th of dp
    equal shards; the reduce-scatter and all-gather are our rings on the dp wire's logged send/recv."""

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
        """Sum `grads` over dp as the strategy does, Adam on what this rank owns; the full weights to load after the
        step (None for zero3, which gathers them at the next step's start). `skip` (a loss-scaled step that overflowed,
        on every rank alike): the sum is made, then nothing is stepped or gathered (None: the weights stay)."""
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
        """With overlap, this rank's flat gradients already summed over dp (its buckets' rings), in the reduce dtype;
        otherwise None: the loop reads the parameters' own."""
        return self.overlap.wait() if self.overlap else None

    def close(self) -> None:
        """Training is over: the overlap's communication thread ends."""
        if self.overlap:
            self.overlap.close()

    def compute_weights(self) -> torch.Tensor:
        """The whole compute copy from the master: ZeRO all-gathers the shards cast to the compute dtype; otherwise
        a cast (the master tensor itself unless mixed)."""
        return self.zero.gather(self.precision.compute) if self.zero else self.owned.to(self.precision.compute)

    def final_named(self, model) -> dict:
        """The trained master weights by name, as float64 arrays. ZeRO-3, and ZeRO-1/2 in mixed precision (whose last
        all-gather was of the compute copy), all-gather them once more in the master dtype (reporting, not training)."""
        flat = self.owned
        if self.zero:
            whole = self.strategy != "zero3" and not self.precision.mixed  # the last all-gather left the master whole
            flat = self.weights if whole else self.zero.gather(self.precision.master)
        return named_weights(model, flat)

    def entry(self, chunk):
        """The module a stage's forward is called through: none, the chunk's own methods are (FSDP2's differs)."""
        return None

    def memory(self) -> dict[str, int]:
        """Bytes this rank keeps between steps by category, each at its tensor's item size: the compute copy of the
        weights (none between steps under ZeRO-3 unless not mixed: then its shard is the one copy), the master copy
        apart from it (mixed precision only), the gradients Adam read, and Adam's m and v (with ZeRO-Offload the master
        shard and Adam's states are the host's: host_memory)."""
        mixed = self.precision.mixed
        params = nbytes(self.weights) if self.weights is not None else 0 if mixed else nbytes(self.owned)
        out = {"parameters": params, "gradients": self.grads_kept * self.grad_item,
               "optimizer states": 0 if self.pools else nbytes(self.m, self.v)}
        if mixed:
            out["master weights"] = 0 if self.pools else nbytes(self.owned)
        return out

    def host_memory(self) -> dict[str, int]:
        """Bytes in the host pool by category (ZeRO-Offload; nothing otherwise)."""
        return self.pools.host_bytes() if self.pools else {}

    def moved(self) -> dict[str, int]:
        """Bytes copied between the pools over the run's steps, by direction (ZeRO-Offload; none otherwise)."""
        return dict(self.pools.moved) if self.pools else {}
