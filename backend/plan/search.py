"""Every plan for a model on a cluster at a global batch and sequence length, ranked by predicted throughput.

Enumerated: tp (divisors of the heads' constraint, up to two nodes), cp with its K/V exchange (ring attention or
Llama 3's all-gather), pp (≤ layers), ep (MoE), the DP strategy, recompute, micro-batch, schedule (1F1B, interleaved
with 2 chunks, zero bubble) and the rank order (dp inside pp, or Llama 3's pp inside dp). The attention kernel is the
user's software choice, not searched: every plan runs the one given. Pruned without losing a plan that could win: a
plan's memory is checked before its time, and recompute modes are tried from none upward, so the heavier ones are
evaluated only for shapes where none does not fit (more recompute never runs faster); the second rank order is tried
only where it can move a group to another link: with pp and dp both above one and tp·cp short of a node (when tp·cp
fills whole nodes, every group outside it crosses nodes in either order).
"""
from __future__ import annotations

import dataclasses
import time

from backend.config import ConfigError
from backend.plan import models as M
from backend.plan.clusters import Cluster
from backend.plan.predict import CP_COMMS, ORDERS, RECOMPUTE, Efficiency, Plan, evaluate, memory, total_bytes, validate

GiB = 2 ** 30


def _powers(limit: int) -> list[int]:
    out, k = [], 1
    while k <= limit:
        out.append(k)
        k *= 2
    return out


def orders(tp: int, cp: int, dp: int, pp: int, gpus_per_node: int) -> tuple[str, ...]:
    """The rank orders that can differ: both when pp and dp exceed one and tp·cp leaves room in a node, else the first."""
    return tuple(ORDERS) if pp > 1 and dp > 1 and tp * cp < gpus_per_node else tuple(ORDERS)[:1]


def candidates(model: M.ModelSpec, cluster: Cluster, global_batch: int, seq_len: int, kernel: str = "fa2"):
    g, gpn = cluster.gpus, cluster.gpus_per_node
    for tp in [t for t in _powers(2 * gpn) if g % t == 0]:
        for cp in [c for c in _powers(16) if seq_len % (2 * c) == 0]:
            for pp in [p for p in _powers(min(model.layers, 128))]:
                if g % (tp * cp * pp):
                    continue
                dp = g // (tp * cp * pp)
                for ep in ([e for e in _powers(min(model.experts, dp)) if model.experts % e == 0 and dp % e == 0] if model.experts else [1]):
                    for strategy in ("ddp", "zero1", "zero2", "fsdp", "hsdp"):
                        if strategy == "hsdp" and (dp <= gpn or dp % gpn):
                            continue
                        for mb in (1, 2, 4):
                            if global_batch % (dp * mb):
                                continue
                            for schedule, vp in ((("1f1b", 1), ("interleaved_1f1b", 2), ("zb_h1", 1)) if pp > 1 else (("1f1b", 1),)):
                                for comm in (CP_COMMS if cp > 1 else CP_COMMS[:1]):
                                    for order in orders(tp, cp, dp, pp, gpn):
                                        yield Plan(tp=tp, sp=tp > 1, cp=cp, cp_comm=comm, ep=ep, pp=pp, vp=vp, schedule=schedule,
                                                   dp_strategy=strategy, hsdp_shard=gpn, micro_batch=mb, global_batch=global_batch,
                                                   seq_len=seq_len, attention_kernel=kernel, order=order)


def search(model: M.ModelSpec, cluster: Cluster, global_batch: int, seq_len: int, eff: Efficiency, limit: int = 200_000,
           kernel: str = "fa2") -> dict:
    """Ranked feasible plans, the infeasible with their reason, and how long the search took. Each plan takes the
    lightest recompute that fits. Two shortcuts that lose no plan: the rank order moves no byte (a plan's second order
    reuses the first's memory, enumerated just before it), and all-gather CP holds at least what its ring twin holds
    (the gathered K/V on top), so it starts at the recompute its ring twin needed."""
    start = time.perf_counter()
    feasible, infeasible, tried = [], [], 0
    lightest, sibling = {}, (None, {})
    for base in candidates(model, cluster, global_batch, seq_len, kernel):
        if tried >= limit:
            break
        try:
            dp = validate(model, cluster, base)
        except ConfigError as err:
            infeasible.append({"plan": base, "reason": str(err)})
            continue
        ring_twin = (base.tp, base.cp, base.ep, base.pp, base.vp, base.schedule, base.dp_strategy, base.micro_batch)
        same_bytes = ring_twin + (base.cp_comm,)
        mems = sibling[1] if sibling[0] == same_bytes else {}
        sibling = (same_bytes, mems)
        for i in range(lightest.get(ring_twin, 0) if base.cp_comm != "ring" else 0, len(RECOMPUTE)):
            plan = dataclasses.replace(base, recompute=RECOMPUTE[i])
            tried += 1
            mem = mems.get(i) or mems.setdefault(i, memory(model, cluster, plan, dp, eff))
            need = total_bytes(mem)
            if need > cluster.gpu.hbm_bytes:
                if i == len(RECOMPUTE) - 1:
                    lightest[ring_twin] = i
                    cats = {k: v for k, v in mem.items() if not k.startswith("_") and k != "stage"}
                    top = max(cats, key=cats.get)
                    infeasible.append({"plan": plan, "reason": f"does not fit: {need / GiB:.1f} GiB > {cluster.gpu.hbm_bytes / GiB:.0f} GiB "
                                                               f"(largest: {top}, {cats[top] / GiB:.1f} GiB) even with full recompute"})
                continue
            if base.cp_comm == "ring":
                lightest[ring_twin] = i
            feasible.append(evaluate(model, cluster, plan, eff, mem=mem) | {"plan": plan})
            break
    feasible.sort(key=lambda r: -r["tokens_per_s_per_gpu"])
    return {"ranked": feasible, "infeasible": infeasible, "evaluated": tried, "seconds": time.perf_counter() - start}


def describe(plan: Plan) -> str:
    parts = [f"tp{plan.tp}" + ("+sp" if plan.sp and plan.tp > 1 else ""), f"cp{plan.cp}", f"pp{plan.pp}"]
    if plan.ep > 1:
        parts.append(f"ep{plan.ep}")
    if plan.pp > 1:
        parts.append(plan.schedule + (f"(v{plan.vp})" if plan.vp > 1 else ""))
    if plan.cp > 1:
        parts.append(f"{plan.cp_comm} CP")
    if plan.order != next(iter(ORDERS)):
        parts.append("pp inside dp")
    parts += [plan.dp_strategy, f"mb{plan.micro_batch}", f"recompute {plan.recompute}"]
    return " ".join(parts)


def _shape(plan: Plan) -> tuple:
    return plan.tp, plan.cp, plan.ep, plan.pp, plan.vp, plan.schedule, plan.dp_strategy, plan.micro_batch


def twins(ranked: list[dict]) -> dict:
    """The feasible plans indexed so that a plan's twin (the same plan with the other K/V exchange, or the other rank
    order; recompute may differ, the lightest that fits each) is found: {(choice, shape, the other choice's value):
    {value: result}}."""
    out: dict = {}
    for r in ranked:
        p = r["plan"]
        out.setdefault(("cp_comm", _shape(p), p.order), {})[p.cp_comm] = r
        out.setdefault(("order", _shape(p), p.cp_comm), {})[p.order] = r
    return out


def choice_decides(rival: dict, index: dict, best: dict) -> str:
    """What the rival's K/V exchange or rank order costs it, when its twin with the other choice is faster by more than
    0.5%: "decides" when the twin ties with the best (the choice alone is why it loses), else the share it costs;
    '' when neither choice costs it anything."""
    p, notes = rival["plan"], []
    for choice, other_value in (("cp_comm", p.order), ("order", p.cp_comm)):
        for value, twin in index.get((choice, _shape(p), other_value), {}).items():
            gain = twin["tokens_per_s_per_gpu"] / rival["tokens_per_s_per_gpu"] - 1
            if value == getattr(p, choice) or gain <= 0.005:
                continue
            name = "all-gather vs ring" if choice == "cp_comm" else "the rank order"
            verdict = "decides" if twin["tokens_per_s_per_gpu"] >= 0.995 * best["tokens_per_s_per_gpu"] else f"costs it {gain:.1%}"
            notes.append(f"{name} {verdict}: " + (_cp_comm_note(rival, twin) if choice == "cp_comm" else _order_note(rival, twin)))
    return "; ".join(notes)


def _cp_comm_note(rival: dict, twin: dict) -> str:
    p, q = rival["plan"], twin["plan"]
    mine, theirs = rival["time"]["exposed_s"]["cp"], twin["time"]["exposed_s"]["cp"]
    if p.cp_comm == "allgather":
        note = (f"the all-gathered K/V sit exposed ({mine:.2f} s a step) where ring attention "
                f"hides its passes behind attention ({theirs:.2f} s exposed)")
    else:
        note = (f"ring attention's 3(cp−1) K/V passes outlast the attention they hide behind "
                f"({mine:.2f} s exposed) where the all-gather sends 2(cp−1) blocks ({theirs:.2f} s)")
    if p.cp_comm == "allgather" and p.recompute != q.recompute:
        note += f"; holding the gathered K/V needs recompute {p.recompute} (ring: {q.recompute})"
    return note + f"; the {q.cp_comm} twin runs {twin['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU"


def _order_note(rival: dict, twin: dict) -> str:
    moved = [d for d, link in twin["time"]["links"].items() if link != rival["time"]["links"][d]]
    where = ", ".join(f"{d} on {twin['time']['links'][d]}" for d in moved)
    return (f"{ORDERS[twin['plan'].order].split(': ')[-1]} puts {where} "
            f"({twin['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU)")


def why_slower(best: dict, rival: dict) -> str:
    """The part of the step where the rival loses the most time against the best plan, in words."""
    tb, tr = best["time"], rival["time"]
    parts = {"compute": (tr["compute_s"], tb["compute_s"]), "recompute": (tr["recompute_s"], tb["recompute_s"]),
             "pipeline bubble": (tr["bubble_s"], tb["bubble_s"]), "optimizer": (tr["optimizer_s"], tb["optimizer_s"])}
    for dim, v in tr["exposed_s"].items():
        parts[f"exposed {dim} communication"] = (v, tb["exposed_s"][dim])
    if rival["tokens_per_s_per_gpu"] >= best["tokens_per_s_per_gpu"] * 0.995:
        return f"ties with the best (within 0.5%); ranked after it by the order plans are listed"
    name, (r, b) = max(parts.items(), key=lambda kv: kv[1][0] - kv[1][1])
    link = ""
    dim = name.split()[1] if name.startswith("exposed") else None
    if dim and tr["links"].get(dim) == "network":
        size = rival["dp"] if dim == "dp" else getattr(rival["plan"], dim)
        link = f" ({dim} {size} crosses the node: its collectives go over the network)"
    return f"{name} {r:.2f} s against {b:.2f} s{link}"
