"""parallel.checkpoint: sharded DCP checkpoints of a data-parallel run, a rank killed by SIGKILL, all ranks
restarted from the last checkpoint, and the final parameters against an uninterrupted run, bit for bit."""
from __future__ import annotations

import dataclasses
import datetime
import shutil

import numpy as np
import torch
import torch.distributed as dist

from backend.config import ConfigError, setting
from backend.limits import cost
from backend.experiments import define
from backend.parallel import checkpoint as ckpt
from backend.parallel.mesh_checkpoint import bench_rows
from backend.parallel.loop import start_rank, train
from backend.parallel.workload import FP64, WorkloadConfig, reference_run
from backend.result import Check, Result, Schema
from backend.trace import Tracer

STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "fsdp")
BASELINE = "uninterrupted.npy"


@dataclasses.dataclass
class CheckpointConfig(WorkloadConfig):
    world_size: int = setting(2, min=2, max=8, help="data-parallel ranks n")
    steps: int = setting(6, min=2, max=100, help="training steps")
    strategy: str = setting("zero3", choices=STRATEGIES, help="how the model and Adam's states are held and sharded")
    every: int = setting(2, min=1, max=100, help="checkpoint interval (steps between saves)")
    kill_rank: int = setting(1, min=-1, max=7, help="rank killed by SIGKILL (-1: none)")
    kill_step: int = setting(3, min=0, max=99, help="step in which that rank is killed (after its backward)")
    max_restarts: int = setting(1, min=0, max=3, help="times all ranks may be restarted from the last checkpoint (0: the kill fails the run, which its page can resume)")
    save: str = setting("sync", choices=("sync", "async"), help="dcp.save blocks the step; dcp.async_save stages a copy and writes it in a thread")
    mtbf_s: float = setting(30.0, min=1.0, max=1e7, help="mean time between failures (s) for the interval trade-off")
    reshard_to: str = setting("same", choices=("same", "off") + STRATEGIES, help="after the run, the last checkpoint before its end loaded on another plan (same: this strategy on reshard_ranks) and training continued (off: none)")
    reshard_ranks: int = setting(1, min=1, max=8, help="ranks of that plan (at most world_size: the same processes, regrouped)")

    cost_drivers = ("batch", "hidden", "steps", "layers", "world_size")

    def check(self) -> None:
        super().check()
        if self.kill_rank >= self.world_size:
            raise ConfigError("kill_rank", f"{self.kill_rank} is not a rank of world_size={self.world_size} "
                                           f"(allowed: -1 to {self.world_size - 1})")
        if self.kill_step >= self.steps:
            raise ConfigError("kill_step", f"{self.kill_step} is past the last step (allowed: 0 to {self.steps - 1})")
        if self.every > self.steps:
            raise ConfigError("every", f"{self.every} saves nothing in {self.steps} steps (allowed: 1 to steps)")
        if self.reshard_to == "off":
            return
        if self.reshard_ranks > self.world_size:
            raise ConfigError("reshard_ranks", f"{self.reshard_ranks} is more than the run's world_size={self.world_size} "
                                               f"(allowed: 1 to {self.world_size})")
        if self.batch < self.reshard_ranks:
            raise ConfigError("reshard_ranks", f"{self.reshard_ranks} ranks cannot split a batch of {self.batch} "
                                               f"(allowed: 1 to {min(self.batch, self.world_size)})")
        if (self.strategy == "fsdp") != (self.target == "fsdp"):
            same = ["fsdp"] if self.strategy == "fsdp" else [s for s in STRATEGIES if s != "fsdp"]
            raise ConfigError("reshard_to", f"{self.reshard_to} cannot load a {self.strategy} checkpoint: FSDP2 saves "
                                            f"DTensor rows, ours flat vectors (allowed with strategy={self.strategy}: "
                                            f"same, off, {', '.join(same)})")
        if self.every >= self.steps:
            raise ConfigError("every", f"{self.every} leaves no checkpoint before the last step to continue from on "
                                       f"another plan (allowed with reshard_to={self.reshard_to}: 1 to {self.steps - 1})")

    @property
    def target(self) -> str:
        """The strategy the checkpoint is continued with on reshard_ranks."""
        return self.strategy if self.reshard_to == "same" else self.reshard_to

    def estimate(self):
        """As WorkloadConfig's run, done twice when a rank is killed (the uninterrupted run, then the resumed one)
        with the ranks started twice, plus the continuation on another plan (the steps after the last save before
        the end, in the same processes), plus each save: every rank writes and hashes its shard of 3 x params x 8 B."""
        params = self.layers * (self.hidden * self.hidden + self.hidden)
        continued = self.steps - self.every * ((self.steps - 1) // self.every)  # steps after the last save before the end
        runs = (2 if self.kill_rank >= 0 else 1) + (continued / self.steps if self.reshard_to != "off" else 0)
        activations = self.batch * self.hidden * self.layers * 8 * 3
        saves = self.steps // self.every
        return cost(data_bytes=(self.world_size + 2) * (params * 8 * 8 + activations),
                    flops=runs * 2 * 6 * self.batch * params * self.steps,
                    moved_bytes=runs * self.steps * params * 8 * 4 * self.world_size + saves * 3 * params * 8 * 4,
                    ops=runs * self.steps * self.layers * 250 * (self.world_size + 2) + saves * 5000 * self.world_size,
                    ranks=(2 if self.kill_rank >= 0 else 1) * self.world_size)  # the regrouped ranks are the same processes


def make_strategy(name: str, workload, mesh, tracer):
    from backend.parallel.ddp import DDP
    from backend.parallel.fsdp import FSDP2
    from backend.parallel.zero import ZeRO

    if name == "ddp":
        return DDP(workload, mesh, tracer, FP64)
    if name == "fsdp":
        return FSDP2(workload, mesh, tracer)
    return ZeRO(workload, mesh, tracer, FP64, stage=int(name[-1]))


def run_rank(rank, world, config: CheckpointConfig, ctx):
    root = ckpt.folder(ctx)
    parent = ckpt.parent_folder(ctx)  # a failed run this one resumes (from its record in the store)
    mesh, tracer = start_rank(rank, world)
    if parent and rank == 0 and not (root / ckpt.TIMELINE).exists():  # the parent's history (and baseline) go on
        root.mkdir(parents=True, exist_ok=True)
        for name in (ckpt.TIMELINE, BASELINE):
            if (parent / name).exists():
                shutil.copy(parent / name, root / name)
    dist.barrier()
    before = ckpt.read_timeline(parent) if parent else []  # the attempts numbered on from the parent's
    attempt = (1 + max((e.get("attempt", 0) for e in before), default=0) if parent else 0) + ctx.attempt
    faulted = config.kill_rank >= 0
    if faulted and attempt == 0:  # the same training without checkpoints or fault: what the resumed run must equal
        baseline = train(make_strategy(config.strategy, config.workload, mesh, Tracer(rank)))
        if rank == 0:
            root.mkdir(parents=True, exist_ok=True)
            np.save(root / BASELINE, baseline.params)
        dist.barrier()

    def fault(step):
        if attempt == 0 and rank == config.kill_rank and step == config.kill_step:
            ckpt.kill_self(root, rank, step)

    saver = ckpt.Checkpointer(root, config.every, rank, attempt=attempt, asynchronous=config.save == "async",
                              parent=parent)
    report = train(make_strategy(config.strategy, config.workload, mesh, tracer), ctx.progress, saver,
                   fault if faulted else None)
    report.extra = {"attempt": attempt, "saves": [dataclasses.asdict(s) for s in saver.saves],
                    "load_seconds": saver.load_seconds, "resumed_from": saver.resumed_from,
                    "parent": parent.parent.name if parent else None}
    if rank == 0:
        last = saver.latest()
        report.extra.update(timeline=ckpt.read_timeline(root), files=ckpt.files_per_rank(last) if last else [],
                            pieces=ckpt.pieces(last) if last else [],
                            checkpoint=last.name if last else None,
                            baseline=np.load(root / BASELINE) if faulted else None)
    if config.reshard_to != "off":
        report.extra["reshard"] = continue_on_another_plan(rank, config, ctx, root)
    return report


def continue_on_another_plan(rank: int, config: CheckpointConfig, ctx, root) -> dict | None:
    """Resharding: the same processes regrouped as `reshard_ranks` ranks (the others wait), which load the newest
    checkpoint saved before the run's last step with the `reshard_to` strategy (DCP reads each saved shard where
    it overlaps what a new rank holds) and train the remaining steps; then the whole group is formed again (the
    launcher gathers the payloads over it). Their parameters and losses, and which saved file's bytes each new rank
    read (the load plan DCP made), go back in the payload."""
    n, world = config.reshard_ranks, dist.get_world_size()
    out, stores = None, [root / f"regroup_{ctx.attempt}_{name}.store" for name in ("new", "all")]
    if rank == 0:
        for store in stores:  # left by an earlier attempt: their stale keys would be read as this one's
            store.unlink(missing_ok=True)
    regroup(rank, world, n, stores[0], ctx.timeout_s)
    if rank < n:
        source = ckpt.newest_before([root, ckpt.parent_folder(ctx)], config.steps)
        mesh, tracer = start_rank(rank, n)
        saver = ckpt.Checkpointer(root / "resharded", 0, rank, attempt=ctx.attempt, source=source)
        report = train(make_strategy(config.target, config.workload, mesh, tracer), None, saver)
        out = {"params": report.params, "losses": report.losses, "from": source.name, "reads": saver.reads,
               "held_bytes": saver.held_bytes, "load_s": saver.load_seconds}
    regroup(rank, n, world, stores[1], ctx.timeout_s)
    return out


def regroup(rank: int, old: int, new: int, store, timeout_s: float) -> None:
    """Replace this process's default group of `old` ranks by one of the first `new` ranks (a file store in the run's
    folder as the rendezvous); ranks past `new` are left without a group. Every rank of the old group calls it."""
    if rank < old:
        dist.barrier()  # every member is here before the group is taken down
        dist.destroy_process_group()
    if rank < new:
        dist.init_process_group("gloo", store=dist.FileStore(str(store), new), rank=rank, world_size=new,
                                timeout=datetime.timedelta(seconds=timeout_s))


def expected_time_per_step(k: np.ndarray, step_s: float, save_s: float, restart_s: float, mtbf_s: float) -> np.ndarray:
    """Wall time per useful step with a save every k steps and failures arriving as a Poisson process (rate 1/M):
    a segment of s = k*step + save seconds, retried from its start after each failure (which also costs the
    restart R), takes (M + R)(e^(s/M) - 1) in expectation (the exact renewal result, no first-order cut)."""
    seg = k * step_s + save_s
    return (mtbf_s + restart_s) * np.expm1(seg / mtbf_s) / k


def simulated_time_per_step(k: int, step_s: float, save_s: float, restart_s: float, mtbf_s: float,
                            segments: int = 4000, seed: int = 0) -> float:
    """The same by Monte Carlo: draw failure times, redo the segment after each, count the wall time."""
    rng, seg, total = np.random.default_rng(seed), k * step_s + save_s, 0.0
    for _ in range(segments):
        while (x := rng.exponential(mtbf_s)) < seg:
            total += x + restart_s
        total += seg
    return total / (segments * k)


def interval_tradeoff(step_s: float, save_s: float, restart_s: float, mtbf_s: float) -> dict:
    """Interval k against wall time per useful step; the optimum, Young's sqrt(2 C M) interval beside it, and a
    Monte Carlo run at a few k against the closed form."""
    young_s = float(np.sqrt(2 * save_s * mtbf_s))
    k_young = max(1, round(young_s / step_s))
    ks = np.unique(np.geomspace(1, max(4 * k_young, 8), 60).round().astype(int))
    cost_k = expected_time_per_step(ks, step_s, save_s, restart_s, mtbf_s)
    best = int(ks[np.argmin(cost_k)])
    at = lambda k: float(expected_time_per_step(np.array([k]), step_s, save_s, restart_s, mtbf_s)[0])
    probes = sorted({max(1, k_young // 4), k_young, 4 * k_young})
    mc = [{"interval_steps": k, "closed_form_s": at(k), "monte_carlo_s": simulated_time_per_step(k, step_s, save_s, restart_s, mtbf_s, seed=k)}
          for k in probes]
    rows = [{"interval_steps": int(k), "time_per_step_s": float(c), "overhead_pct": 100 * (float(c) / step_s - 1),
             "lost_work_s_per_failure": float(k) * step_s / 2} for k, c in zip(ks, cost_k)]
    return {"rows": rows, "young_s": young_s, "young_steps": k_young, "best_steps": best,
            "young_vs_best": at(k_young) / at(best) - 1, "monte_carlo": mc,
            "mc_error": max(abs(m["monte_carlo_s"] / m["closed_form_s"] - 1) for m in mc)}


def expected_tensor_bytes(config: CheckpointConfig) -> int:
    """What one checkpoint must hold, counted from the settings alone: the float64 weights, Adam's m and v
    (3 x layers x (h^2 + h) x 8 bytes), Adam's step (one int64; FSDP2's torch Adam: a float32 per parameter
    tensor), the step and the losses so far (int64, steps x float64), and each rank's CPU generator state."""
    params = config.layers * (config.hidden * config.hidden + config.hidden)
    adam_step = 2 * config.layers * 4 if config.strategy == "fsdp" else 8
    return 3 * params * 8 + adam_step + 8 + config.steps * 8 + config.world_size * torch.get_rng_state().numel()


def category(key: str) -> str:
    """What a checkpoint key holds, by the names checkpoint_state() gives (ours and DCP's get_state_dict)."""
    if key.startswith("rng."):
        return "random state"
    if key.startswith("loop."):
        return "step and losses"
    if key == "optim.step" or key.endswith(".step"):
        return "Adam step"
    return "weights" if key.startswith("model.") else "Adam m, v"


def owned(total: int, rank: int, n: int) -> int:
    """Elements of a length-`total` dimension rank holds when it is cut in n pieces of ceil(total / n)
    (torch.chunk's rule, which ZeRO's padded flat shards and FSDP2's dim-0 rows both follow)."""
    size = -(-total // n)
    return max(0, min((rank + 1) * size, total) - rank * size)


def sharded_weight_elements(config: CheckpointConfig, rank: int) -> int:
    """The weight elements `rank` alone holds, from the settings: ZeRO-1/2 cut the whole flat vector, ZeRO-3 each
    layer's h^2 + h, FSDP2 each weight's and bias's h rows; DDP holds nothing alone (all of it replicated)."""
    h, L, n = config.hidden, config.layers, config.world_size
    if config.strategy == "ddp":
        return 0
    if config.strategy in ("zero1", "zero2"):
        return owned(L * (h * h + h), rank, n)
    if config.strategy == "zero3":
        return L * owned(h * h + h, rank, n)
    return L * owned(h, rank, n) * (h + 1)


def bytes_per_rank(config: CheckpointConfig, pieces: list[dict]) -> list[dict]:
    """Each rank's tensor bytes in the checkpoint by category, beside what the settings say it alone must hold:
    its weights and Adam m, v (3 x 8 B per element it owns) and its generator state. Replicated tensors (the steps,
    the losses; DDP's whole state) DCP writes once, on a rank its planner picks: shown as written, not predicted."""
    rows = []
    for rank in range(config.world_size):
        mine = [p for p in pieces if p["rank"] == rank]
        by = {c: sum(p["bytes"] for p in mine if category(p["key"]) == c)
              for c in ("weights", "Adam m, v", "Adam step", "step and losses", "random state")}
        sharded = by["random state"] + (by["weights"] + by["Adam m, v"] if config.strategy != "ddp" else 0)
        expected = 3 * 8 * sharded_weight_elements(config, rank) + torch.get_rng_state().numel()
        rows.append({"rank": rank, **by, "sharded bytes": sharded, "expected sharded bytes": expected,
                     "replicated, written here": sum(by.values()) - sharded})
    return rows


def reshard_result(config: CheckpointConfig, reports, ref) -> tuple[list[Check], dict, dict]:
    """The continuation on another plan (continue_on_another_plan) against one float64 process (checkpoint.reshard_result's
    checks)."""
    new = [{**r.extra["reshard"], "held": r.extra["reshard"]["held_bytes"]} for r in reports[:config.reshard_ranks]]
    param_err = max(float(np.abs(n["params"] - ref["params"].numpy()).max()) for n in new)
    loss_err = max(abs(a - b) for n in new for a, b in zip(n["losses"], ref["losses"]))
    plan = f"{config.strategy} on {config.world_size} ranks -> {config.target} on {config.reshard_ranks}"
    return ckpt.reshard_result(plan, new, param_err, loss_err, "single-process PyTorch training the whole batch (float64)")


def interval_result(config: CheckpointConfig, first) -> tuple[list[Check], dict, dict]:
    """The checkpoint interval's trade-off from the run's measured step, save and load times (interval_tradeoff): the
    checks of the closed form against Monte Carlo and of Young's interval against the best, its metrics and tables.
    Nothing when the run took no two consecutive steps or saved nothing."""
    timeline = first.extra["timeline"]
    steps = [b["t"] - a["t"] for a, b in zip(timeline, timeline[1:]) if a["event"] == b["event"] == "step"
             and b["step"] == a["step"] + 1]
    if steps and first.extra["saves"]:
        step_s = float(np.median(steps))
        save_s = float(np.mean([s["seconds"] for s in first.extra["saves"]]))
        restart_s = first.extra["load_seconds"] or save_s
        trade = interval_tradeoff(step_s, save_s, restart_s, config.mtbf_s)
        metrics = dict(step_s=step_s, young_interval_s=trade["young_s"], young_interval_steps=trade["young_steps"],
                       best_interval_steps=trade["best_steps"], young_overhead_above_best_pct=100 * trade["young_vs_best"])
        checks = [Check("Monte Carlo failures match the closed-form time per step", trade["mc_error"], 0.05,
                        reference="4,000 simulated segments per interval, exponential failure times",
                        detail="relative difference, worst of 3 intervals"),
                  Check("Young's interval sqrt(2 x save x MTBF) costs within 5 % of the best interval",
                        trade["young_vs_best"], 0.05, reference="the exact expected time per step over 60 intervals",
                        detail=f"Young {trade['young_steps']} steps, best {trade['best_steps']} steps")]
        return checks, metrics, {"interval": trade["rows"], "monte_carlo": trade["monte_carlo"]}
    return [], {}, {}


def combine(config: CheckpointConfig, reports) -> Result:
    first = reports[0]
    ref = reference_run(config.workload)
    param_err = max((torch.from_numpy(r.params) - ref["params"]).abs().max().item() for r in reports)
    loss_err = max(abs(a - b) for a, b in zip(first.losses, ref["losses"]))
    files = first.extra["files"]
    stored = sum(f["tensor bytes"] for f in files)
    checks = [
        Check("final parameters equal one process (float64, same Adam) after the resume", param_err, 1e-9,
              reference="single-process PyTorch training the whole batch", detail="max |difference|"),
        Check("every step's loss, kept in the checkpoint across the restart, equals the reference", loss_err, 1e-9,
              reference="single-process PyTorch"),
        Check("tensor bytes in the last checkpoint equal the model's state exactly", abs(stored - expected_tensor_bytes(config)), 0,
              reference="weights + Adam m, v + Adam step + loop step, losses + per-rank RNG, counted from the settings",
              detail=f"{stored} B stored in {len(files)} files"),
    ]
    per_rank = bytes_per_rank(config, first.extra["pieces"])
    checks.append(Check("each rank's file holds exactly its own shards: weights, Adam m, v and its RNG state",
                        max(abs(r["sharded bytes"] - r["expected sharded bytes"]) for r in per_rank), 0,
                        reference="3 x 8 B per weight element the rank owns (ceil(total / n) pieces) + one generator "
                                  "state, counted from the settings",
                        detail="; ".join(f"rank {r['rank']}: {r['sharded bytes']:,} B" for r in per_rank)))
    timeline = first.extra["timeline"]
    kills = [e for e in timeline if e["event"] == "kill"]
    metrics = {"strategy": config.strategy, "world_size": config.world_size, "attempts": first.extra["attempt"] + 1,
               "checkpoint_tensor_bytes": stored, "checkpoint_file_bytes": sum(f["bytes"] for f in files),
               "save_s_mean": float(np.mean([s["seconds"] for s in first.extra["saves"]])) if first.extra["saves"] else None,
               "load_s": first.extra["load_seconds"],
               "dcp_metadata_bytes": sum(f["bytes"] for f in files if f["file"] == ".metadata")}
    if config.kill_rank >= 0:
        base_err = max(float(np.abs(r.params - first.extra["baseline"]).max()) for r in reports)
        bitwise = all(np.array_equal(r.params.view(np.uint64), first.extra["baseline"].view(np.uint64)) for r in reports)
        checks.append(Check("final parameters equal the uninterrupted run's bit for bit", 0.0 if bitwise else max(base_err, 1e-300), 0,
                            reference="the same strategy trained without checkpoints or the kill, in the same processes",
                            detail="bits compared as uint64"))
        resumed = [e for e in timeline if e["event"] == "start" and e["attempt"] > 0]
        checks.append(Check("the killed rank died by SIGKILL and all ranks restarted", 0 if kills and resumed else 1, 0,
                            reference="timeline: a kill, then a start in attempt 1 from the last checkpoint"))
        last_saved = resumed[-1]["step"] if resumed else 0
        metrics.update(killed_rank=config.kill_rank, killed_in_step=config.kill_step, resumed_from_step=last_saved,
                       steps_redone=config.kill_step - last_saved)
    interval_checks, interval_metrics, tables_extra = interval_result(config, first)
    checks += interval_checks
    metrics.update(interval_metrics)
    tables_extra["bytes_per_rank"] = per_rank
    if config.reshard_to != "off":
        more_checks, more_metrics, more_tables = reshard_result(config, reports, ref)
        checks += more_checks
        metrics.update(more_metrics)
        tables_extra.update(more_tables)
    t0 = timeline[0]["t"] if timeline else 0.0
    events = [{**e, "t_s": e["t"] - t0} for e in timeline]
    notes = [f"Rank {config.kill_rank} was killed by SIGKILL in step {config.kill_step}; every rank was restarted and "
             f"resumed from the checkpoint after step {metrics.get('resumed_from_step')}, redoing "
             f"{metrics.get('steps_redone')} step(s)." if config.kill_rank >= 0 else "No fault: the run saved its checkpoints."]
    if first.extra["parent"]:
        metrics["parent_run"] = first.extra["parent"]
        notes = [f"Run {first.extra['parent']} failed when rank {config.kill_rank} was killed by SIGKILL in step "
                 f"{config.kill_step}; this run resumed it from its newest checkpoint ({first.extra['resumed_from']}), "
                 f"redoing {metrics.get('steps_redone')} step(s). The timeline holds both runs."]
    measured = bench_rows()  # bench/checkpoint.py's figures as they stood when this run ran (None before the bench ran)
    if measured is not None:
        about, tables_extra["bench"] = measured
        metrics.update({f"bench.{k}": v for k, v in about.items()})
    return Result(metrics=metrics, checks=checks, tables={"timeline": events, "files": files, **tables_extra,
                                                          "loss": [{"step": i, "loss": l} for i, l in enumerate(first.losses)]},
                  trace_events=[e for r in reports for e in r.trace["events"]], notes=notes)


KILLED = ("killed_rank", "killed_in_step", "resumed_from_step", "steps_redone")  # kill_rank >= 0
INTERVAL = ("step_s", "young_interval_s", "young_interval_steps", "best_interval_steps",
            "young_overhead_above_best_pct")  # when the run timed consecutive steps and saved at least once
RESHARD = ("reshard_plan", "reshard_from", "reshard_load_s")  # reshard_to != off
BENCH = ("bench.machine", "bench.when", "bench.load")  # bench/results/checkpoint.json present when the run ran
RESULT = Schema(
    metrics=("strategy", "world_size", "attempts", "checkpoint_tensor_bytes", "checkpoint_file_bytes", "save_s_mean",
             "load_s", "dcp_metadata_bytes", *KILLED, *INTERVAL, *RESHARD, *BENCH, "parent_run"),
    tables={"timeline": ("t", "t_s", "event", "step", "attempt", "seconds", "blocking", "load_seconds", "rank", "pid"),
            "files": ("file", "rank", "bytes", "tensor bytes"),
            "interval": ("interval_steps", "lost_work_s_per_failure", "overhead_pct", "time_per_step_s"),
            "monte_carlo": ("interval_steps", "closed_form_s", "monte_carlo_s"),
            "bytes_per_rank": ("rank", "weights", "Adam m, v", "Adam step", "random state", "step and losses",
                               "replicated, written here", "sharded bytes", "expected sharded bytes"),
            "reshard_map": ("new rank", "saved rank", "key", "file", "from byte", "bytes"),
            "reshard_bytes": ("new rank", "saved rank", "bytes"),
            "loss": ("step", "loss"),
            "bench": ("plan", "save", "blocking (s)", "min-max (s)", "load (s)", "step, saving (s)", "step, not (s)",
                      "bytes / model (B)", "top rank (B)")},
    optional=(*KILLED, *INTERVAL, *RESHARD, "parent_run",  # parent_run: a run resumed from a failed one's checkpoint
              "interval", "monte_carlo", "reshard_map", "reshard_bytes", *BENCH, "bench"),
)

EXPERIMENT = define(__name__, CheckpointConfig, "Sharded DCP checkpoints, a rank killed by SIGKILL and the run resumed bit for bit",
                    rank_fn=run_rank, combine=combine, lanes=("compute", "collective", "comm"),
                    preload=("torch.distributed.fsdp", "torch.distributed.checkpoint"), schema=RESULT)
