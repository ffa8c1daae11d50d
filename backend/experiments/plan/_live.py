"""The plan scaled down and run live: the same dimensions, schedule, virtual stages, dp strategy and recompute through
parallel.mesh (tiny widths, every dimension above 1 at 2, at most 8 gloo ranks), and the run's measurements checked
against the very functions the planner calls: the Schedule's per-rank order (what gantt.replay and the makespan use),
costs.state_bytes's sharding of weights, gradients and optimizer states, costs.dp_sent_bytes's data-parallel volume.
What the tiny run cannot mirror is refused by name (ConfigError) rather than silently replaced."""
from __future__ import annotations

import dataclasses
import math

from backend import experiments
from backend.config import ConfigError
from backend.parallel import mesh
from backend.plan import costs
from backend.parallel.pp import schedules
from backend.result import Check

MAX_RANKS = 8
MAX_VP = 4                       # parallel.mesh's virtual_stages range
FP64 = {"parameters": 8, "gradients": 8, "optimizer states": 16}   # the mesh trains in float64, Adam's m and v
PLAN_NAME = {"parameters": "weights", "gradients": "gradients", "optimizer states": "optimizer states"}
MESH_STRATEGY = {"ddp": "ddp", "zero1": "zero1", "zero2": "zero2", "zero3": "zero3", "fsdp": "zero3"}
MESH_ORDER = "-".join(d for d in mesh.DIMS if d != "ep")   # the live mesh's rank order, outermost first (ep apart)
FIELD = {"virtual_stages": "vp", "layers": "pp", "world_size": "pp", "batch": "micro_batch", "microbatches": "micro_batch"}


def settings(plan, model, dp: int) -> dict:
    """parallel.mesh settings mirroring the plan; ConfigError naming the plan's field the tiny run cannot mirror."""
    if plan.dp_strategy not in MESH_STRATEGY:
        raise ConfigError("dp_strategy", f"{plan.dp_strategy} cannot be run live: parallel.mesh shards over one dp group "
                                         f"(allowed with live_check: {', '.join(MESH_STRATEGY)})")
    if plan.vp > MAX_VP:
        raise ConfigError("vp", f"{plan.vp} cannot be run live: parallel.mesh runs at most {MAX_VP} virtual stages "
                                f"(allowed with live_check: 1 to {MAX_VP})")
    if plan.cp > 1 and plan.cp_comm != "ring":
        raise ConfigError("cp_comm", f"{plan.cp_comm} cannot be run live: parallel.mesh runs ring attention "
                                     "(allowed with live_check: ring)")
    if plan.order != MESH_ORDER:
        raise ConfigError("order", f"{plan.order} cannot be run live: parallel.mesh numbers its ranks {MESH_ORDER} "
                                   f"(mesh.DIMS) (allowed with live_check: {MESH_ORDER})")
    live = {d: 2 if n > 1 else 1 for d, n in (("tp", plan.tp), ("pp", plan.pp), ("cp", plan.cp), ("ep", plan.ep), ("dp", dp))}
    world = math.prod(live.values())
    if world > MAX_RANKS:
        above = [d for d, n in live.items() if n > 1]
        raise ConfigError("tp", f"the plan has {len(above)} dimensions above 1 ({', '.join(above)}): {world} ranks at 2 each "
                                f"(allowed with live_check: at most 3, {MAX_RANKS} ranks)")
    sched = schedules.SCHEDULES[plan.schedule]
    chunks = live["pp"] * sched.chunks(plan.vp)
    m = 2 * live["pp"] if sched.interleaved and plan.vp > 1 else 2
    out = {"world_size": world, "tp": live["tp"], "pp": live["pp"], "cp": live["cp"], "ep": live["ep"],
           "experts": 2 * live["ep"] if model.experts else 0, "schedule": plan.schedule, "virtual_stages": plan.vp,
           "dp_strategy": MESH_STRATEGY[plan.dp_strategy] if live["dp"] > 1 else "allreduce",
           "recompute": plan.recompute, "microbatches": m, "batch": live["dp"] * live["ep"] * m,
           "layers": chunks * max(1, math.ceil(4 / chunks)), "seq": 8 * live["cp"], "steps": 1}
    try:
        experiments.get("parallel.mesh").config_cls(**out).validate()
    except ConfigError as err:
        raise ConfigError(FIELD.get(err.field, err.field), f"cannot be run live: parallel.mesh refuses {err}") from None
    return out


def order_check(plan, result) -> Check:
    """Every rank's executed order (its last step's F/B/I/W actions) against the Schedule's actions, the order the
    planner's Gantt and makespan walk."""
    m, p, v = result.metrics["_live_m"], result.metrics["pp"], plan.vp
    want = schedules.SCHEDULES[plan.schedule].actions(p, m, v)
    got = executed_orders(result)
    coords = {r["rank"]: r["pp"] for r in result.tables["ranks"]}
    wrong = sum(got.get(rank, []) != [(a.kind, a.stage, a.mb) for a in want[pp]] for rank, pp in coords.items())
    return Check(f"every rank ran the {plan.schedule} order the planner's Gantt and makespan use (v = {v})", wrong, 0,
                 reference="schedules.SCHEDULES[...].actions(p, m, v), the per-rank order gantt.replay walks",
                 detail=f"{wrong} of {len(coords)} ranks out of order")


def executed_orders(result) -> dict[int, list[tuple]]:
    """Each rank's executed (kind, stage, micro-batch) actions from the run's trace, in the order they ran."""
    got: dict[int, list] = {}
    for e in result.trace_events:
        if e.get("lane") == "compute" and e["args"].get("kind") in ("F", "B", "I", "W"):
            got.setdefault(e["rank"], []).append((e["args"]["kind"], e["args"]["stage"], e["args"]["mb"]))
    return got


def in_flight_check(plan, result) -> Check:
    """Chunk-micro-batches whose activations each rank held at its peak, counted on the executed order (+1 at F,
    -1 at B or W), against costs.live_microbatches: the count the planner's activation memory multiplies by."""
    m, p, v = result.metrics["_live_m"], result.metrics["pp"], plan.vp
    coords = {r["rank"]: r["pp"] for r in result.tables["ranks"]}
    worst = 0
    for rank, order in executed_orders(result).items():
        held = peak = 0
        for kind, _, _ in order:
            held += 1 if kind == "F" else -1 if kind in ("B", "W") else 0
            peak = max(peak, held)
        worst = max(worst, abs(peak - costs.live_microbatches(plan.schedule, p, m, v, coords[rank])))
    return Check(f"micro-batches in flight at each rank's peak equal the planner's {plan.schedule} count", worst, 0,
                 reference="costs.live_microbatches (the schedule's live bound), against the executed order counted")


def state_check(plan, result, dp: int) -> Check:
    """Weights, gradients and Adam states each rank holds, against costs.state_bytes's rule of which are split over dp
    (the planner's memory bars), at the mesh's float64 bytes per element; ψ from the rank's weights."""
    strategy = "ddp" if dp == 1 else plan.dp_strategy
    k = result.metrics["dp"]
    whole, split = costs.state_bytes(1.0, 1, strategy, 2), costs.state_bytes(1.0, k, strategy, 2)
    frac = {c: split[PLAN_NAME[c]] / whole[PLAN_NAME[c]] for c in FP64}
    held: dict[int, dict] = {}
    for r in result.tables["memory"]:
        if r["category"] in FP64:
            held.setdefault(r["rank"], {})[r["category"]] = r["measured_bytes"]
    worst = 0.0
    for cats in held.values():
        psi = cats["parameters"] / FP64["parameters"] / frac["parameters"]
        worst = max(worst, max(abs(cats[c] / (FP64[c] * psi * frac[c]) - 1) for c in FP64))
    return Check(f"weights, gradients and optimizer states per rank split over dp {k} as the planner's {plan.dp_strategy} rule",
                 worst, 0.02, reference="costs.state_bytes (estimate.training.memory_per_rank's stages), at 8/8/16 float64 bytes",
                 detail="relative; padding the flat vector to a multiple of dp leaves < 2% at these sizes")


def dp_bytes_check(plan, result) -> Check:
    """Bytes each rank sent over dp in the one step, against costs.dp_sent_bytes (comm.collectives.ring_bytes underneath) for the
    rank's flat parameters padded to a multiple of dp."""
    k = result.metrics["dp"]
    strategy = "ddp" if result.metrics["dp_strategy"] in ("allreduce", "ddp") else result.metrics["dp_strategy"]
    weights = {r["rank"]: r["measured_bytes"] for r in result.tables["memory"] if r["category"] == "parameters"}
    worst = 0.0
    for row in result.tables["ranks"]:
        n = weights[row["rank"]] // 8 * (k if strategy == "zero3" else 1)
        padded = -(-n // k) * k
        want = costs.dp_sent_bytes(strategy, padded, k, 8, 8)
        worst = max(worst, abs(row["dp gradients bytes sent"] / want - 1) if want else row["dp gradients bytes sent"])
    return Check(f"data-parallel bytes per rank equal the planner's {strategy} volume", worst, 0.02,
                 reference="costs.dp_sent_bytes: DDP all-reduce 2ψ(k-1)/k; ZeRO-1/2 reduce-scatter + all-gather; "
                           "ZeRO-3/FSDP two all-gathers (the mesh's one step gathers once for it and once to report)",
                 detail="relative; DDP's buckets are padded one by one")


def mesh_run(plan, model, dp: int) -> tuple[object, dict]:
    """The mirrored plan run through parallel.mesh: its Result (with the live m, dp and strategy in its metrics) and settings."""
    mesh = settings(plan, model, dp)
    result = experiments.run("parallel.mesh", **mesh)
    result.metrics.update({"_live_m": mesh["microbatches"], "dp_strategy": mesh["dp_strategy"],
                           "dp": mesh["world_size"] // (mesh["tp"] * mesh["pp"] * mesh["cp"] * mesh["ep"])})
    return result, mesh


def planner_checks(plan, result, dp: int) -> list[Check]:
    """The run's measurements against the planner's own functions (state sharding, dp volume, schedule order)."""
    out = [state_check(plan, result, dp)]
    if result.metrics["dp"] > 1:
        out.append(dp_bytes_check(plan, result))
    if result.metrics["pp"] > 1:
        out += [order_check(plan, result), in_flight_check(plan, result)]
    return out


def run(plan, model, dp: int) -> tuple[list[Check], dict]:
    """Run the mirrored plan; the planner-function checks and the mesh's own, with the settings that ran."""
    result, mesh = mesh_run(plan, model, dp)
    checks = [dataclasses.replace(c, name=f"live, scaled down: {c.name}") for c in planner_checks(plan, result, dp) + result.checks]
    return checks, {**mesh, "mirrors": "dimensions, schedule, virtual stages, dp strategy, recompute"}
