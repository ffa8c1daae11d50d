"""comm.collectives: one collective, one algorithm, on real gloo ranks; step trace, bytes, bandwidth, checks.

What a run measures and checks:
- the output of every rank against a single-process reference computed from every rank's input
  (inputs are regenerated from their seeds), and against gloo's built-in collective on the same input;
- the bytes each rank sent and received (counted by p2p.py) against the volume model of the
  algorithm, exactly, for any numel (chunk sizes as torch.tensor_split makes them);
- for ring algorithms, every chunk index in the step trace against the chunk-index formulas, and
  how often seed 000's all-gather formula agrees with what the correct run sent;
- algbw and busbw (nccl-tests definitions) of the algorithm and of gloo's built-in, same run, same sizes.
Tolerance: exact (0) on integer-valued data. On normal data, |error| <= (n-1)·u·Σ|x_i| + u·|Σx_i|
elementwise (u the unit roundoff of the dtype): the bound on recursive summation in any order.
"""
from __future__ import annotations

import dataclasses
import statistics
import time

from backend.config import Config, ConfigError, setting
from backend.limits import cost
from backend.comm.collectives import ALGORITHMS, ALGOS, BUS_FACTOR, OPS, Spec, chunk_sizes
from backend.experiments import define
from backend.result import Check, Result, Schema
from backend.trace import Tracer

MAX_NUMEL = 16 << 20  # 64 MiB of fp32 per rank
REDUCING = ("all_reduce", "reduce", "reduce_scatter")


@dataclasses.dataclass
class CollectivesConfig(Config):
    op: str = setting("all_reduce", choices=OPS, help="the collective")
    algo: str = setting("ring", choices=ALGOS, help="how it is built from send/recv (builtin: gloo's own)")
    world_size: int = setting(4, min=2, max=8, help="number of ranks")
    numel: int = setting(1000, min=1, max=MAX_NUMEL, help="elements in each rank's buffer (need not divide by world_size)")
    dtype: str = setting("float32", choices=("float32", "float16"), help="element type")
    data: str = setting("integers", choices=("integers", "normal"), help="integers: exact checks; normal: rounding bound")
    splits: str = setting("equal", choices=("equal", "uneven"), help="all_to_all: equal or uneven split sizes")
    root: int = setting(0, min=0, max=7, help="root rank of broadcast, scatter, gather, reduce, barrier")
    iters: int = setting(3, min=1, max=50, help="timed repetitions (plus one traced, checked call)")

    cost_drivers = ("numel", "iters", "world_size")

    def estimate(self):
        """Each rank holds its buffer, up to world_size received pieces and float64 reference copies (4.04 GiB
        measured at 4 ranks x 11.4M elements, 2.3% over n(n+12)); every timed call
        (ours and gloo's built-in) costs about six buffers' bytes per rank at BYTES_PER_S (12.7 s of CPU for 8 ranks x
        1.28M floats x 52 calls measured; 9.6 s for 4 ranks x 6.2M floats x 7)."""
        size = self.numel * (4 if self.dtype == "float32" else 2)
        n = self.world_size
        return cost(data_bytes=n * (n + 20) * size, moved_bytes=6 * (self.iters + 2) * 2 * n * size,
                    ops=2 * (self.iters + 2) * n * 2 * n * 10, ranks=n)

    def check(self) -> None:
        if self.algo not in ALGORITHMS[self.op]:
            raise ConfigError("algo", f"{self.algo!r} is not built for {self.op} (allowed: {', '.join(ALGORITHMS[self.op])})")
        if self.root >= self.world_size:
            raise ConfigError("root", f"{self.root} is not a rank (allowed: 0..{self.world_size - 1})")
        if self.numel < self.world_size:
            raise ConfigError("numel", f"{self.numel} is smaller than world_size={self.world_size} (allowed: {self.world_size}..{MAX_NUMEL})")


# --- inputs, reference, model ----------------------------------------------------------------------------
def split_size(config, src: int, dst: int) -> int:
    n = config.world_size
    if config.splits == "equal":
        return chunk_sizes(config.numel, n)[dst]
    return config.numel // n + (dst + 2 * src) % 3


def spec_for(config, rank: int) -> Spec:
    n = config.world_size
    return Spec(config.op, config.numel, config.root,
                tuple(split_size(config, rank, i) for i in range(n)), tuple(split_size(config, i, rank) for i in range(n)))


def make_input(config, rank: int):
    import torch

    length = sum(spec_for(config, rank).send_splits) if config.op == "all_to_all" else config.numel
    g = torch.Generator().manual_seed(1234 + rank)
    x = torch.randint(-8, 9, (length,), generator=g).double() if config.data == "integers" else torch.randn(length, generator=g, dtype=torch.float64)
    return x.to(getattr(torch, config.dtype))


def reference(config, rank: int):
    """This rank's expected output, from every rank's input, in float64 in one process; plus Σ|x| for the bound."""
    import torch

    n, op, root = config.world_size, config.op, config.root
    inputs = [make_input(config, r).double() for r in range(n)]
    total = torch.stack(inputs).sum(0) if op in REDUCING else None
    magnitude = torch.stack(inputs).abs().sum(0) if op in REDUCING else None
    expected = {
        "all_reduce": lambda: total,
        "reduce": lambda: total if rank == root else None,
        "reduce_scatter": lambda: total.tensor_split(n)[rank],
        "broadcast": lambda: inputs[root],
        "scatter": lambda: inputs[root].tensor_split(n)[rank],
        "gather": lambda: torch.cat(inputs) if rank == root else None,
        "all_gather": lambda: torch.cat(inputs),
        "all_to_all": lambda: torch.cat([inputs[i].split(list(spec_for(config, i).send_splits))[rank] for i in range(n)]),
        "send_recv": lambda: inputs[0] if rank == 1 else None,
        "barrier": lambda: None,
    }[op]()
    if magnitude is not None and expected is not None:
        magnitude = {"reduce_scatter": lambda: magnitude.tensor_split(n)[rank]}.get(op, lambda: magnitude)()
    return expected, magnitude


def model_elements(config, rank: int) -> tuple[int, int] | None:
    """Elements this rank sends and receives under the algorithm (None for gloo's built-in, whose internals we do not count)."""
    op, algo, n, N, j = config.op, config.algo, config.world_size, config.numel, rank
    sz = chunk_sizes(N, n)
    root = config.root
    v = (j - root) % n
    if algo == "builtin":
        return None
    if algo == "ring":
        if op == "all_reduce":
            return 2 * N - sz[(j + 1) % n] - sz[(j + 2) % n], 2 * N - sz[j] - sz[(j + 1) % n]
        if op == "reduce_scatter":
            return N - sz[j], N - sz[(j - 1) % n]
        if op == "all_gather":
            return (n - 1) * N, (n - 1) * N
    if algo == "tree":
        def bcast(v):
            kids = sum(1 for t in range(n.bit_length()) if (m := 1 << t) < n and v < m and v + m < n)
            return kids * N, (N if v else 0)

        def reduce(v):
            low = v & -v if v else n
            parts = sum(1 for t in range(n.bit_length()) if (m := 1 << t) < n and m < low and v + m < n)
            return (N if v else 0), parts * N
        if op == "broadcast":
            return bcast(v)
        if op == "reduce":
            return reduce(v)
        if op == "all_reduce":
            (s1, r1), (s2, r2) = reduce(j), bcast(j)
            return s1 + s2, r1 + r2
    if algo == "halving_doubling":
        return _halving_doubling_model(n, N, j)
    others = n - 1
    direct = {
        "send_recv": lambda: (N if j == 0 else 0, N if j == 1 else 0),
        "broadcast": lambda: (others * N, 0) if j == root else (0, N),
        "reduce": lambda: (0, others * N) if j == root else (N, 0),
        "scatter": lambda: (N - sz[root], 0) if j == root else (0, sz[j]),
        "gather": lambda: (0, others * N) if j == root else (N, 0),
        "all_reduce": lambda: (others * N, others * N),
        "all_gather": lambda: (others * N, others * N),
        "reduce_scatter": lambda: (N - sz[j], others * sz[j]),
        "all_to_all": lambda: (sum(split_size(config, j, i) for i in range(n) if i != j),
                               sum(split_size(config, i, j) for i in range(n) if i != j)),
        "barrier": lambda: (others, others) if j == root else (1, 1),
    }
    return direct[op]()


def _halving_doubling_model(n: int, N: int, rank: int) -> tuple[int, int]:
    p = 1 << (n.bit_length() - 1)
    extra = n - p
    bs = chunk_sizes(N, p)
    size = lambda lo, hi: sum(bs[lo:hi])  # noqa: E731
    if rank < 2 * extra and rank % 2 == 0:
        return N, N  # folds its vector into rank+1, gets the result back
    sent = recv = N if rank < 2 * extra else 0  # the odd partner receives the fold and sends the unfold
    new = rank // 2 if rank < 2 * extra else rank - extra
    lo, hi, m = 0, p, p // 2
    while m >= 1:
        mid = (lo + hi) // 2
        keep, give = ((lo, mid), (mid, hi)) if not new & m else ((mid, hi), (lo, mid))
        sent, recv = sent + size(*give), recv + size(*keep)
        lo, hi = keep
        m //= 2
    m = 1
    while m < p:
        width = hi - lo
        partner = (lo - width, lo) if new & m else (hi, hi + width)
        sent, recv = sent + size(lo, hi), recv + size(*partner)
        lo, hi = min(lo, partner[0]), max(hi, partner[1])
        m *= 2
    return sent, recv


def closed_form(config) -> str:
    """The textbook per-rank volume (ψ = buffer bytes), as the seeds write it."""
    return {
        ("all_reduce", "ring"): "2(n-1)/n·ψ sent and received (seed 000: 2ψ, independent of n)",
        ("reduce_scatter", "ring"): "(n-1)/n·ψ",
        ("all_gather", "ring"): "(n-1)·ψ_rank, ψ_rank = one rank's contribution",
        ("all_reduce", "direct"): "(n-1)·ψ",
        ("all_reduce", "halving_doubling"): "2(p-1)/p·ψ on the p core ranks, +ψ each way for folded pairs",
        ("all_reduce", "tree"): "⌈log2 n⌉·ψ on the busiest rank (root receives, then sends)",
        ("broadcast", "direct"): "root sends (n-1)·ψ (seed 000's DP: GPU0 sends (n-1)ψ)",
        ("reduce", "direct"): "root receives (n-1)·ψ (seed 000's DP: GPU0 receives (n-1)ψ)",
    }.get((config.op, config.algo), "see the model column")


# --- the run ------------------------------------------------------------------------------------------------
def rank_main(rank: int, world: int, config: CollectivesConfig, ctx) -> dict:
    import torch.distributed as dist

    from backend.comm.collectives import builtin
    from backend.comm.p2p import P2P

    tracer = Tracer(rank)
    tracer.align(dist.barrier)
    algorithm = ALGORITHMS[config.op][config.algo]
    spec, x = spec_for(config, rank), make_input(config, rank)
    traced = P2P(rank, world, tracer)
    entered = tracer.now_us()
    with tracer.span("collective", f"{config.op} ({config.algo})"):
        out = algorithm(traced, x, spec)
    left = tracer.now_us()
    peer = builtin(P2P(rank, world, Tracer(rank)), x, spec)
    if rank == 0:
        ctx.progress(0.3, "checked call done; timing")
    expected, magnitude = reference(config, rank)

    # Time the algorithm and gloo's built-in alternately (order flipped each round), so drift in the
    # machine's load falls on both alike. The first round warms up and is not counted.
    fns = {"algo": algorithm} if config.algo == "builtin" else {"algo": algorithm, "builtin": builtin}
    times = {k: [] for k in fns}
    for it in range(config.iters + 1):
        for name in (list(fns) if it % 2 == 0 else list(fns)[::-1]):
            dist.barrier()
            start = time.perf_counter()
            fns[name](P2P(rank, world, Tracer(rank)), x, spec)
            times[name].append(time.perf_counter() - start)
    # Median, not mean: on a shared machine one descheduled call should not decide the comparison.
    t_algo = statistics.median(times["algo"][1:])
    t_builtin = statistics.median(times["builtin"][1:]) if "builtin" in times else t_algo
    if rank == 0:
        ctx.progress(0.9, "timing done")
    u = {"float32": 2.0 ** -24, "float16": 2.0 ** -11}[config.dtype]
    err_ref = err_peer = bound = 0.0
    if expected is not None:
        got = out.double()
        err_ref = (got - expected).abs().max().item() if got.numel() else 0.0
        err_peer = (got - peer.double()).abs().max().item() if got.numel() else 0.0
        if config.data == "normal" and magnitude is not None:
            bound = ((world - 1) * u * magnitude + u * expected.abs()).max().item()
    return {
        "rank": rank, "log": traced.log, "trace": tracer.payload(), "entered_us": entered, "left_us": left,
        "has_output": expected is not None, "output_numel": 0 if out is None else out.numel(),
        "err_ref": err_ref, "err_peer": err_peer, "bound": bound,
        "t_algo": t_algo, "t_builtin": t_builtin, "itemsize": x.element_size(),
        "sent": traced.bytes_sent, "recv": traced.bytes_recv, "model": model_elements(config, rank),
    }


def ring_index_checks(config, payloads) -> tuple[int, int, int, int]:
    """(transfers whose chunk matches the correct formulas, transfers checked, matches of seed 000's
    all-gather formula, all-gather transfers). Only ring algorithms have chunk formulas."""
    n = config.world_size
    ok = total = seed_ok = seed_total = 0
    first_ag = n - 1 if config.op == "all_reduce" else 0
    for p in payloads:
        j = p["rank"]
        for e in p["log"]:
            if e["dir"] != "send":
                continue
            i = e["step"] if e["phase"] == "scatter-reduce" else e["step"] - first_ag
            if config.op == "all_reduce":
                want = (j - i) % n if e["phase"] == "scatter-reduce" else (j + 1 - i) % n
                if e["phase"] == "all-gather":
                    seed_total += 1
                    seed_ok += e["blocks"] == [(j - i - 1) % n]
            elif config.op == "reduce_scatter":
                want = (j - i - 1) % n
            else:
                want = (j - i) % n
            total += 1
            ok += e["blocks"] == [want]
    return ok, total, seed_ok, seed_total


def replay_holdings(config, payloads) -> list[dict]:
    """Who holds whose data in every block after every step, replayed from the transfers the ranks logged."""
    n, op = config.world_size, config.op
    sends = [e for p in payloads for e in p["log"] if e["dir"] == "send" and e["blocks"]]
    if not sends or op in ("all_to_all", "barrier", "send_recv"):
        return []
    nblocks = max(b for e in sends for b in e["blocks"]) + 1
    if op in REDUCING:
        state = [[{r} for _ in range(nblocks)] for r in range(n)]
    elif op in ("all_gather", "gather"):
        state = [[{r} if b == r else set() for b in range(nblocks)] for r in range(n)]
    else:  # broadcast, scatter: the root's buffer spreads
        state = [[{config.root} if r == config.root else set() for _ in range(nblocks)] for r in range(n)]

    def rows(step):
        return [{"step": step, "rank": r, "block": b, "holds": len(state[r][b]),
                 "contributors": "+".join(map(str, sorted(state[r][b])))} for r in range(n) for b in range(nblocks)]

    out = rows(-1)
    for step in sorted({e["step"] for e in sends}):
        before = [[set(s) for s in blocks] for blocks in state]
        for e in (e for e in sends if e["step"] == step):
            for b in e["blocks"]:
                if e["kind"] == "reduce":
                    state[e["dst"]][b] |= before[e["src"]][b]
                else:
                    state[e["dst"]][b] = set(before[e["src"]][b])
        out += rows(step)
    return out


def combine(config: CollectivesConfig, payloads: list[dict]) -> Result:
    n, op, algo = config.world_size, config.op, config.algo
    item = payloads[0]["itemsize"]
    exact = config.data == "integers"
    checks = []
    if op == "barrier":
        last_in, first_out = max(p["entered_us"] for p in payloads), min(p["left_us"] for p in payloads)
        checks.append(Check("no rank leaves the barrier before the last one enters", max(0.0, last_in - first_out), 0.0,
                            reference="entry and exit times on the aligned clock", detail=f"last entry {last_in:.0f} µs, first exit {first_out:.0f} µs"))
    else:
        bound = max(p["bound"] for p in payloads)
        checks.append(Check(f"{op} output equals the single-process reference", max(p["err_ref"] for p in payloads),
                            0.0 if exact else bound, reference="float64 result of all ranks' inputs in one process",
                            detail="integer-valued data: exact" if exact else "bound (n-1)·u·Σ|x| + u·|Σx|"))
        checks.append(Check(f"{op} output equals gloo's built-in", max(p["err_peer"] for p in payloads),
                            0.0 if exact else 2 * bound, reference="torch.distributed on gloo, same inputs",
                            detail="exact" if exact else "both sides within the bound of the exact sum"))
    volume = []
    for p in payloads:
        model = p["model"]
        volume.append({"rank": p["rank"], "sent_bytes": p["sent"], "recv_bytes": p["recv"],
                       "model_sent_bytes": None if model is None else model[0] * item,
                       "model_recv_bytes": None if model is None else model[1] * item})
    if algo != "builtin":
        gap = max(abs(v["sent_bytes"] - v["model_sent_bytes"]) + abs(v["recv_bytes"] - v["model_recv_bytes"]) for v in volume)
        checks.append(Check("bytes sent and received equal the volume model", gap, 0.0, reference="closed-form volume per rank",
                            detail=closed_form(config)))
    metrics = {"world_size": n, "op": op, "algo": algo, "numel": config.numel}
    notes = []
    if algo == "ring":
        ok, total, seed_ok, seed_total = ring_index_checks(config, payloads)
        checks.append(Check("every ring transfer's chunk index follows the chunk formulas", total - ok, 0,
                            reference="scatter-reduce (j-i)%n, all-gather (j+1-i)%n", detail=f"{ok} of {total} transfers"))
        if seed_total:
            metrics["seed_allgather_formula_agreement"] = f"{seed_ok}/{seed_total}"
            notes.append(f"The ring all-gather indices as the notes write them, 'send chunk (j-i-1)%n, receive (j-i-2)%n', "
                         f"count the step i on from where the scatter-reduce stopped. Counting i from 0 again, rank j sends "
                         f"(j+1-i)%n and receives (j-i)%n in steps i = 0..n-2: that is what this run did, and the written form "
                         f"matched {seed_ok} of {seed_total} of its all-gather transfers.")
    s_bytes = config.numel * item * (n if op in ("all_gather", "gather") else 1)
    if op == "all_to_all":
        s_bytes = max(sum(spec_for(config, r).send_splits) for r in range(n)) * item
    t_algo, t_builtin = max(p["t_algo"] for p in payloads), max(p["t_builtin"] for p in payloads)
    bandwidth = []
    for name, t in ((algo, t_algo), ("builtin (gloo)", t_builtin)):
        algbw = s_bytes / t / 1e9 if op != "barrier" else 0.0
        bandwidth.append({"algorithm": name, "time_us": t * 1e6, "size_bytes": s_bytes, "algbw_GBps": algbw,
                          "busbw_GBps": algbw * BUS_FACTOR[op](n)})
    metrics.update(time_us=round(t_algo * 1e6, 2), builtin_time_us=round(t_builtin * 1e6, 2),
                   busbw_GBps=round(bandwidth[0]["busbw_GBps"], 4), builtin_busbw_GBps=round(bandwidth[1]["busbw_GBps"], 4),
                   busbw_ratio_vs_builtin=round(t_builtin / t_algo, 3),
                   steps=1 + max((e["step"] for p in payloads for e in p["log"]), default=-1))
    steps = [dict(e, rank=p["rank"]) for p in payloads for e in p["log"] if e["dir"] == "send"]
    holdings = replay_holdings(config, payloads)
    if holdings and op in ("all_reduce", "all_gather"):
        last = max(h["step"] for h in holdings)
        everyone = "+".join(map(str, range(n)))
        want = (lambda h: everyone) if op == "all_reduce" else (lambda h: str(h["block"]))
        short = sum(1 for h in holdings if h["step"] == last and h["contributors"] != want(h))
        checks.append(Check("replayed from the trace, every rank ends with the op's full result in every block", short, 0,
                            reference="the op's definition", detail=f"{short} (rank, block) pairs wrong after step {last}"))
    return Result(metrics=metrics, checks=checks, notes=notes,
                  tables={"steps": steps, "volume": volume, "bandwidth": bandwidth, "holdings": holdings},
                  trace_events=[e for p in payloads for e in p["trace"]["events"]])


RESULT = Schema(
    metrics=(
        "world_size", "op", "algo", "numel", "seed_allgather_formula_agreement", "time_us", "builtin_time_us",
        "busbw_GBps", "builtin_busbw_GBps", "busbw_ratio_vs_builtin", "steps",
    ),
    tables={
        "steps": ("blocks", "bytes", "dir", "dst", "kind", "numel", "phase", "rank", "src", "step"),
        "volume": ("model_recv_bytes", "model_sent_bytes", "rank", "recv_bytes", "sent_bytes"),
        "bandwidth": ("algbw_GBps", "algorithm", "busbw_GBps", "size_bytes", "time_us"),
        "holdings": ("block", "contributors", "holds", "rank", "step"),
    },
    optional=("seed_allgather_formula_agreement",),  # ring runs whose all-gather the seed's formulas describe
)

EXPERIMENT = define(__name__, CollectivesConfig,
    "any collective, built from send/recv (ring, tree, halving-doubling, direct) or gloo's own: step trace, bytes vs model, busbw",
    rank_fn=rank_main, combine=combine, lanes=("collective", "comm", "compute"),
    schema=RESULT,
)
