"""Every plan for a model on a cluster at a global batch and sequence length, ranked by predicted throughput.

Enumerated: tp (divisors of the heads' constraint, up to two nodes), cp, pp (≤ layers), ep (MoE), the DP strategy,
recompute, micro-batch and schedule (1F1B, interleaved with 2 chunks, zero bubble). Pruned without losing a plan
that could win: a plan's memory is checked before its time, and recompute modes are tried from none upward, so the
heavier ones are evaluated only for shapes where none does not fit (more recompute never runs faster).
"""
from __future__ import annotations

import dataclasses
import time

from backend.config import ConfigError
from backend.plan import models as M
from backend.plan.clusters import Cluster
from backend.plan.predict import Efficiency, Plan, evaluate, memory, total_bytes, validate

GiB = 2 ** 30


def _powers(limit: int) -> list[int]:
    out, k = [], 1
    while k <= limit:
        out.append(k)
        k *= 2
    return out


def candidates(model: M.ModelSpec, cluster: Cluster, global_batch: int, seq_len: int):
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
                                yield Plan(tp=tp, sp=tp > 1, cp=cp, ep=ep, pp=pp, vp=vp, schedule=schedule, dp_strategy=strategy,
                                           hsdp_shard=gpn, micro_batch=mb, global_batch=global_batch, seq_len=seq_len)


def search(model: M.ModelSpec, cluster: Cluster, global_batch: int, seq_len: int, eff: Efficiency, limit: int = 200_000) -> dict:
    """Ranked feasible plans, the infeasible with their reason, and how long the search took."""
    start = time.perf_counter()
    feasible, infeasible, tried = [], [], 0
    for base in candidates(model, cluster, global_batch, seq_len):
        if tried >= limit:
            break
        try:
            dp = validate(model, cluster, base)
        except ConfigError as err:
            infeasible.append({"plan": base, "reason": str(err)})
            continue
        for rec in ("none", "selective", "full"):
            plan = dataclasses.replace(base, recompute=rec)
            tried += 1
            mem = memory(model, cluster, plan, dp, eff)
            need = total_bytes(mem)
            if need > cluster.gpu.hbm_bytes:
                if rec == "full":
                    cats = {k: v for k, v in mem.items() if not k.startswith("_") and k != "stage"}
                    top = max(cats, key=cats.get)
                    infeasible.append({"plan": plan, "reason": f"does not fit: {need / GiB:.1f} GiB > {cluster.gpu.hbm_bytes / GiB:.0f} GiB "
                                                               f"(largest: {top}, {cats[top] / GiB:.1f} GiB) even with full recompute"})
                continue
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
    parts += [plan.dp_strategy, f"mb{plan.micro_batch}", f"recompute {plan.recompute}"]
    return " ".join(parts)


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
