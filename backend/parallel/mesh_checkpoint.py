"""parallel.mesh's checkpoint settings (checkpoint_every, kill_rank, kill_step, reshard_tp, reshard_pp): the mesh run
saves DCP checkpoints of the one model's tensors (backend/parallel/checkpoint.MeshState), a rank is killed by SIGKILL
mid-step and the spawner restarts every rank from the last checkpoint (max_restarts), and the last checkpoint before
the end is continued on another tp x pp mesh in the same processes. What it checks: the final weights bit for bit
against the same plan run without checkpoints or the kill (attempt 0, before the checkpointed run), the killed process
gone, and the continuation on the other mesh against one float64 process, with DCP's reads as the resharding map."""
from __future__ import annotations

import dataclasses

import numpy as np

from backend.config import ConfigError
from backend.parallel import checkpoint as ckpt
from backend.result import Check

BASELINE = "uninterrupted_rank{}.npz"


def check_settings(config) -> None:
    """The checkpoint settings against each other and the run (after the mesh's own checks). Each refusal says which
    value fits with the other settings as they are."""
    fits = "allowed with the other settings as they are:"
    if config.kill_rank >= config.world_size:
        raise ConfigError("kill_rank", f"{config.kill_rank} is not a rank of world_size={config.world_size} "
                                       f"({fits} kill_rank = {config.world_size - 1})")
    if config.kill_rank >= 0 and not config.checkpoint_every:
        raise ConfigError("kill_rank", f"{config.kill_rank} with checkpoint_every = 0: nothing to restart from "
                                       f"({fits} kill_rank = -1)")
    if config.kill_rank >= 0 and config.kill_step >= config.steps:
        raise ConfigError("kill_step", f"{config.kill_step} is past the last step ({fits} kill_step = {config.steps - 1})")
    if config.checkpoint_every and config.dp_strategy == "fsdp2":
        raise ConfigError("checkpoint_every", f"{config.checkpoint_every} with dp_strategy fsdp2: the mesh's checkpoint "
                                              f"saves our strategies' flat shards, not FSDP2's DTensors ({fits} "
                                              "checkpoint_every = 0)")
    if config.checkpoint_every and config.precision == "fp16_mixed":
        raise ConfigError("checkpoint_every", f"{config.checkpoint_every} with precision fp16_mixed: the loss scale's "
                                              f"state is not saved, so a resume would not be bit for bit ({fits} "
                                              "checkpoint_every = 0)")
    if config.checkpoint_every > config.steps:
        raise ConfigError("checkpoint_every", f"{config.checkpoint_every} saves nothing in {config.steps} steps "
                                              f"({fits} checkpoint_every = {config.steps})")
    if bool(config.reshard_tp) != bool(config.reshard_pp):
        unset, other = ("reshard_pp", "reshard_tp") if config.reshard_tp else ("reshard_tp", "reshard_pp")
        raise ConfigError(unset, f"0 with {other} = {getattr(config, other)}: the new mesh needs both tp and pp "
                                 f"({fits} {other} = 0)")
    if not config.reshard_tp:
        return
    if not 1 <= config.checkpoint_every < config.steps:
        fix = f"checkpoint_every = {config.steps - 1}" if config.steps > 1 else "reshard_tp = 0"
        raise ConfigError("checkpoint_every", f"{config.checkpoint_every} leaves no checkpoint before the last step to "
                                              f"continue on tp {config.reshard_tp} x pp {config.reshard_pp} ({fits} {fix})")
    try:
        resharded(config).validate()
    except ConfigError as err:
        raise ConfigError("reshard_tp", f"tp {config.reshard_tp} x pp {config.reshard_pp} cannot continue this run "
                                        f"({fits} reshard_tp = 0): that mesh refuses it: {err}") from None


def resharded(config):
    """The run continued on tp = reshard_tp, pp = reshard_pp (dp takes the rest of the ranks), checkpointing nothing."""
    return dataclasses.replace(config, tp=config.reshard_tp, pp=config.reshard_pp, checkpoint_every=0, kill_rank=-1,
                               reshard_tp=0, reshard_pp=0, compare_schedules=False, recompute="none", preset="none")


def train_with_checkpoints(rank: int, world: int, config, ctx, train_rank) -> dict:
    """This rank's run with its checkpoints (and the kill): the payload of train_rank plus what the result checks."""
    root = ckpt.folder(ctx)
    shapes = ckpt.reference_shapes(config)
    killing = config.kill_rank >= 0
    if killing and ctx.attempt == 0:  # the same plan without checkpoints or the kill: what the resumed run must equal
        plain = train_rank(rank, world, config)
        root.mkdir(parents=True, exist_ok=True)
        np.savez(root / BASELINE.format(rank), **plain["params"])

    def fault(step):
        if ctx.attempt == 0 and rank == config.kill_rank and step == config.kill_step:
            ckpt.kill_self(root, rank, step)
    hook = ckpt.MeshHook(ckpt.Checkpointer(root, config.checkpoint_every, rank, attempt=ctx.attempt),
                         fault if killing else None, shapes)
    payload = train_rank(rank, world, config, ctx.progress, hook)
    saver = hook.saver
    out = {"attempt": ctx.attempt, "start": resumed_step(saver), "resumed_from": saver.resumed_from,
           "load_s": saver.load_seconds, "saves": [dataclasses.asdict(s) for s in saver.saves]}
    if killing:
        with np.load(root / BASELINE.format(rank)) as base:
            out["bitwise"] = all(np.array_equal(v.view(np.uint64), base[k].view(np.uint64)) for k, v in payload["params"].items())
            out["baseline_err"] = max(float(np.abs(v - base[k]).max()) for k, v in payload["params"].items())
    last = saver.latest()
    if rank == 0:
        out.update(timeline=ckpt.read_timeline(root), files=ckpt.files_per_rank(last) if last else [],
                   checkpoint=last.name if last else None)
    if config.reshard_tp:
        out["reshard"] = continue_on_another_mesh(rank, world, config, root, shapes, ctx.attempt, train_rank)
    payload["checkpoint"] = out
    return payload


def resumed_step(saver) -> int:
    """The step the last attempt started from (0 when it resumed nothing): the saved step of the checkpoint it loaded."""
    if not saver.resumed_from:
        return 0
    return int(saver.resumed_from.split("_")[1])


def continue_on_another_mesh(rank: int, world: int, config, root, shapes, attempt: int, train_rank) -> dict:
    """The newest checkpoint before the last step, loaded on tp = reshard_tp x pp = reshard_pp by the same processes
    (DCP reads each saved piece where it overlaps what a new rank holds) and trained to the end."""
    source = ckpt.newest_before([root], config.steps)
    hook = ckpt.MeshHook(ckpt.Checkpointer(root / "resharded", 0, rank, attempt=attempt, source=source), None, shapes)
    out = train_rank(rank, world, resharded(config), None, hook)
    return {**{k: out[k] for k in ("params", "sources", "losses", "last_stage", "coords")}, "from": source.name,
            "reads": hook.saver.reads, "held": hook.saver.held_bytes, "load_s": hook.saver.load_seconds}


def checks_and_tables(config, payloads, ref, cut) -> tuple[list[Check], dict, dict]:
    """The checkpoint checks, metrics and tables of a mesh run with checkpoint_every > 0."""
    from backend.store import pid_alive

    first = payloads[0]["checkpoint"]
    timeline, checks, metrics = first["timeline"], [], {"attempts": first["attempt"] + 1, "checkpoint": first["checkpoint"]}
    files = first["files"]
    metrics.update(checkpoint_tensor_bytes=sum(f["tensor bytes"] for f in files),
                   checkpoint_file_bytes=sum(f["bytes"] for f in files),
                   save_s_mean=float(np.mean([s["seconds"] for s in first["saves"]])) if first["saves"] else None)
    if files:
        model = 3 * 8 * sum(v.numel() for v in ref["state"].values()) + 8 + 8 + 8 * config.steps
        checks.append(Check("tensor bytes in the last checkpoint equal the model's state exactly (each piece written once)",
                            abs(metrics["checkpoint_tensor_bytes"] - model), 0,
                            reference="the one-process model's state_dict: weights, Adam m and v (3 x 8 B a parameter), "
                                      "Adam's step and the loop's step (int64), the losses (8 B a step)",
                            detail=f"{metrics['checkpoint_tensor_bytes']:,} B stored in {len(files)} files, {model:,} B counted"))
    if config.kill_rank >= 0:
        kills = [e for e in timeline if e["event"] == "kill"]
        bitwise = all(p["checkpoint"]["bitwise"] for p in payloads)
        err = max(p["checkpoint"]["baseline_err"] for p in payloads)
        checks.append(Check("final parameters equal the uninterrupted run's bit for bit", 0.0 if bitwise else max(err, 1e-300), 0,
                            reference="the same plan trained without checkpoints or the kill, in the same processes "
                                      "(attempt 0, first)", detail="bits compared as uint64 on every rank"))
        gone = bool(kills) and not pid_alive(kills[0]["pid"])
        checks.append(Check("the killed rank died by SIGKILL, its process is gone, and every rank restarted",
                            0 if gone and first["attempt"] == 1 else 1, 0,
                            reference="timeline: a kill (its pid no longer alive), then attempt 1 from the last checkpoint"))
        metrics.update(killed_rank=config.kill_rank, killed_in_step=config.kill_step, resumed_from_step=first["start"],
                       steps_redone=config.kill_step - first["start"], load_s=first["load_s"])
    tables = {"checkpoint_timeline": [{**e, "t_s": e["t"] - timeline[0]["t"]} for e in timeline] if timeline else [],
              "checkpoint_files": files}
    if config.reshard_tp:
        more_checks, more_metrics, more_tables = reshard_result(config, payloads, ref, cut)
        checks += more_checks
        metrics.update(more_metrics)
        tables.update(more_tables)
    return checks, metrics, tables


def mesh_label(config) -> str:
    """tp x pp x dp, and cp and ep where they are more than 1."""
    return " x ".join(f"{d} {getattr(config, d)}" for d in ("tp", "pp", "dp", "cp", "ep") if d in ("tp", "pp", "dp") or getattr(config, d) > 1)


def reshard_result(config, payloads, ref, cut) -> tuple[list[Check], dict, dict]:
    """The continuation on the other mesh against one process; DCP's reads as the resharding map."""
    new = [p["checkpoint"]["reshard"] for p in payloads]
    param_err = max(float(np.abs(v - cut(ref["state"], n["sources"])[k].numpy()).max()) for n in new for k, v in n["params"].items())
    last = next(n for n in new if n["last_stage"])
    loss_err = max(abs(a - b) for a, b in zip(last["losses"], ref["losses"]))
    read = {i: sum(r["bytes"] for r in n["reads"]) for i, n in enumerate(new)}
    cover_err = sum(abs(read[i] - n["held"]) for i, n in enumerate(new))
    plan = f"{mesh_label(config)} -> {mesh_label(resharded(config))}"
    checks = [
        Check(f"resharded ({plan}): final parameters equal one process", param_err, 1e-9,
              reference="TinyDecoder, float64, torch.optim.Adam, one process, all the steps", detail="max |difference|"),
        Check("resharded: every step's loss equals one process", loss_err, 1e-9, reference="one process"),
        Check("resharded: each new rank's reads add up to the tensor bytes it holds", cover_err, 0,
              reference="the pieces of the model's tensors (and Adam's m, v) each new rank holds at its tp shard, "
                        "pp layers and ZeRO cut", detail=", ".join(f"rank {i}: {b:,} B read" for i, b in read.items())),
    ]
    metrics = {"reshard_plan": plan, "reshard_from": new[0]["from"], "reshard_load_s": max(n["load_s"] for n in new)}
    return checks, metrics, ckpt.reshard_tables([n["reads"] for n in new])
