"""Point-to-point transfers with a step log: the one place where collectives move bytes.

`exchange(step, sends, recvs)` posts every isend and irecv of one algorithm step at once and waits
for all of them, so a rank can send to its right neighbour while it receives from its left. Each
transfer is logged as (step, phase, src, dst, blocks, numel, bytes, kind) and counted in the
tracer's byte counters; the whole step is one trace event on the "comm" lane, and reductions are
timed on the "compute" lane. `blocks` names which pieces of the buffer moved, so a page can replay
who holds what after every step; `kind` says whether the receiver adds ("reduce") or stores ("copy").
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from backend.trace import Tracer


@dataclass
class Transfer:
    tensor: torch.Tensor
    peer: int
    blocks: list[int]
    kind: str = "copy"  # "reduce": the receiver adds what arrives; "copy": it stores it


@dataclass
class P2P:
    rank: int
    world: int
    tracer: Tracer
    log: list[dict] = field(default_factory=list)
    ranks: list[int] | None = None  # global rank of each group rank (a process group of a mesh); None: the world

    def _global(self, peer: int) -> int:
        return peer if self.ranks is None else self.ranks[peer]

    def exchange(self, step: int, phase: str, sends: list[Transfer] = (), recvs: list[Transfer] = ()) -> None:
        reqs = [dist.isend(t.tensor, self._global(t.peer)) for t in sends] + [dist.irecv(t.tensor, self._global(t.peer)) for t in recvs]
        with self.tracer.span("comm", f"{phase} step {step}", step=step,
                              sends=[(t.peer, t.blocks) for t in sends], recvs=[(t.peer, t.blocks) for t in recvs]):
            for req in reqs:
                req.wait()
        self._record(step, phase, sends, recvs)

    def exchange_pipelined(self, step: int, phase: str, send: Transfer, recv: Transfer, segment_numel: int,
                           on_segment=None) -> None:
        """One send and one receive, cut into segments all posted at once; `on_segment(k, piece)` runs on
        each received segment while later ones are still in flight (so a ring's additions overlap its
        transfers). Logged as one transfer each way, like exchange()."""
        send_parts, recv_parts = send.tensor.split(segment_numel), recv.tensor.split(segment_numel)
        with self.tracer.span("comm", f"{phase} step {step}", step=step, sends=[(send.peer, send.blocks)],
                              recvs=[(recv.peer, recv.blocks)], segments=len(recv_parts)):
            send_reqs = [dist.isend(part, self._global(send.peer)) for part in send_parts]
            recv_reqs = [dist.irecv(part, self._global(recv.peer)) for part in recv_parts]
            for k, req in enumerate(recv_reqs):
                req.wait()
                if on_segment:
                    on_segment(k, recv_parts[k])
            for req in send_reqs:
                req.wait()
        self._record(step, phase, [send], [recv])

    def post(self, phase: str, sends: list[Transfer] = (), recvs: list[Transfer] = (), tag: int = 0) -> list:
        """Post isends and irecvs without waiting (a pipeline's send, a ring message overlapping compute): the
        transfers are logged now, as posted; the caller waits on the returned requests."""
        reqs = [dist.isend(t.tensor.contiguous(), self._global(t.peer), tag=tag) for t in sends] + \
               [dist.irecv(t.tensor, self._global(t.peer), tag=tag) for t in recvs]
        self._record(None, phase, sends, recvs)
        return reqs

    def recv_any(self, tensor: torch.Tensor, phase: str) -> int:
        """Receive into `tensor` from whichever rank sends first (a parameter server's inbox); returns the sender."""
        sender = dist.recv(tensor, src=None)
        self._record(None, phase, [], [Transfer(tensor, sender, [])])
        return sender

    def _record(self, step, phase, sends, recvs) -> None:
        for direction, transfers in (("send", sends), ("recv", recvs)):
            for t in transfers:
                nbytes = t.tensor.numel() * t.tensor.element_size()
                src, dst = (self.rank, t.peer) if direction == "send" else (t.peer, self.rank)
                self.log.append({"step": step, "phase": phase, "dir": direction, "src": src, "dst": dst,
                                 "blocks": list(t.blocks), "numel": t.tensor.numel(), "bytes": nbytes, "kind": t.kind})
                self.tracer.count(phase, sent=nbytes if direction == "send" else 0, recv=nbytes if direction == "recv" else 0)

    @contextlib.contextmanager
    def compute(self, name: str, **args):
        with self.tracer.span("compute", name, **args):
            yield

    @property
    def bytes_sent(self) -> int:
        return sum(e["bytes"] for e in self.log if e["dir"] == "send")

    @property
    def bytes_recv(self) -> int:
        return sum(e["bytes"] for e in self.log if e["dir"] == "recv")
