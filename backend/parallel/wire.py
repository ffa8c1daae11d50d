"""The one communication front end of the parallel code: every collective and point-to-point transfer along one mesh
dimension, run by our own algorithms (backend/comm/collectives.py) over one logged P2P, pipeline messages (`send`,
`recv`) and ring attention's K/V steps (`start`, `finish`) included. So `sent_bytes` is what this rank really sent
along the dimension, and every call is one trace event and one log row (op, phase, name, payload elements, bytes
sent), which the experiments' models predict exactly.
"""
from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F

from backend.comm.collectives import Spec, all_gather_ring, all_reduce_ring, all_to_all_direct, reduce_scatter_ring
from backend.comm.p2p import P2P, Transfer


class Wire:
    """`delay_s`: a simulated slow link, every collective along the dimension waits that long first, inside its span
    (so the step split counts it as this dimension's communication; parallel.ddp's comm_delay_ms on the dp wire)."""

    def __init__(self, index: int, n: int, ranks: list[int], tracer, delay_s: float = 0.0):
        self.n, self.index, self.tracer, self.delay_s = n, index, tracer, delay_s
        self.p2p = P2P(index, n, tracer, ranks=ranks)
        self.log: list[dict] = []

    @classmethod
    def along(cls, mesh, dim: str, tracer) -> "Wire":
        return cls(mesh.index(dim), mesh.size(dim), mesh.ranks(dim), tracer)

    @classmethod
    def alone(cls, rank: int, tracer) -> "Wire":
        """A group of one: the same code path with nothing to send (the single-process layout)."""
        return cls(0, 1, [rank], tracer)

    def _run(self, op: str, phase: str, name: str, x: torch.Tensor, fn):
        before = self.p2p.bytes_sent
        with self.tracer.span("collective", f"{op} {name}", phase=phase, numel=x.numel()):
            if self.delay_s:
                time.sleep(self.delay_s)
            out = fn()
        self.log.append({"op": op, "phase": phase, "name": name, "numel": x.numel(),
                         "payload_bytes": x.numel() * x.element_size(), "sent_bytes": self.p2p.bytes_sent - before})
        return out

    def all_reduce(self, x: torch.Tensor, phase: str, name: str, op: str = "sum") -> torch.Tensor:
        """Sum (ring); `op="max"` is an all-gather and a local max (elementwise max needs no ring of its own)."""
        if op == "max":
            return self.all_gather(x.unsqueeze(0), 0, phase, name).amax(0)
        flat = x.detach().contiguous().view(-1)
        return self._run("all_reduce", phase, name, flat,
                         lambda: all_reduce_ring(self.p2p, flat, Spec("all_reduce", flat.numel())).view_as(x))

    def all_gather(self, x: torch.Tensor, dim: int, phase: str, name: str) -> torch.Tensor:
        """Concatenate every rank's x along `dim`, in rank order."""
        front = x.detach().movedim(dim, 0).contiguous()
        out = self._run("all_gather", phase, name, front,
                        lambda: all_gather_ring(self.p2p, front.view(-1), Spec("all_gather", front.numel())))
        return out.view(self.n * front.shape[0], *front.shape[1:]).movedim(0, dim)

    def reduce_scatter(self, x: torch.Tensor, dim: int, phase: str, name: str) -> torch.Tensor:
        """Sum over ranks, then keep this rank's slice along `dim` (which must divide by n)."""
        front = x.detach().movedim(dim, 0).contiguous()
        out = self._run("reduce_scatter", phase, name, front,
                        lambda: reduce_scatter_ring(self.p2p, front.view(-1), Spec("reduce_scatter", front.numel())))
        return out.view(front.shape[0] // self.n, *front.shape[1:]).movedim(0, dim)

    def all_to_all(self, x: torch.Tensor, send_rows: list[int], recv_rows: list[int], phase: str, name: str) -> torch.Tensor:
        """Rows of x (dim 0) to each rank in turn, send_rows[r] of them to rank r; uneven splits allowed."""
        row = math.prod(x.shape[1:])
        flat = x.detach().contiguous().view(-1)
        spec = Spec("all_to_all", flat.numel(), send_splits=tuple(r * row for r in send_rows),
                    recv_splits=tuple(r * row for r in recv_rows))
        out = self._run("all_to_all", phase, name, flat, lambda: all_to_all_direct(self.p2p, flat, spec))
        return out.view(sum(recv_rows), *x.shape[1:])

    def send(self, t: torch.Tensor, peer: int, tag: int, name: str, **args):
        """Post `t` to group rank `peer` without waiting (a pipeline stage's output or input gradient); returns the
        request. One instant on the "send" lane marks the post (a replay matches the receive to it)."""
        t = t.detach().contiguous()
        self.tracer.events.append({"name": name, "lane": "send", "rank": self.tracer.rank, "ts": self.tracer.now_us(),
                                   "dur": 0.0, "cpu_us": 0.0, "args": {"peer": self.p2p._global(peer), "tag": tag, **args}})
        self.log.append({"op": "send", "phase": "send", "name": name, "numel": t.numel(),
                         "payload_bytes": t.numel() * t.element_size(), "sent_bytes": t.numel() * t.element_size()})
        return self.p2p.post("send", sends=[Transfer(t, peer, [])], tag=tag)[0]

    def recv(self, buf: torch.Tensor, peer: int, tag: int, name: str, **args) -> torch.Tensor:
        """Receive into `buf` from group rank `peer`, blocking (a span on the "recv" lane: the wait is exposed)."""
        with self.tracer.span("recv", name, peer=self.p2p._global(peer), tag=tag, **args):
            self.p2p.post("recv", recvs=[Transfer(buf, peer, [])], tag=tag)[0].wait()
        return buf

    def start(self, t: torch.Tensor, tag: int, name: str):
        """One ring step posted: `t` to the next group rank, a buffer like it from the previous; wait with finish()."""
        incoming = torch.empty_like(t)
        reqs = self.p2p.post("ring", [Transfer(t, (self.index + 1) % self.n, [])],
                             [Transfer(incoming, (self.index - 1) % self.n, [])], tag=tag)
        return reqs, incoming, self.tracer.now_us(), name, t.numel() * t.element_size()

    def finish(self, handle) -> torch.Tensor:
        """Wait for a ring step: one "comm" event from its post to its end, `blocked_us` the exposed tail."""
        reqs, incoming, posted, name, nbytes = handle
        waited = self.tracer.now_us()
        for r in reqs:
            r.wait()
        end = self.tracer.now_us()
        self.tracer.events.append({"name": name, "lane": "comm", "rank": self.tracer.rank, "ts": posted, "dur": end - posted,
                                   "args": {"bytes": nbytes, "blocked_us": end - waited}})
        self.log.append({"op": "ring", "phase": "ring", "name": name, "numel": incoming.numel(), "payload_bytes": nbytes,
                         "sent_bytes": nbytes, "in_flight_us": end - posted, "blocked_us": end - waited})
        return incoming

    def sent(self, op: str | None = None, names=None) -> int:
        """Bytes sent by the calls of `op` (and among `names`); everything this rank sent along the dimension when
        both are None (collectives, pipeline messages, ring steps and ZeRO's shards, all through the one P2P log)."""
        if op is None and names is None:
            return self.p2p.bytes_sent
        return sum(r["sent_bytes"] for r in self.log if (op is None or r["op"] == op) and (names is None or r["name"] in names))


def padded(flat: torch.Tensor, n: int) -> torch.Tensor:
    """`flat` zero-padded to a multiple of n elements (a ring cuts its vector into n equal chunks)."""
    return F.pad(flat, (0, -flat.numel() % n))


def sum_gradients(wire: Wire, flat: torch.Tensor, what: str) -> torch.Tensor:
    """Ring all-reduce of a flat gradient vector over one mesh dimension (zero-padded to equal chunks)."""
    if wire.n == 1:
        return flat
    return wire.all_reduce(padded(flat, wire.n), "backward", what)[:flat.numel()]
