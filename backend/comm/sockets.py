"""What gloo really writes to its sockets (Linux's per-thread write counters), and what its own collectives send:
the measurement beside our logged bytes, for a peer (PyTorch's DTensor) whose messages we do not log ourselves."""
from __future__ import annotations

import threading

from backend.comm.collectives import ring_bytes


GLOO_PREAMBLE = 48  # bytes gloo's TCP transport writes ahead of every message (Op::Preamble: six 8-byte fields)


def gloo_bytes(op: str, numel: int, n: int, item: int) -> int:
    """What one rank sends in gloo's own collectives, as measured by WrittenBytes (tests/test_tensor_parallel.py):
    a ring all-reduce and all-gather, the same volumes as ours; but no reduce-scatter of its own: ProcessGroupGloo
    all-reduces the whole input and keeps its slice, so a reduce-scatter costs an all-reduce."""
    return ring_bytes("all_reduce" if op == "reduce_scatter" else op, numel, n, item)


class WrittenBytes:
    """Bytes this process handed to write system calls inside a `with` block, and how many calls (Linux's
    /proc/self/io wchar and syscw), less what its other Python threads wrote meanwhile (a run leader's heartbeat
    to the store, a result queue's feeder: /proc/self/task/TID/io). What remains is this thread's and gloo's own
    C++ threads': on a rank that writes no file meanwhile, what gloo put on its sockets, every message's payload
    and its GLOO_PREAMBLE, so `payload` = bytes - calls x GLOO_PREAMBLE. None where there is no /proc (then
    nothing is measured, and nothing claimed)."""

    def __init__(self):
        self.bytes = self.calls = self.payload = None

    @staticmethod
    def _io(path: str) -> tuple[int, int]:
        fields = dict(line.split(": ") for line in open(path).read().splitlines())
        return int(fields["wchar"]), int(fields["syscw"])

    @classmethod
    def _read(cls):
        try:
            written, calls = cls._io("/proc/self/io")
            for t in threading.enumerate():
                if t is not threading.current_thread() and t.native_id is not None:
                    try:
                        other = cls._io(f"/proc/self/task/{t.native_id}/io")
                    except OSError:  # the thread ended between the listing and the read
                        continue
                    written, calls = written - other[0], calls - other[1]
        except OSError:
            return None
        return written, calls

    def __enter__(self):
        self._start = self._read()
        return self

    def __exit__(self, *exc):
        end = self._read()
        if self._start and end:
            self.bytes, self.calls = end[0] - self._start[0], end[1] - self._start[1]
            self.payload = self.bytes - self.calls * GLOO_PREAMBLE
