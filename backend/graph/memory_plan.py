"""Memory planning: when each buffer is live, and where in one arena it goes so that buffers whose
lifetimes overlap never share bytes.

A buffer is live from the step that writes it to the last step that reads it (or reads a view of it).
Offsets are chosen greedily, largest buffer first, at the lowest aligned offset free for its whole
lifetime. The arena that results is compared with the lower bound (the most bytes live at any one step)
and with giving every buffer its own memory at the same alignment (no reuse), which it never exceeds.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class Buffer:
    name: str
    nbytes: int
    start: int   # step that writes it
    end: int     # last step that reads it

    def overlaps_in_time(self, other: "Buffer") -> bool:
        return self.start <= other.end and other.start <= self.end


@dataclasses.dataclass
class MemoryPlan:
    buffers: list[Buffer]
    offsets: dict[str, int]
    arena_bytes: int
    lower_bound_bytes: int
    no_reuse_bytes: int
    live_bytes: list[int]           # bytes live at each step

    def conflicts(self) -> list[tuple[str, str]]:
        """Pairs of buffers live at the same time whose bytes overlap: must be empty."""
        out = []
        for i, a in enumerate(self.buffers):
            for b in self.buffers[i + 1:]:
                if a.overlaps_in_time(b):
                    oa, ob = self.offsets[a.name], self.offsets[b.name]
                    if oa < ob + b.nbytes and ob < oa + a.nbytes:
                        out.append((a.name, b.name))
        return out


def plan(buffers: list[Buffer], steps: int, align: int = 64) -> MemoryPlan:
    offsets: dict[str, int] = {}
    placed: list[Buffer] = []
    for buf in sorted(buffers, key=lambda b: (-b.nbytes, b.start, b.name)):
        busy = sorted((offsets[p.name], offsets[p.name] + p.nbytes) for p in placed if p.overlaps_in_time(buf))
        offset = 0
        for lo, hi in busy:
            if offset + buf.nbytes <= lo:
                break
            offset = max(offset, -(-hi // align) * align)
        offsets[buf.name] = offset
        placed.append(buf)
    live = [sum(b.nbytes for b in buffers if b.start <= s <= b.end) for s in range(steps)]
    return MemoryPlan(buffers, offsets, max((offsets[b.name] + b.nbytes for b in buffers), default=0),
                      max(live, default=0), no_reuse_bytes(buffers, align), live)


def no_reuse_bytes(buffers: list[Buffer], align: int) -> int:
    """Every buffer its own bytes, one after another at aligned offsets: the arena without any reuse."""
    end = 0
    for b in buffers:
        end = -(-end // align) * align + b.nbytes
    return end
