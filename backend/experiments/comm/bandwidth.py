"""comm.bandwidth: gloo's built-in collectives over a sweep of message sizes, nccl-tests style.

Definitions follow nccl-tests (doc/PERFORMANCE.md): S is the message size of the operation,
algbw = S / t, and busbw = algbw * factor, where the factor turns algbw into the bandwidth each
link would need under an optimal ring, so numbers are comparable across rank counts:
    all_reduce 2(n-1)/n, all_gather (n-1)/n, reduce_scatter (n-1)/n, all_to_all (n-1)/n, broadcast 1.
For all_gather S is the gathered output, for reduce_scatter the full input, for all_to_all one
rank's send buffer. t is the slowest rank's mean time per call.

Every size is also checked: inputs hold small integers, so the reduced values are exact in
fp32 and fp16 and are compared element-wise with a closed-form expectation (tolerance 0).
"""
from __future__ import annotations

import dataclasses
import time

from backend.config import Config, ConfigError, setting
from backend.limits import cost
from backend.comm.collectives import BUS_FACTOR
from backend.experiments import define
from backend.result import Check, Result, Schema
from backend.trace import Tracer

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")
MiB = 1 << 20


@dataclasses.dataclass
class BandwidthConfig(Config):
    world_size: int = setting(4, min=2, max=8, help="number of ranks (processes)")
    ops: tuple[str, ...] = setting(list(OPS), choices=OPS, length=(1, len(OPS)), help="collectives to time")
    min_bytes: int = setting(1024, min=64, max=64 * MiB, help="smallest message size S in bytes")
    max_bytes: int = setting(1 * MiB, min=64, max=64 * MiB, help="largest message size S in bytes (sizes double)")
    iters: int = setting(5, min=1, max=100, help="timed calls per size")
    warmup: int = setting(1, min=0, max=20, help="untimed calls per size")
    dtype: str = setting("float32", choices=("float32", "float16"), help="element type")

    def op_list(self) -> list[str]:
        return list(self.ops)

    def sizes(self) -> list[int]:
        sizes, s = [], self.min_bytes
        while s <= self.max_bytes:
            sizes.append(s)
            s *= 2
        return sizes

    cost_drivers = ("max_bytes", "iters", "world_size")

    def estimate(self):
        """Sizes double from min_bytes to max_bytes (their sum < 2·max_bytes); each op runs warmup + iters
        times per size; all_gather's output is world_size buffers per rank, and the correctness check's float64 copies about 5 more
        (n + 4.8 buffers of max_bytes per rank measured at 4 ranks)."""
        n, ops = self.world_size, len(self.ops)
        sizes = max(1, (max(self.max_bytes, self.min_bytes) // self.min_bytes).bit_length())
        calls = ops * (self.iters + self.warmup + 1)
        return cost(data_bytes=n * (n + 5) * self.max_bytes, moved_bytes=2 * calls * 2 * self.max_bytes * 2 * n,  # a send or receive ~2 copies (9.3 s of CPU at 10 MB)
                    ops=calls * sizes * n * 40, ranks=n)  # ~1 ms of CPU a call per size per rank measured

    def check(self) -> None:
        ops = self.op_list()
        if self.min_bytes > self.max_bytes:
            raise ConfigError("min_bytes", f"{self.min_bytes} is larger than max_bytes={self.max_bytes}")
        if len(self.sizes()) * len(ops) * (self.iters + self.warmup) > 20_000:
            raise ConfigError("iters", "the sweep would make over 20,000 calls; lower iters or narrow the sizes")


def _elements(config: BandwidthConfig, size_bytes: int, world: int) -> int:
    """Elements in the op's buffer: S rounded up to a whole number of equal per-rank chunks."""
    item = 4 if config.dtype == "float32" else 2
    per_chunk = max(1, -(-size_bytes // (item * world)))
    return per_chunk * world


def _run_op(op, dist, inp, out):
    if op == "all_reduce":
        dist.all_reduce(inp)
    elif op == "all_gather":
        dist.all_gather_single(out, inp)
    elif op == "reduce_scatter":
        dist.reduce_scatter_single(out, inp)
    elif op == "broadcast":
        dist.broadcast(inp, src=0)
    elif op == "all_to_all":
        dist.all_to_all_single(out, inp)


def _buffers(op, torch, dtype, numel, rank, world, device):
    """Input and output for one op; input values are small integers so every result is exact."""
    chunk = numel // world
    idx = torch.arange(numel, device=device)
    if op == "all_gather":
        inp = ((idx[:chunk] % 7) + rank + 1).to(dtype)
        return inp, torch.empty(numel, dtype=dtype, device=device)
    inp = ((idx % 7) + rank + 1).to(dtype)
    out = torch.empty(chunk if op == "reduce_scatter" else numel, dtype=dtype, device=device)
    return inp, out


def _expected(op, torch, numel, rank, world, device):
    """Closed-form result of the op on the inputs above, computed without any communication."""
    chunk = numel // world
    idx = torch.arange(numel, device=device)
    base = (idx % 7).double()
    ranks_sum = world * (world + 1) / 2
    if op == "all_reduce":
        return world * base + ranks_sum
    if op == "broadcast":
        return base + 1  # rank 0's input
    if op == "reduce_scatter":
        return (world * base + ranks_sum)[rank * chunk:(rank + 1) * chunk]
    if op == "all_gather":  # block j is rank j's input
        return (idx % chunk % 7).double() + (idx // chunk).double() + 1
    # all_to_all: block j comes from rank j, whose block `rank` held positions rank*chunk.. of its input
    src = idx // chunk
    pos = rank * chunk + idx % chunk
    return (pos % 7).double() + src.double() + 1


def rank_main(rank: int, world: int, config: BandwidthConfig, ctx) -> dict:
    import torch
    import torch.distributed as dist

    dtype = getattr(torch, config.dtype)
    tracer = Tracer(rank)
    tracer.align(dist.barrier)
    ops, sizes = config.op_list(), config.sizes()
    rows, errors = [], {}
    for i, (op, size) in enumerate((op, s) for op in ops for s in sizes):
        numel = _elements(config, size, world)
        inp, out = _buffers(op, torch, dtype, numel, rank, world, ctx.device)
        for _ in range(config.warmup):
            _run_op(op, dist, inp, out)
        dist.barrier()
        start = time.perf_counter()
        for it in range(config.iters):
            with tracer.span("collective", op, bytes=numel * inp.element_size() * (world if op == "all_gather" else 1), iter=it):
                _run_op(op, dist, inp, out)
        elapsed = (time.perf_counter() - start) / config.iters
        # Correctness on fresh inputs (the timed loop reduced in place).
        inp, out = _buffers(op, torch, dtype, numel, rank, world, ctx.device)
        _run_op(op, dist, inp, out)
        got = inp if op in ("all_reduce", "broadcast") else out
        err = (got.double() - _expected(op, torch, numel, rank, world, ctx.device)).abs().max().item()
        errors[op] = max(errors.get(op, 0.0), err)
        rows.append({"op": op, "size_bytes": size, "numel": numel, "time_s": elapsed})
        if rank == 0:
            ctx.progress((i + 1) / (len(ops) * len(sizes)), f"{op} {size} B")
            ctx.partial("Rank 0's mean time per call for each size it finished (t is the slowest rank's, known only "
                        "when every rank reports: these are a lower bound on t).",
                        tables={"rank 0 times": [dict(r, time_us=round(r["time_s"] * 1e6, 1)) for r in rows]})
    return {"rank": rank, "rows": rows, "errors": errors, "trace": tracer.payload()}


def combine(config: BandwidthConfig, payloads: list[dict]) -> Result:
    world = len(payloads)
    item = 4 if config.dtype == "float32" else 2
    table, per_rank = [], []
    for j, row in enumerate(payloads[0]["rows"]):
        times = [p["rows"][j]["time_s"] for p in payloads]
        t = max(times)
        s_bytes = row["numel"] * item
        algbw = s_bytes / t / 1e9
        table.append({
            "op": row["op"], "size_bytes": s_bytes, "time_us": t * 1e6,
            "algbw_GBps": algbw, "busbw_GBps": algbw * BUS_FACTOR[row["op"]](world),
            "bus_factor": BUS_FACTOR[row["op"]](world),
            "rank_spread_us": (max(times) - min(times)) * 1e6, "spread_pct": 100 * (max(times) - min(times)) / t,
            "slowest_rank": payloads[times.index(t)]["rank"],
        })
        per_rank.extend({"op": row["op"], "size_bytes": s_bytes, "rank": p["rank"], "time_us": p["rows"][j]["time_s"] * 1e6} for p in payloads)
    checks = [
        Check(
            name=f"{op} result equals the closed-form expectation",
            error=max(p["errors"][op] for p in payloads),
            tolerance=0.0,
            reference="closed-form expected values of integer-valued inputs (exact in fp16/fp32)",
            detail=f"max |result - expected| over {len(config.sizes())} sizes and {world} ranks",
        )
        for op in config.op_list()
    ]
    metrics = {"world_size": world, "dist_backend": "gloo", "calls_timed": len(table) * config.iters}
    for op in config.op_list():
        rows = [r for r in table if r["op"] == op]
        best = max(rows, key=lambda r: r["busbw_GBps"])
        metrics[f"peak_busbw_GBps.{op}"] = round(best["busbw_GBps"], 4)
        metrics[f"peak_at_bytes.{op}"] = best["size_bytes"]
    events = [e for p in payloads for e in p["trace"]["events"]]
    return Result(metrics=metrics, tables={"bandwidth": table, "per_rank": per_rank, "slowest": slowest_counts(table, world),
                                           "bus_factors": bus_factors(table)},
                  checks=checks, trace_events=events)


def slowest_counts(table: list[dict], world: int) -> list[dict]:
    """For each collective, at how many sizes each rank set t (was the slowest): a rank slowest at most sizes points at
    a slow link or a busy core, a slowest rank that changes from size to size at scheduling noise. Every rank has a
    row, 0 included."""
    ops = list(dict.fromkeys(r["op"] for r in table))
    return [{"op": op, "rank": rank, "calls": sum(r["op"] == op and r["slowest_rank"] == rank for r in table)}
            for op in ops for rank in range(world)]


def bus_factors(table: list[dict]) -> list[dict]:
    """Each collective's busbw / algbw factor once (every size's row holds it), in the order the sweep ran them: the
    page's line on how busbw was made."""
    return [{"op": op, "bus_factor": factor} for op, factor in dict((r["op"], r["bus_factor"]) for r in table).items()]


def _slowest_as_unmeasured(result: dict) -> None:
    """Version 1 -> 2: runs stored before the slowest ranks were counted hold no `slowest` table; an empty one says so."""
    result["tables"].setdefault("slowest", [])


RESULT = Schema(
    metrics=("world_size", "dist_backend", "calls_timed",
             "peak_busbw_GBps.*", "peak_at_bytes.*"),  # one of each per collective timed (`ops`)
    tables={
        "bandwidth": ("algbw_GBps", "bus_factor", "busbw_GBps", "op", "rank_spread_us", "size_bytes", "slowest_rank",
                      "spread_pct", "time_us"),
        "per_rank": ("op", "rank", "size_bytes", "time_us"),
        "slowest": ("calls", "op", "rank"),  # empty in a run stored before version 2
        "bus_factors": ("op", "bus_factor"),
    },
    version=3, upgrades={1: _slowest_as_unmeasured,  # v2 -> 3: the factors once per collective (the page grouped them)
                         2: lambda result: result["tables"].setdefault("bus_factors", bus_factors(result["tables"]["bandwidth"]))},
)

EXPERIMENT = define(__name__, BandwidthConfig,
    "gloo built-in collectives over a size sweep: algbw and busbw (nccl-tests definitions), results checked exactly",
    rank_fn=rank_main, combine=combine, lanes=("collective",),
    schema=RESULT,
)
