"""The data-parallel strategy over the mesh's dp dimension (after the cp and ep sums): how each rank turns its
summed-over-micro-batches gradients into updated weights, and what it keeps between steps (seed 000's table).

  allreduce  one ring all-reduce of the flat gradient vector, Adam on the whole vector    (2ψ per rank sent)
  ddp        the same sum bucket by bucket (make_buckets below: reverse parameter order, cut at
             bucket_kb), one ring all-reduce per bucket; issued after the pipeline's last backward, or (`overlap`,
             `BucketOverlap`) each as soon as its gradients are final, during the last micro-batch's backward
  zero1      reduce-scatter the gradients, Adam on this dp rank's 1/dp shard, all-gather the weights
             (backend/parallel/zero.Sharded's shards and ring collectives)                   (2ψ)
  zero2      as zero1, but only the gradient shard is kept after the reduce-scatter
  zero3      as zero2, and the weights too stay sharded between steps: all-gathered once at the start of each step
             and kept through its micro-batches (torchtitan's FSDP under a pipeline: reshard_after_forward=False,
             so the gather is not repeated per micro-batch); 2ψ per step, plus one gather to report the weights
  offload    (zero1, zero2) ZeRO-Offload (Ren et al. 2021): the master shard, Adam's m and v and the Adam step live in
             the host pool (backend/parallel/offload.Pools); the gradient shard moves down after the reduce-scatter (in
             the reduce dtype), the updated shard moves up cast to the compute dtype before the all-gather: ψ/dp each way
Adam is elementwise, so updating a shard equals updating those elements of the full vector.
Precision (workload.Precision): the gradients arrive in the reduce dtype and are summed in it; Adam steps the master
copy (and keeps m, v) in the master dtype; the weights the model loads are cast to the compute dtype (ZeRO: the shard
is cast, then all-gathered in the compute dtype, as Megatron's distributed optimizer and FSDP's param_dtype do). In
mixed precision the master copy is a tensor of its own beside the compute copy; in fp64 or fp32 they are one tensor.
"""
from __future__ import annotations

import queue
import threading

import torch
from torch import nn

from backend.parallel.offload import Pools
from backend.parallel.wire import Wire
from backend.parallel.precision import FP64, Adam, Precision
from backend.parallel.zero import Sharded
from backend.trace import Tracer

STRATEGIES = ("allreduce", "ddp", "zero1", "zero2", "zero3", "fsdp2")  # fsdp2: backend/parallel/fsdp.FullyShardedStages


def data_parallel(config, model, weights: torch.Tensor, params: list, mesh, dp: Wire, tracer, precision: Precision = FP64):
    """This rank's dp strategy for its stage chunks (`model`, a ModuleDict): ours over the flat (master) vector
    `weights`, or FSDP2's (float64 only: MeshConfig refuses another precision with it). `comm_delay_ms` (DDP): the dp
    wire, and the overlap thread's, made that slow per collective."""
    dp.delay_s = getattr(config, "comm_delay_ms", 0) / 1000
    if config.dp_strategy == "fsdp2":
        from backend.parallel.fsdp import FullyShardedStages

        return FullyShardedStages(model, mesh.group("dp"), mesh.rank, dp, tracer, config.lr, getattr(config, "offload", False))
    sync = DataParallel(config.dp_strategy, weights, params, dp, tracer, config.lr, config.bucket_kb, precision,
                        getattr(config, "offload", False))
    if getattr(config, "overlap", False):
        from backend.parallel.pp.schedules import SCHEDULES

        sync.overlap = BucketOverlap(params, sync.buckets, Wire(dp.index, dp.n, dp.p2p.ranks or list(range(dp.n)), Tracer(mesh.rank),
                                                                dp.delay_s),
                                     tracer, SCHEDULES[config.schedule].microbatches(config.microbatches), precision.reduce)
    return sync


def named_slices(model: nn.Module, flat: torch.Tensor) -> dict:
    """A flat vector (in the order of model.parameters()) cut into each named parameter's shape, as float64 arrays."""
    out, at = {}, 0
    for name, p_ in model.named_parameters():
        out[name] = flat[at:at + p_.numel()].view(p_.shape).double().numpy().copy()
        at += p_.numel()
    return out


def sum_gradients(wire: Wire, flat: torch.Tensor, what: str) -> torch.Tensor:
    """Ring all-reduce of a flat gradient vector over one mesh dimension (zero-padded to equal chunks)."""
    if wire.n == 1:
        return flat
    padded = torch.zeros(-(-flat.numel() // wire.n) * wire.n, dtype=flat.dtype)
    padded[:flat.numel()] = flat
    return wire.all_reduce(padded, "backward", what)[:flat.numel()]


def make_buckets(params: list[torch.nn.Parameter], bucket_bytes: int, item: int | None = None) -> list[list[torch.nn.Parameter]]:
    """Reverse parameter order (the output layer's gradients are ready first), cut when a bucket reaches bucket_bytes
    (`item`: bytes per gradient element on the wire, when they are reduced in another dtype than the parameters')."""
    buckets, current, size = [], [], 0
    for p in reversed(params):
        current.append(p)
        size += p.numel() * (item or p.element_size())
        if size >= bucket_bytes:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets


def bucket_ranges(params: list, bucket_bytes: int, item: int) -> list[tuple[int, int]]:
    """DDP's buckets (make_buckets: reverse parameter order, cut at bucket_bytes of `item`-byte gradients) as
    (start, end) ranges of the flat vector of `params` in their order."""
    offsets, at = {}, 0
    for p in params:
        offsets[id(p)], at = at, at + p.numel()
    return [(min(offsets[id(p)] for p in b), max(offsets[id(p)] + p.numel() for p in b))
            for b in make_buckets(params, bucket_bytes, item)]


class BucketOverlap:
    """DDP's overlap (seed 000; torch DDP's Reducer): a gradient hook on every parameter counts its accumulations, and a
    bucket whose parameters have all received their last micro-batch's gradient is final, so its ring all-reduce starts
    at once on a communication thread while the backward goes on. Buckets start in index order (the next one waits for
    the one before), so every dp rank runs the same collectives in the same order. The thread's ring runs on a Wire of
    its own over the same dp ranks (its bytes added to the dp dimension's); the main thread's wait for each bucket is
    one "comm" event on the dp tracer from its launch to its end, `blocked_us` the exposed tail (step_split's rule for
    an overlapped message). A bucket whose hooks did not all fire (a gradient not accumulated by autograd) starts
    after the backward, as without overlap (`arm(live=False)`: every bucket so)."""

    def __init__(self, params: list, ranges: list[tuple[int, int]], wire: Wire, tracer, microbatches: int,
                 reduce: torch.dtype):
        self.wire, self.tracer, self.reduce, self.ranges = wire, tracer, reduce, ranges
        offsets, at = {}, 0
        for p in params:
            offsets[id(p)], at = (at, p), at + p.numel()
        self.members = [[p for o, p in sorted(offsets.values(), key=lambda t: t[0]) if a <= o < b] for a, b in ranges]
        self.bucket_of = {id(p): i for i, ps in enumerate(self.members) for p in ps}
        self.need = [len(ps) * microbatches for ps in self.members]
        self.numel = at
        self.armed, self.jobs = False, queue.Queue()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()
        for p in params:
            p.register_post_accumulate_grad_hook(self._on_grad)

    def arm(self, live: bool = True) -> None:
        """A step begins: no bucket counted or launched yet; `live`: the hooks start them (else wait() does)."""
        self.count, self.launched, self.pending, self.armed = [0] * len(self.members), 0, [], live

    def _on_grad(self, p) -> None:
        if not self.armed:
            return
        i = self.bucket_of[id(p)]
        self.count[i] += 1
        while self.launched < len(self.members) and self.count[self.launched] >= self.need[self.launched]:
            self._launch(self.launched)

    def _launch(self, i: int) -> None:
        grads = torch.cat([p.grad.reshape(-1) for p in self.members[i]]).to(self.reduce)
        done = threading.Event()
        self.pending.append((i, grads, done, self.tracer.now_us()))
        self.jobs.put((i, grads, done))
        self.launched = i + 1

    def _serve(self) -> None:
        while (job := self.jobs.get()) is not None:
            i, grads, done = job
            grads.copy_(sum_gradients(self.wire, grads, f"data-parallel gradients, bucket {i} (overlapped)"))
            done.set()

    def wait(self) -> torch.Tensor:
        """The flat gradients summed over dp (buckets not yet started start now), once every bucket's ring has ended."""
        while self.launched < len(self.members):
            self._launch(self.launched)
        self.armed = False
        flat = torch.empty(self.numel, dtype=self.reduce)
        for i, grads, done, launched in self.pending:
            waited = self.tracer.now_us()
            done.wait()
            end = self.tracer.now_us()
            self.tracer.events.append({"name": f"all-reduce bucket {i} (overlapped)", "lane": "comm", "rank": self.tracer.rank,
                                       "ts": launched, "dur": end - launched,
                                       "args": {"bytes": grads.numel() * grads.element_size(), "blocked_us": end - waited,
                                                "overlapped": True}})
            a, b = self.ranges[i]
            flat[a:b] = grads
        return flat

    def close(self) -> None:
        self.jobs.put(None)
        self.thread.join()


class DataParallel:
    """One strategy over `dp` for the flat vector `weights` of `params` (this rank's stages, in order)."""

    def __init__(self, strategy: str, weights: torch.Tensor, params: list, dp: Wire, tracer, lr: float, bucket_kb: int = 4,
                 precision: Precision = FP64, offload: bool = False):
        self.strategy, self.dp, self.tracer, self.precision = strategy, dp, tracer, precision
        weights = weights.to(precision.master)
        self.zero = Sharded([(0, weights.numel())], weights, dp.index, dp.n, dp.p2p) if strategy.startswith("zero") else None
        self.owned = self.zero.shards[0] if self.zero else weights  # the master copy this rank updates
        # the compute copy the model loads (the same tensor unless mixed); zero3 keeps only its master shard between steps
        self.weights = None if strategy == "zero3" else weights.to(precision.compute)
        self.adam, self.m, self.v = Adam(lr), torch.zeros_like(self.owned), torch.zeros_like(self.owned)
        self.buckets = bucket_ranges(params, bucket_kb * 1024, precision.item("reduce")) if strategy == "ddp" else []
        self.grads_kept, self.grad_item = 0, precision.item("reduce")
        self.overlap: BucketOverlap | None = None  # ddp's buckets started during the backward (data_parallel sets it)
        self.pools = Pools() if offload else None  # ZeRO-Offload: what the host pool holds, and the bytes moved
        if self.pools:
            self.pools.place("host", "parameters (master shard)", [self.owned])
            self.pools.place("host", "optimizer states", [self.m, self.v])

    def weights_for_step(self, step: int) -> torch.Tensor | None:
        """The full weights to load before this step's forwards: zero3 gathers them from the shards; None: as loaded."""
        if self.overlap:
            self.overlap.arm()
        if self.strategy != "zero3":
            return None
        with self.tracer.span("collective", f"all-gather weights {step}", kind="collective"):
            return self.zero.gather(0, self.precision.compute)

    def update(self, grads: torch.Tensor, step: int, skip: bool = False) -> torch.Tensor | None:
        """Sum `grads` over dp as the strategy does, Adam on what this rank owns; the full weights to load after the
        step (None for zero3, which gathers them at the next step's start). `skip` (a loss-scaled step that overflowed,
        on every rank alike): the sum is made, then nothing is stepped or gathered (None: the weights stay)."""
        if self.zero:
            with self.tracer.span("collective", f"reduce-scatter gradients {step}", kind="collective"):
                grads = self.zero.reduce_scatter(0, grads)
        elif self.overlap:
            pass  # summed over dp bucket by bucket during the backward (gradients())
        elif self.buckets:
            for i, (a, b) in enumerate(self.buckets):
                grads[a:b] = sum_gradients(self.dp, grads[a:b], f"data-parallel gradients, bucket {i}")
        else:
            grads = sum_gradients(self.dp, grads, "data-parallel gradients")
        self.grads_kept, self.grad_item = grads.numel(), grads.element_size()  # zero2/zero3: the shard only
        if self.pools:
            with self.tracer.span("offload", f"gradient shard to host {step}", kind="offload"):
                grads = self.pools.place("host", "gradients (shard)", [self.pools.move(grads, "host")])[0]
            self.grads_kept = 0  # (zero2) the device's shard is freed once on the host
        if self.strategy == "zero1":
            self.grads_kept = self.zero.segs[0][1]  # zero1 keeps the full gradients; only Adam's state is sharded
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
                self.weights = self.zero.gather(0, self.precision.compute, shard)
        elif not self.zero:
            self.weights = self.compute_weights()
        return self.weights

    def gradients(self, params: list) -> torch.Tensor | None:
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
        return self.zero.gather(0, self.precision.compute) if self.zero else self.owned.to(self.precision.compute)

    def final_weights(self) -> torch.Tensor:
        """The trained master weights, whole: ZeRO-3, and ZeRO-1/2 in mixed precision (whose last all-gather was of the
        compute copy), all-gather them once more in the master dtype (reporting, not training)."""
        if not self.zero:
            return self.owned
        if self.strategy != "zero3" and not self.precision.mixed:
            return self.weights  # the last step's all-gather left the master whole on every rank
        return self.zero.gather(0, self.precision.master)

    def final_named(self, model) -> dict:
        """The trained master weights by name, as float64 arrays (to report them)."""
        return named_slices(model, self.final_weights())

    def entry(self, chunk):
        """The module a stage's forward is called through: none, the chunk's own methods are (FSDP2's differs)."""
        return None

    def memory(self) -> dict[str, int]:
        """Bytes this rank keeps between steps by category, each at its tensor's item size: the compute copy of the
        weights (none between steps under ZeRO-3 unless not mixed: then its shard is the one copy), the master copy
        apart from it (mixed precision only), the gradients Adam read, and Adam's m and v."""
        if self.precision.mixed:
            params = 0 if self.weights is None else self.weights.numel() * self.weights.element_size()
        else:
            params = self.owned.numel() if self.strategy == "zero3" else self.zero.segs[0][1] if self.zero else self.owned.numel()
            params *= self.owned.element_size()
        out = {"parameters": params, "gradients": self.grads_kept * self.grad_item,
               "optimizer states": sum(t.numel() * t.element_size() for t in (self.m, self.v))}
        if self.precision.mixed:
            out["master weights"] = self.owned.numel() * self.owned.element_size()
        if self.pools:  # the master shard and Adam's states are the host's (host_memory)
            out.update({k: 0 for k in ("optimizer states", "master weights") if k in out})
        return out

    def host_memory(self) -> dict[str, int]:
        """Bytes in the host pool by category (ZeRO-Offload; nothing otherwise)."""
        return self.pools.bytes("host") if self.pools else {}

    def moved(self) -> dict[str, int]:
        """Bytes copied between the pools over the run's steps, by direction (ZeRO-Offload; none otherwise)."""
        return dict(self.pools.moved) if self.pools else {}
