"""Place a graph's ops on ranks, insert send/recv where an edge crosses ranks, and run it (seed 002: convs 1-2
on server0, the rest on server1, a send and a recv between them, the results gathered on one server).

place(): earliest-finish-time list scheduling. In topological order each op goes to the rank where it would
finish first, given when that rank is free and when its inputs can arrive (a producer on another rank adds
a transfer: latency + bytes / link bandwidth). Views and tuple getitems stay with their input. Inputs start on
rank 0; outputs are gathered there. transfers(): one send/recv per (value, destination rank).
run_rank(): every rank walks the same topological order, computes its own ops, sends each result as soon as
it exists (non-blocking) and receives just before first use, so no rank waits on one that waits on it.
"""
from __future__ import annotations

import networkx as nx
import torch
import torch.distributed as dist

from backend.graph import ir


def flops(g: nx.DiGraph, n: str) -> int:
    node = ir.get(g, n)
    if node.op in ("mm", "bmm", "addmm"):
        (m, k) = ir.get(g, node.args[0].name).shape[-2:]
        return 2 * m * k * node.shape[-1]
    if node.kind in ("view", "input"):
        return 0
    return max(node.numel, sum(ir.get(g, p).numel for p in g.predecessors(n)))


def place(g: nx.DiGraph, ranks: int, flops_per_s: float, link_bytes_per_s: float, latency_s: float):
    """Returns (rank of every node, a log with the reason for each op, the modelled finish time in s)."""
    rank, finish, free = {}, {}, [0.0] * ranks
    log = []
    for n in nx.topological_sort(g):
        node = ir.get(g, n)
        preds = list(g.predecessors(n))
        if node.kind == "input":
            rank[n], finish[n] = 0, 0.0
            continue
        if node.kind == "view" and preds:  # a view (or a tuple's getitem) stays with its input
            rank[n], finish[n] = rank[preds[0]], finish[preds[0]]
            continue
        cost = flops(g, n) / flops_per_s
        options = []
        for r in range(ranks):
            ready = max([finish[p] + (0 if rank[p] == r else latency_s + ir.get(g, p).bytes / link_bytes_per_s)
                         for p in preds] + [0.0])
            start = max(ready, free[r])
            gather = latency_s + node.bytes / link_bytes_per_s if n in g.graph["outputs"] and r != 0 else 0.0
            options.append((start + cost + gather, r, start))  # an output must reach rank 0
        end, r, start = min(options)
        rank[n], finish[n], free[r] = r, end, start + cost
        others = ", ".join(f"rank {o[1]} {o[0] * 1e6:.1f}" for o in options if o[1] != r)
        moved = [p for p in preds if rank[p] != r and ir.get(g, p).bytes]
        log.append({"node": n, "op": node.op, "rank": r, "flops": flops(g, n),
                    "why": f"finishes at {end * 1e6:.1f} µs (others: {others} µs)"
                           + (f"; receives {', '.join(moved)}" if moved else "")})
    return rank, log, max(finish.values())


def transfers(g: nx.DiGraph, rank: dict) -> list[dict]:
    """One send/recv per (value, destination): every edge that crosses ranks, and every output not on rank 0."""
    plan, seen = [], set()
    for n in nx.topological_sort(g):
        dests = sorted({rank[u] for u in g.successors(n)} | ({0} if n in g.graph["outputs"] else set()))
        for dst in dests:
            if dst != rank[n] and (n, dst) not in seen:
                seen.add((n, dst))
                plan.append({"tag": len(plan), "value": n, "src": rank[n], "dst": dst, "bytes": ir.get(g, n).bytes})
    return plan


def run_rank(g: nx.DiGraph, rank_of: dict, plan: list[dict], me: int, inputs: list[torch.Tensor], tracer) -> dict:
    env = {}
    if me == 0:
        env.update(zip(g.graph["inputs"], inputs))
    sends_of = {}
    for t in plan:
        sends_of.setdefault(t["value"], []).append(t)
    recv_of = {(t["value"], t["dst"]): t for t in plan}
    pending, computed, log = [], [], []

    def arrive(value):
        if value in env:
            return
        t = recv_of[(value, me)]
        node = ir.get(g, value)
        buf = torch.empty(node.shape, dtype=getattr(torch, node.dtype))
        with tracer.span("recv", f"recv {value} from rank {t['src']}", bytes=t["bytes"]):
            dist.recv(buf, src=t["src"], tag=t["tag"])
        tracer.count("recv", recv=t["bytes"])
        log.append({"tag": t["tag"], "event": "recv", "value": value, "peer": t["src"], "bytes": t["bytes"], "t_us": tracer.now_us()})
        env[value] = buf

    def send(value):
        for t in sends_of.get(value, []):
            if t["src"] != me:
                continue
            with tracer.span("send", f"send {value} to rank {t['dst']}", bytes=t["bytes"]):
                pending.append(dist.isend(env[value].contiguous(), dst=t["dst"], tag=t["tag"]))
            tracer.count("send", sent=t["bytes"])
            log.append({"tag": t["tag"], "event": "send", "value": value, "peer": t["dst"], "bytes": t["bytes"],
                        "t_us": tracer.now_us()})

    for n in nx.topological_sort(g):
        if rank_of[n] != me:
            continue
        node = ir.get(g, n)
        if node.kind != "input":
            for p in g.predecessors(n):
                if rank_of[p] != me:
                    arrive(p)
            with tracer.span("compute", f"{node.op} {n}"):
                env[n] = node.run(env)
            computed.append(n)
        send(n)
    outputs = None
    if me == 0:
        for o in g.graph["outputs"]:
            if rank_of[o] != 0:
                arrive(o)
        outputs = [env[o].detach().numpy().copy() for o in g.graph["outputs"]]
    for work in pending:
        work.wait()
    return {"computed": computed, "log": log, "outputs": outputs}
