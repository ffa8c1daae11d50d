"""Every collective built from point-to-point transfers (backend/comm/p2p.py), in several algorithms.

A buffer of `numel` elements is split into n chunks the way torch.tensor_split does (the first
numel % n chunks get one extra element), so sizes need not divide by the world size.

Ring all-reduce follows seed 000: scatter-reduce for n-1 steps, in step i rank j sends chunk
(j - i) % n to rank j+1 and receives chunk (j - i - 1) % n from rank j-1, adding it; rank j then
holds the fully reduced chunk (j + 1) % n. All-gather for n-1 steps: in step i rank j sends chunk
(j + 1 - i) % n and receives chunk (j - i) % n. (The seed writes (j - i - 1) and (j - i - 2) for
the all-gather; the live run compares both with what a correct run sends.)

Each algorithm is `fn(p2p, x, spec) -> output` where output is this rank's result (None where the
op leaves nothing on this rank). `builtin` calls gloo's own collective.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from backend.comm.p2p import P2P, Transfer


@dataclass(frozen=True)
class Spec:
    op: str
    numel: int
    root: int = 0
    send_splits: tuple[int, ...] = ()  # all_to_all: elements this rank sends to each rank
    recv_splits: tuple[int, ...] = ()  # all_to_all: elements this rank receives from each rank


def chunk_sizes(numel: int, n: int) -> list[int]:
    return [numel // n + (1 if i < numel % n else 0) for i in range(n)]


# --- ring ---------------------------------------------------------------------------------------------
# Ring steps move a chunk in segments of this many elements, so the addition of one segment overlaps the
# transfer of the next (gloo's own ring pipelines the same way); 1 MiB of fp32.
SEGMENT_NUMEL = 1 << 18


def _ring_reduce_scatter(c: P2P, chunks: list[torch.Tensor], shift: int, step: int) -> int:
    """n-1 steps; in step i rank j sends chunk (j - i + shift) % n. shift 0: rank j ends with (j+1) % n."""
    n, j = c.world, c.rank
    incoming_buffer = torch.empty(max(ch.numel() for ch in chunks), dtype=chunks[0].dtype)  # reused every step
    for i in range(n - 1):
        s, r = (j - i + shift) % n, (j - i - 1 + shift) % n
        incoming = incoming_buffer[:chunks[r].numel()]
        target = chunks[r].split(SEGMENT_NUMEL)

        def add(k, piece, target=target, r=r):
            with c.compute("add", chunk=r, segment=k):
                target[k].add_(piece)
        c.exchange_pipelined(step, "scatter-reduce", Transfer(chunks[s], (j + 1) % n, [s], "reduce"),
                             Transfer(incoming, (j - 1) % n, [r], "reduce"), SEGMENT_NUMEL, add)
        step += 1
    return step


def _ring_all_gather(c: P2P, chunks: list[torch.Tensor], own: int, step: int) -> int:
    """n-1 steps; rank j starts with chunk (j + own) % n and in step i sends chunk (j + own - i) % n."""
    n, j = c.world, c.rank
    for i in range(n - 1):
        s, r = (j + own - i) % n, (j + own - i - 1) % n
        c.exchange_pipelined(step, "all-gather", Transfer(chunks[s], (j + 1) % n, [s]),
                             Transfer(chunks[r], (j - 1) % n, [r]), SEGMENT_NUMEL)
        step += 1
    return step


def all_reduce_ring(c, x, spec):
    out = x.clone()
    chunks = list(out.tensor_split(c.world))
    step = _ring_reduce_scatter(c, chunks, shift=0, step=0)
    _ring_all_gather(c, chunks, own=1, step=step)
    return out


def reduce_scatter_ring(c, x, spec):
    chunks = list(x.clone().tensor_split(c.world))
    _ring_reduce_scatter(c, chunks, shift=-1, step=0)  # shift -1: rank j ends with chunk j
    return chunks[c.rank].clone()


def all_gather_ring(c, x, spec):
    out = torch.empty(c.world * x.numel(), dtype=x.dtype)
    chunks = list(out.tensor_split(c.world))
    chunks[c.rank].copy_(x)
    _ring_all_gather(c, chunks, own=0, step=0)
    return out


# --- binomial tree ------------------------------------------------------------------------------------
def _tree_broadcast(c: P2P, buf, root: int, step: int, blocks: list[int]) -> int:
    """ceil(log2 n) steps; in the step with distance m, relative ranks v < m send to v + m."""
    n, v, m = c.world, (c.rank - root) % c.world, 1
    while m < n:
        if v < m and v + m < n:
            c.exchange(step, "broadcast", sends=[Transfer(buf, (v + m + root) % n, blocks)])
        elif m <= v < 2 * m:
            c.exchange(step, "broadcast", recvs=[Transfer(buf, (v - m + root) % n, blocks)])
        m, step = 2 * m, step + 1
    return step


def _tree_reduce(c: P2P, buf, root: int, step: int, blocks: list[int]) -> int:
    """ceil(log2 n) steps; relative rank v adds v + m's partial sum while bit m of v is 0, then sends to v - m."""
    n, v, m, done = c.world, (c.rank - root) % c.world, 1, False
    while m < n:
        if not done and v & m:
            c.exchange(step, "reduce", sends=[Transfer(buf, (v - m + root) % n, blocks, "reduce")])
            done = True
        elif not done and v + m < n:
            incoming = torch.empty_like(buf)
            c.exchange(step, "reduce", recvs=[Transfer(incoming, (v + m + root) % n, blocks, "reduce")])
            with c.compute("add"):
                buf += incoming
        m, step = 2 * m, step + 1
    return step


def broadcast_tree(c, x, spec):
    buf = x.clone()
    _tree_broadcast(c, buf, spec.root, 0, list(range(c.world)))
    return buf


def reduce_tree(c, x, spec):
    buf = x.clone()
    _tree_reduce(c, buf, spec.root, 0, list(range(c.world)))
    return buf if c.rank == spec.root else None


def all_reduce_tree(c, x, spec):
    buf = x.clone()
    step = _tree_reduce(c, buf, 0, 0, list(range(c.world)))
    _tree_broadcast(c, buf, 0, step, list(range(c.world)))
    return buf


# --- recursive halving-doubling (Rabenseifner), any n ---------------------------------------------------
def all_reduce_halving_doubling(c, x, spec):
    """Fold the n - p extra ranks into partners (p = largest power of two <= n), reduce-scatter by recursive
    halving over p blocks, all-gather by recursive doubling, then unfold. Blocks are the p pieces of x."""
    n, rank = c.world, c.rank
    p = 1 << (n.bit_length() - 1)
    extra = n - p
    out = x.clone()
    blocks = list(out.tensor_split(p))
    offsets = [0]
    for b in blocks:
        offsets.append(offsets[-1] + b.numel())
    every = list(range(p))
    piece = lambda lo, hi: out[offsets[lo]:offsets[hi]]  # noqa: E731  (a contiguous view of blocks lo..hi-1)
    step = 0
    if extra:  # fold: even ranks below 2*extra hand their whole vector to the odd rank above them
        if rank < 2 * extra and rank % 2 == 0:
            c.exchange(step, "fold", sends=[Transfer(out, rank + 1, every, "reduce")])
        elif rank < 2 * extra:
            incoming = torch.empty_like(out)
            c.exchange(step, "fold", recvs=[Transfer(incoming, rank - 1, every, "reduce")])
            with c.compute("add"):
                out += incoming
        step += 1
    new = -1 if (rank < 2 * extra and rank % 2 == 0) else (rank // 2 if rank < 2 * extra else rank - extra)
    real = lambda v: 2 * v + 1 if v < extra else v + extra  # noqa: E731
    halvings = p.bit_length() - 1
    if new >= 0:
        lo, hi, m = 0, p, p // 2
        while m >= 1:  # recursive halving: keep the half named by bit m of new, send the other half
            mid = (lo + hi) // 2
            keep, give = ((lo, mid), (mid, hi)) if not new & m else ((mid, hi), (lo, mid))
            incoming = torch.empty_like(piece(*keep))
            c.exchange(step, "halving", [Transfer(piece(*give), real(new ^ m), list(range(*give)), "reduce")],
                       [Transfer(incoming, real(new ^ m), list(range(*keep)), "reduce")])
            with c.compute("add"):
                piece(*keep).add_(incoming)
            lo, hi = keep
            m, step = m // 2, step + 1
        m = 1
        while m < p:  # recursive doubling: swap ranges with the partner, the range doubles
            partner_lo = lo - (hi - lo) if new & m else hi  # the partner's range sits beside ours
            partner = (partner_lo, partner_lo + (hi - lo))
            c.exchange(step, "doubling", [Transfer(piece(lo, hi), real(new ^ m), list(range(lo, hi)))],
                       [Transfer(piece(*partner), real(new ^ m), list(range(*partner)))])
            lo, hi = min(lo, partner[0]), max(hi, partner[1])
            m, step = 2 * m, step + 1
    else:
        step += 2 * halvings
    if extra:  # unfold: the odd partner returns the result
        if rank < 2 * extra and rank % 2 == 1:
            c.exchange(step, "unfold", sends=[Transfer(out, rank - 1, every)])
        elif rank < 2 * extra:
            c.exchange(step, "unfold", recvs=[Transfer(out, rank + 1, every)])
    return out


# --- direct (naive) -------------------------------------------------------------------------------------
def _others(c):
    return [r for r in range(c.world) if r != c.rank]


def send_recv_direct(c, x, spec):
    if c.rank == 0:
        c.exchange(0, "send", sends=[Transfer(x, 1, [0])])
    elif c.rank == 1:
        out = torch.empty_like(x)
        c.exchange(0, "send", recvs=[Transfer(out, 0, [0])])
        return out
    return None


def broadcast_direct(c, x, spec):
    buf, every = x.clone(), list(range(c.world))
    if c.rank == spec.root:
        c.exchange(0, "broadcast", sends=[Transfer(buf, r, every) for r in _others(c)])
    else:
        c.exchange(0, "broadcast", recvs=[Transfer(buf, spec.root, every)])
    return buf


def reduce_direct(c, x, spec):
    every = list(range(c.world))
    if c.rank != spec.root:
        c.exchange(0, "reduce", sends=[Transfer(x, spec.root, every, "reduce")])
        return None
    incoming = {r: torch.empty_like(x) for r in _others(c)}
    c.exchange(0, "reduce", recvs=[Transfer(t, r, every, "reduce") for r, t in incoming.items()])
    with c.compute("add"):
        return x + sum(incoming.values())


def scatter_direct(c, x, spec):
    if c.rank == spec.root:
        chunks = x.tensor_split(c.world)
        c.exchange(0, "scatter", sends=[Transfer(chunks[r], r, [r]) for r in _others(c)])
        return chunks[c.rank].clone()
    out = torch.empty(chunk_sizes(spec.numel, c.world)[c.rank], dtype=x.dtype)
    c.exchange(0, "scatter", recvs=[Transfer(out, spec.root, [c.rank])])
    return out


def gather_direct(c, x, spec):
    if c.rank != spec.root:
        c.exchange(0, "gather", sends=[Transfer(x, spec.root, [c.rank])])
        return None
    out = torch.empty(c.world * x.numel(), dtype=x.dtype)
    chunks = out.tensor_split(c.world)
    chunks[c.rank].copy_(x)
    c.exchange(0, "gather", recvs=[Transfer(chunks[r], r, [r]) for r in _others(c)])
    return out


def all_reduce_direct(c, x, spec):
    every = list(range(c.world))
    incoming = {r: torch.empty_like(x) for r in _others(c)}
    c.exchange(0, "all-to-all", [Transfer(x, r, every, "reduce") for r in _others(c)],
               [Transfer(t, r, every, "reduce") for r, t in incoming.items()])
    with c.compute("add"):
        return x + sum(incoming.values())


def all_gather_direct(c, x, spec):
    out = torch.empty(c.world * x.numel(), dtype=x.dtype)
    chunks = out.tensor_split(c.world)
    chunks[c.rank].copy_(x)
    c.exchange(0, "all-gather", [Transfer(x, r, [c.rank]) for r in _others(c)],
               [Transfer(chunks[r], r, [r]) for r in _others(c)])
    return out


def reduce_scatter_direct(c, x, spec):
    chunks = x.tensor_split(c.world)
    incoming = {r: torch.empty_like(chunks[c.rank]) for r in _others(c)}
    c.exchange(0, "reduce-scatter", [Transfer(chunks[r], r, [r], "reduce") for r in _others(c)],
               [Transfer(t, r, [c.rank], "reduce") for r, t in incoming.items()])
    with c.compute("add"):
        return chunks[c.rank] + sum(incoming.values())


def all_to_all_direct(c, x, spec):
    sends = x.split(list(spec.send_splits))
    out = torch.empty(sum(spec.recv_splits), dtype=x.dtype)
    recvs = out.split(list(spec.recv_splits))
    recvs[c.rank].copy_(sends[c.rank])
    c.exchange(0, "all-to-all", [Transfer(sends[r], r, [r]) for r in _others(c) if sends[r].numel()],
               [Transfer(recvs[r], r, [c.rank]) for r in _others(c) if recvs[r].numel()])
    return out


def barrier_direct(c, x, spec):
    """Everyone tells the root it arrived (step 0); the root then releases everyone (step 1)."""
    token = torch.zeros(1, dtype=x.dtype)
    if c.rank == spec.root:
        c.exchange(0, "arrive", recvs=[Transfer(torch.empty_like(token), r, []) for r in _others(c)])
        c.exchange(1, "release", sends=[Transfer(token, r, []) for r in _others(c)])
    else:
        c.exchange(0, "arrive", sends=[Transfer(token, spec.root, [])])
        c.exchange(1, "release", recvs=[Transfer(torch.empty_like(token), spec.root, [])])
    return None


# --- gloo's built-in ----------------------------------------------------------------------------------
def _padded_chunks(x, n):
    """Equal-sized chunks (gloo's scatter and reduce_scatter need them): each zero-padded to the largest."""
    m = -(-x.numel() // n)
    padded = torch.zeros(n, m, dtype=x.dtype)
    for i, ch in enumerate(x.tensor_split(n)):
        padded[i, :ch.numel()] = ch
    return padded


def builtin(c, x, spec):
    n, rank, root = c.world, c.rank, spec.root
    op = spec.op
    if op == "send_recv":
        if rank == 0:
            dist.send(x, 1)
        elif rank == 1:
            out = torch.empty_like(x)
            dist.recv(out, 0)
            return out
        return None
    if op in ("all_reduce", "broadcast", "reduce"):
        buf = x.clone()
        {"all_reduce": lambda: dist.all_reduce(buf), "broadcast": lambda: dist.broadcast(buf, root),
         "reduce": lambda: dist.reduce(buf, root)}[op]()
        return None if op == "reduce" and rank != root else buf
    if op == "scatter":
        out = torch.empty(-(-spec.numel // n), dtype=x.dtype)
        dist.scatter(out, list(_padded_chunks(x, n)) if rank == root else None, src=root)
        return out[:chunk_sizes(spec.numel, n)[rank]]
    if op == "gather":
        bufs = [torch.empty_like(x) for _ in range(n)] if rank == root else None
        dist.gather(x, bufs, dst=root)
        return torch.cat(bufs) if rank == root else None
    if op == "all_gather":
        out = torch.empty(n * x.numel(), dtype=x.dtype)
        dist.all_gather_single(out, x)
        return out
    if op == "reduce_scatter":
        out = torch.empty(-(-spec.numel // n), dtype=x.dtype)
        dist.reduce_scatter_single(out, _padded_chunks(x, n).reshape(-1))
        return out[:chunk_sizes(spec.numel, n)[rank]]
    if op == "all_to_all":
        out = torch.empty(sum(spec.recv_splits), dtype=x.dtype)
        dist.all_to_all_single(out, x, output_split_sizes=list(spec.recv_splits), input_split_sizes=list(spec.send_splits))
        return out
    if op == "barrier":
        dist.barrier()
        return None
    raise ValueError(op)


ALGORITHMS = {
    "send_recv": {"direct": send_recv_direct},
    "broadcast": {"direct": broadcast_direct, "tree": broadcast_tree},
    "scatter": {"direct": scatter_direct},
    "gather": {"direct": gather_direct},
    "reduce": {"direct": reduce_direct, "tree": reduce_tree},
    "all_reduce": {"direct": all_reduce_direct, "ring": all_reduce_ring, "tree": all_reduce_tree,
                   "halving_doubling": all_reduce_halving_doubling},
    "all_gather": {"direct": all_gather_direct, "ring": all_gather_ring},
    "reduce_scatter": {"direct": reduce_scatter_direct, "ring": reduce_scatter_ring},
    "all_to_all": {"direct": all_to_all_direct},
    "barrier": {"direct": barrier_direct},
}
for _algos in ALGORITHMS.values():
    _algos["builtin"] = builtin
OPS = tuple(ALGORITHMS)

# nccl-tests' bus-bandwidth factors (doc/PERFORMANCE.md): busbw = algbw × factor(n), the per-link bandwidth an
# optimal ring would need, so figures compare across rank counts.
BUS_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
              "reduce_scatter": lambda n: (n - 1) / n, "all_to_all": lambda n: (n - 1) / n,
              "gather": lambda n: (n - 1) / n, "scatter": lambda n: (n - 1) / n,
              "broadcast": lambda n: 1.0, "reduce": lambda n: 1.0, "send_recv": lambda n: 1.0, "barrier": lambda n: 0.0}
ALGOS = ("ring", "tree", "halving_doubling", "direct", "builtin")


def ring_bytes(op: str, numel: int, n: int, item: int, index: int | None = None) -> int:
    """What one rank sends in our algorithms: all-reduce 2(n-1)/n and reduce-scatter (n-1)/n of the input's
    `numel`; all-gather (n-1) times its own `numel`. When numel does not divide by n the chunks differ (torch's
    tensor_split) and so does each rank's share: give the rank's `index`. Rank j's ring reduce-scatter sends
    every chunk but (j+1) % n (all-reduce) or j (reduce-scatter alone), the all-reduce's all-gather every chunk
    but (j+2) % n (backend/comm/collectives.py)."""
    if op == "all_gather":
        return (n - 1) * numel * item
    if numel % n == 0:
        return {"all_reduce": 2, "reduce_scatter": 1}[op] * (n - 1) * (numel // n) * item
    if index is None:
        raise ValueError(f"{numel} elements do not divide by {n}: the byte model needs the rank's index")
    sizes = chunk_sizes(numel, n)
    if op == "reduce_scatter":
        return (numel - sizes[index]) * item
    return (2 * numel - sizes[(index + 1) % n] - sizes[(index + 2) % n]) * item
