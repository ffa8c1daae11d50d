"""Our DDP on the mesh's dp dimension (seed 000), driven by mesh_dp.DataParallel: one ring all-reduce per bucket
(`make_buckets`), after the pipeline's last backward or (`BucketOverlap`) as soon as a bucket's gradients are final.
A bucket padded to P elements (a multiple of n) sends 2P(n-1)/n per rank, counted on our Wire's send/recv.
"""
from __future__ import annotations

import queue
import threading
from itertools import accumulate

import torch

from backend.parallel.wire import Wire, sum_gradients


def make_buckets(params: list[torch.nn.Parameter], bucket_bytes: int,
                 item: int | None = None) -> list[list[torch.nn.Parameter]]:
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


def bucket_ranges(params: list, buckets: list[list]) -> list[tuple[int, int]]:
    """Each bucket (make_buckets: consecutive parameters from the last) as its (start, end) range of the flat vector
    of `params` in their order."""
    sizes = accumulate((sum(p.numel() for p in bucket) for bucket in buckets), initial=0)
    ends = [sum(p.numel() for p in params) - size for size in sizes]
    return list(zip(ends[1:], ends[:-1]))


class BucketOverlap:
    """DDP's overlap (torch DDP's Reducer): gradient hooks count each parameter's accumulations, and a bucket whose
    parameters have all received their last micro-batch's gradient starts its ring all-reduce on a communication
    thread (its own Wire over the same dp ranks, its bytes counted as dp's) while the backward goes on. Buckets start
    in index order, so every dp rank runs the same collectives in the same order. The main thread's wait for a bucket
    is one "comm" event from its launch to its end, `blocked_us` its exposed tail. A bucket whose hooks did not all
    fire (a gradient not accumulated by autograd) starts after the backward (`arm(live=False)`: every bucket so)."""

    def __init__(self, buckets: list[list], ranges: list[tuple[int, int]], wire: Wire, tracer, microbatches: int,
                 reduce: torch.dtype):
        self.wire, self.tracer, self.reduce, self.ranges = wire, tracer, reduce, ranges
        self.members = [bucket[::-1] for bucket in buckets]  # each in the flat vector's order
        self.bucket_of = {id(p): i for i, ps in enumerate(self.members) for p in ps}
        self.need = [len(ps) * microbatches for ps in self.members]
        self.armed, self.jobs = False, queue.Queue()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()
        for bucket in buckets:
            for p in bucket:
                p.register_post_accumulate_grad_hook(self._on_grad)

    def arm(self, live: bool = True) -> None:
        """A step begins: no bucket counted or launched yet; `live`: the hooks start them (else wait() does)."""
        self.count, self.launched, self.pending, self.armed = [0] * len(self.members), 0, [], live

    def _on_grad(self, p) -> None:
        if not self.armed:
            return
        self.count[self.bucket_of[id(p)]] += 1
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
        flat = torch.empty(self.ranges[0][1], dtype=self.reduce)
        for i, grads, done, launched in self.pending:
            waited = self.tracer.now_us()
            done.wait()
            end = self.tracer.now_us()
            self.tracer.events.append({"name": f"all-reduce bucket {i} (overlapped)", "lane": "comm",
                                       "rank": self.tracer.rank, "ts": launched, "dur": end - launched,
                                       "args": {"bytes": grads.numel() * grads.element_size(),
                                                "blocked_us": end - waited, "overlapped": True}})
            a, b = self.ranges[i]
            flat[a:b] = grads
        return flat

    def close(self) -> None:
        self.jobs.put(None)
        self.thread.join()
