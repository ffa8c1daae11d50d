"""parallel.checkpoint: the tiny LLaMA trained by the mesh's loop as a dp-only plan (dp_model.mesh_plan), saving sharded
DCP checkpoints (backend/checkpoint/); a rank killed by SIGKILL, every rank restarted from the last
checkpoint (the spawner's or torchrun's --max-restarts; with none the run fails and its page resumes it from the store),
the final weights bit for bit against the uninterrupted run; the last checkpoint before the end continued on fewer ranks
under another dp strategy; the save interval against the failure rate. Runs stored before version 2 trained the
Linear+tanh MLP (the `mlp` shape of the result, still drawn by the page)."""
from __future__ import annotations

import dataclasses

import numpy as np

from backend.config import Config, ConfigError, setting
from backend.experiments import define
from backend.experiments.parallel import dp_model
from backend.checkpoint import checkpointer as ckpt
from backend.checkpoint import mesh_checks, mesh_run, mesh_state
from backend.checkpoint.mesh_checks import bench_rows
from backend.result import Check, Result, Schema, Shapes

STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "fsdp")
ON_THE_MESH = {"ddp": "ddp", "zero1": "zero1", "zero2": "zero2", "zero3": "zero3", "fsdp": "fsdp2"}  # mesh's dp_strategy
NAMES = {"d_model": "hidden", "checkpoint_every": "every", "checkpoint_save": "save", "dp_strategy": "strategy"}


@dataclasses.dataclass
class CheckpointConfig(Config):
    world_size: int = setting(2, min=2, max=8, help="data-parallel ranks n")
    hidden: int = setting(32, min=4, max=512, help="the tiny LLaMA's d_model")
    layers: int = setting(2, min=1, max=16, help="decoder blocks")
    batch: int = setting(4, min=1, max=64, help="8-token sequences in the global batch, split over the ranks")
    steps: int = setting(6, min=2, max=50, help="training steps (Adam)")
    lr: float = setting(0.01, min=0.0, max=1.0, help="Adam learning rate")
    seed: int = setting(0, min=0, max=2**31 - 1, help="weights and data")
    strategy: str = setting("zero3", choices=STRATEGIES, help="how the model and Adam's states are held and sharded over dp")
    every: int = setting(2, min=1, max=50, help="checkpoint interval (steps between saves)")
    kill_rank: int = setting(1, min=-1, max=7, help="rank killed by SIGKILL (-1: none)")
    kill_step: int = setting(3, min=0, max=49, help="step in which that rank is killed (after its backward)")
    max_restarts: int = setting(1, min=0, max=3, help="times all ranks may be restarted from the last checkpoint (0: the kill fails the run, which its page can resume)")
    save: str = setting("sync", choices=("sync", "async"), help="dcp.save blocks the step; dcp.async_save stages a copy and writes it in a thread")
    mtbf_s: float = setting(30.0, min=1.0, max=1e7, help="mean time between failures (s) for the interval trade-off")
    reshard_to: str = setting("same", choices=("same", "off") + STRATEGIES, help="after the run, the last checkpoint before its end loaded on another plan (same: this strategy on reshard_ranks) and training continued (off: none)")
    reshard_ranks: int = setting(1, min=1, max=8, help="ranks of that plan (at most world_size: the same processes, regrouped)")

    cost_drivers = ("batch", "hidden", "steps", "layers", "world_size")
    model = "tiny_llama"  # (what dp_model.mesh_plan and the result's shape read; not a setting)

    def check(self) -> None:
        """The run's plan and the continuation's, as the mesh checks them; a refusal names this experiment's setting."""
        if self.reshard_to != "off" and self.reshard_ranks > self.world_size:
            raise ConfigError("reshard_ranks", f"{self.reshard_ranks} is more than the run's world_size={self.world_size} "
                                               f"(allowed: 1 to {self.world_size})")
        validated(self.plan(), None)
        if self.reshard_to == "off":
            return
        if self.every >= self.steps:
            raise ConfigError("every", f"{self.every} leaves no checkpoint before the last step to continue from on "
                                       f"another plan (allowed with reshard_to={self.reshard_to}: 1 to {self.steps - 1})")
        validated(self.continued(), "reshard_ranks")

    def plan(self):
        """The run as parallel.mesh's plan: every rank data parallel, saving every `every` steps, the kill."""
        return dataclasses.replace(dp_model.mesh_plan(self, ON_THE_MESH[self.strategy]), checkpoint_every=self.every,
                                   kill_rank=self.kill_rank, kill_step=self.kill_step, checkpoint_save=self.save)

    def continued(self):
        """The plan that continues the last checkpoint before the end: reshard_ranks ranks of the `target` strategy."""
        return dataclasses.replace(dp_model.mesh_plan(self, ON_THE_MESH[self.target]), world_size=self.reshard_ranks)

    @property
    def target(self) -> str:
        """The strategy the checkpoint is continued with on reshard_ranks."""
        return self.strategy if self.reshard_to == "same" else self.reshard_to

    def estimate(self):
        """The mesh plan's (the uninterrupted run, the restarted ranks, the saves), with the continuation counted as the
        mesh counts a reshard: the steps after the last checkpoint before the end."""
        more = dict(reshard_tp=1, reshard_pp=1) if self.reshard_to != "off" else {}
        return dataclasses.replace(self.plan(), **more).estimate()


def validated(plan, field: str | None):
    """plan.validate(), its refusal named by this experiment's setting (`field`, or the one the mesh's setting maps to)."""
    try:
        return plan.validate()
    except ConfigError as err:
        message = str(err).split(": ", 1)[-1]
        for mesh_name, ours in NAMES.items():
            message = message.replace(mesh_name, ours)
        raise ConfigError(field or NAMES.get(err.field, err.field), message) from None


def run_rank(rank, world, config: CheckpointConfig, ctx):
    """This rank's mesh run with its checkpoints and the kill (parallel.mesh's run_rank), then the continuation."""
    from backend.experiments.parallel import mesh

    payload = mesh.run_rank(rank, world, config.plan(), ctx)
    if config.reshard_to != "off":
        payload["checkpoint"]["reshard"] = continue_on_fewer_ranks(rank, world, config, ctx)
    return payload


def continue_on_fewer_ranks(rank: int, world: int, config: CheckpointConfig, ctx) -> dict | None:
    """Resharding onto another world size: the same processes regrouped as `reshard_ranks` ranks (the others wait),
    which load the newest checkpoint saved before the run's last step under the `reshard_to` strategy (DCP reads each
    saved piece where it overlaps what a new rank holds) and train the remaining steps; then the whole group is formed
    again (the launcher gathers the payloads over it)."""
    from backend.parallel.mesh_train import train_rank

    n, out, root = config.reshard_ranks, None, ckpt.folder(ctx)
    stores = [root / f"regroup_{ctx.attempt}_{name}.store" for name in ("new", "all")]
    if rank == 0:
        for store in stores:  # left by an earlier attempt: their stale keys would be read as this one's
            store.unlink(missing_ok=True)
    mesh_run.regroup(rank, world, n, stores[0], ctx.timeout_s)
    if rank < n:
        out = mesh_run.continue_on(rank, n, config.continued(), [root, ckpt.parent_folder(ctx)], root,
                                   mesh_state.reference_shapes(config.plan()), ctx.attempt, train_rank)
    mesh_run.regroup(rank, n, world, stores[1], ctx.timeout_s)
    return out


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
    at = lambda k: float(expected_time_per_step(np.array([k]), step_s, save_s, restart_s, mtbf_s)[0])  # noqa: E731
    probes = sorted({max(1, k_young // 4), k_young, 4 * k_young})
    mc = [{"interval_steps": k, "closed_form_s": at(k), "monte_carlo_s": simulated_time_per_step(k, step_s, save_s, restart_s, mtbf_s, seed=k)}
          for k in probes]
    rows = [{"interval_steps": int(k), "time_per_step_s": float(c), "overhead_pct": 100 * (float(c) / step_s - 1),
             "lost_work_s_per_failure": float(k) * step_s / 2} for k, c in zip(ks, cost_k)]
    return {"rows": rows, "young_s": young_s, "young_steps": k_young, "best_steps": best,
            "young_vs_best": at(k_young) / at(best) - 1, "monte_carlo": mc,
            "mc_error": max(abs(m["monte_carlo_s"] / m["closed_form_s"] - 1) for m in mc)}


def interval_result(config: CheckpointConfig, first: dict) -> tuple[list[Check], dict, dict]:
    """The checkpoint interval's trade-off from the run's measured step, save and load times (interval_tradeoff; rank
    0's checkpoint payload `first`): the checks of the closed form against Monte Carlo and of Young's interval against
    the best, its metrics and tables. Nothing when the run took no two consecutive steps or saved nothing."""
    timeline = first["timeline"]
    steps = [b["t"] - a["t"] for a, b in zip(timeline, timeline[1:]) if a["event"] == b["event"] == "step"
             and b["step"] == a["step"] + 1]
    if not (steps and first["saves"]):
        return [], {}, {}
    step_s = float(np.median(steps))
    save_s = float(np.mean([s["seconds"] for s in first["saves"]]))
    trade = interval_tradeoff(step_s, save_s, first["load_s"] or save_s, config.mtbf_s)
    metrics = dict(step_s=step_s, young_interval_s=trade["young_s"], young_interval_steps=trade["young_steps"],
                   best_interval_steps=trade["best_steps"], young_overhead_above_best_pct=100 * trade["young_vs_best"])
    checks = [Check("Monte Carlo failures match the closed-form time per step", trade["mc_error"], 0.05,
                    reference="4,000 simulated segments per interval, exponential failure times",
                    detail="relative difference, worst of 3 intervals"),
              Check("Young's interval sqrt(2 x save x MTBF) costs within 5 % of the best interval",
                    trade["young_vs_best"], 0.05, reference="the exact expected time per step over 60 intervals",
                    detail=f"Young {trade['young_steps']} steps, best {trade['best_steps']} steps")]
    return checks, metrics, {"interval": trade["rows"], "monte_carlo": trade["monte_carlo"]}


def reshard_result(config: CheckpointConfig, payloads) -> tuple[list[Check], dict, dict]:
    """The continuation on reshard_ranks ranks against one float64 process (mesh_checks.reshard_result's checks)."""
    from backend.experiments.parallel._reference import reference_training
    from backend.parallel.tp import cut

    plan = config.plan()
    return mesh_checks.reshard_result(plan, payloads, reference_training(plan), cut, config.continued())


def notes(config: CheckpointConfig, metrics: dict, first: dict) -> list[str]:
    """What happened to the run: the kill and the restart, or the failed run it resumed."""
    if first["parent"]:
        return [f"Run {first['parent']} failed when rank {config.kill_rank} was killed by SIGKILL in step "
                f"{config.kill_step}; this run resumed it from its newest checkpoint ({first['resumed_from']}), "
                f"redoing {metrics.get('steps_redone')} step(s). The timeline holds both runs."]
    if config.kill_rank < 0:
        return ["No fault: the run saved its checkpoints."]
    return [f"Rank {config.kill_rank} was killed by SIGKILL in step {config.kill_step}; every rank was restarted and "
            f"resumed from the checkpoint after step {metrics.get('resumed_from_step')}, redoing "
            f"{metrics.get('steps_redone')} step(s)."]


MESH_TABLES = ("loss", "memory", "ranks", "checkpoint_timeline", "checkpoint_files", "checkpoint_bytes_per_rank",
               "checkpoint_share_per_rank")  # of parallel.mesh's result, the ones the page draws


def combine(config: CheckpointConfig, payloads) -> Result:
    """The mesh's result (its checks: the weights and losses against one float64 process, the bytes and memory per rank,
    each rank's file against its share, the kill bit for bit), with the continuation on fewer ranks, the interval
    trade-off and bench/checkpoint.py's figures."""
    from backend.experiments.parallel import mesh

    result = mesh.combine(config.plan(), payloads)
    first = payloads[0]["checkpoint"]
    files = first["files"]
    metrics = {**result.metrics, "model": "tiny_llama", "strategy": config.strategy, "world_size": config.world_size,
               "dcp_metadata_bytes": sum(f["bytes"] for f in files if f["file"] == ".metadata"),
               **({"parent_run": first["parent"]} if first["parent"] else {})}
    checks, tables = result.checks, {k: result.tables[k] for k in MESH_TABLES if k in result.tables}
    for more in (interval_result(config, first), reshard_result(config, payloads) if config.reshard_to != "off" else None):
        if more:
            checks += more[0]
            metrics.update(more[1])
            tables.update(more[2])
    measured = bench_rows()  # bench/checkpoint.py's figures as they stood when this run ran (None before the bench ran)
    if measured is not None:
        about, tables["bench"] = measured
        metrics.update({f"bench.{k}": v for k, v in about.items()})
    return Result(metrics=metrics, checks=checks, tables=tables, trace_events=result.trace_events,
                  notes=notes(config, metrics, first))


def _v1_the_mlp(result: dict) -> None:
    """Version 1 runs trained the Linear+tanh MLP (the retired MLP loop) and did not name their model."""
    result["metrics"].setdefault("model", "mlp")


KILLED = ("killed_rank", "killed_in_step", "resumed_from_step", "steps_redone")  # kill_rank >= 0
INTERVAL = ("step_s", "young_interval_s", "young_interval_steps", "best_interval_steps",
            "young_overhead_above_best_pct")  # when the run timed consecutive steps and saved at least once
RESHARD = ("reshard_plan", "reshard_from", "reshard_load_s")  # reshard_to != off
BENCH = ("bench.machine", "bench.when", "bench.load")  # bench/results/checkpoint.json present when the run ran
OWN = {"interval": ("interval_steps", "lost_work_s_per_failure", "overhead_pct", "time_per_step_s"),
       "monte_carlo": ("interval_steps", "closed_form_s", "monte_carlo_s"),
       "reshard_map": ("new rank", "saved rank", "key", "file", "from byte", "bytes"),
       "reshard_bytes": ("new rank", "saved rank", "bytes"),
       "bench": ("plan", "save", "blocking (s)", "min-max (s)", "load (s)", "step, saving (s)", "step, not (s)",
                 "bytes / model (B)", "top rank (B)")}
VERSION = dict(version=2, upgrades={1: _v1_the_mlp})
MLP = Schema(  # version 1: the MLP's own loop
    metrics=("model", "strategy", "world_size", "attempts", "checkpoint_tensor_bytes", "checkpoint_file_bytes", "save_s_mean",
             "load_s", "dcp_metadata_bytes", *KILLED, *INTERVAL, *RESHARD, *BENCH, "parent_run"),
    tables={"timeline": ("t", "t_s", "event", "step", "attempt", "seconds", "blocking", "load_seconds", "rank", "pid"),
            "files": ("file", "rank", "bytes", "tensor bytes"),
            "bytes_per_rank": ("rank", "weights", "Adam m, v", "Adam step", "random state", "step and losses",
                               "replicated, written here", "sharded bytes", "expected sharded bytes"),
            "loss": ("step", "loss"), **OWN},
    optional=(*KILLED, *INTERVAL, *RESHARD, "parent_run", "interval", "monte_carlo", "reshard_map", "reshard_bytes",
              *BENCH, "bench"), **VERSION)


def _llama():
    from backend.experiments.parallel import mesh

    s, always = mesh.RESULT, ("attempts", *MESH_TABLES)  # (checkpoints are always on here)
    return Schema(metrics=("model", "strategy", "world_size", "dcp_metadata_bytes", *s.metrics, *INTERVAL, *BENCH, "parent_run"),
                  tables={**{k: s.tables[k] for k in MESH_TABLES}, **OWN},
                  optional=(*(k for k in s.optional if k in s.metrics and k not in always), *INTERVAL, *BENCH, "parent_run",
                            *OWN), **VERSION)


RESULT = Shapes(by="model", shapes={"mlp": MLP, "tiny_llama": _llama()})

EXPERIMENT = define(__name__, CheckpointConfig, "Sharded DCP checkpoints of the tiny LLaMA, a rank killed by SIGKILL and "
                    "the run resumed bit for bit", rank_fn=run_rank, combine=combine, lanes=("compute", "collective", "comm"),
                    preload=("torch.distributed.fsdp", "torch.distributed.checkpoint"), schema=RESULT)
