"""The mesh's runs with checkpoints: its checkpoint settings, a rank killed and every rank restarted, a failed run
resumed from the store, and the last checkpoint before the end continued on another mesh or on fewer ranks.

    payload["checkpoint"] = train_with_checkpoints(rank, world, config, ctx, train_rank)  # parallel.mesh's run_rank

parallel.mesh's settings (checkpoint_every, checkpoint_save, kill_rank, kill_step, reshard_*) save every k steps
(dcp.async_save with checkpoint_save = async), kill a rank by SIGKILL mid-step for the spawner (or torchrun) to restart
every rank from the last checkpoint, and continue the last checkpoint before the end on another mesh in the same
processes (regroup forms a smaller group of them, then the whole one again)."""
from __future__ import annotations

import dataclasses
import datetime
import shutil
import time

import numpy as np

from backend.checkpoint import checkpointer as ckpt
from backend.checkpoint.mesh_state import MeshHook, reference_shapes
from backend.checkpoint.pieces import pieces
from backend.config import ConfigError

BASELINE = "uninterrupted_rank{}.npz"
DONE = "old_group_done"  # the key an idle rank waits for before it joins a regroup (regroup)
TRIES = 3  # rendezvous trials of a regroup (join)


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
        raise ConfigError("kill_step", f"{config.kill_step} is past the last step "
                                       f"({fits} kill_step = {config.steps - 1})")
    if config.checkpoint_every > config.steps:
        raise ConfigError("checkpoint_every", f"{config.checkpoint_every} saves nothing in {config.steps} steps "
                                              f"({fits} checkpoint_every = {config.steps})")
    if config.checkpoint_save == "async" and not config.checkpoint_every:
        raise ConfigError("checkpoint_save", f"async with checkpoint_every = 0: nothing is saved "
                                             f"({fits} checkpoint_save = sync)")
    for name, off in (("reshard_strategy", "same"), ("reshard_cp", 0), ("reshard_ep", 0)):
        if getattr(config, name) != off and not config.reshard_tp:
            raise ConfigError(name, f"{getattr(config, name)} with reshard_tp = 0: no continuation to run it "
                                    f"({fits} {name} = {off})")
    if bool(config.reshard_tp) != bool(config.reshard_pp):
        unset, other = ("reshard_pp", "reshard_tp") if config.reshard_tp else ("reshard_tp", "reshard_pp")
        raise ConfigError(unset, f"0 with {other} = {getattr(config, other)}: the new mesh needs both tp and pp "
                                 f"({fits} {other} = 0)")
    if not config.reshard_tp:
        return
    if config.precision != "fp64":
        raise ConfigError("reshard_tp", f"{config.reshard_tp} with precision {config.precision}: the continuation is "
                                        f"checked against one float64 process within 1e-9 ({fits} reshard_tp = 0, or "
                                        f"precision = fp64)")
    if not 1 <= config.checkpoint_every < config.steps:
        fix = f"checkpoint_every = {config.steps - 1}" if config.steps > 1 else "reshard_tp = 0"
        raise ConfigError("checkpoint_every", f"{config.checkpoint_every} leaves no checkpoint before the last step "
                                              f"to continue on tp {config.reshard_tp} x pp {config.reshard_pp} "
                                              f"({fits} {fix})")
    new = resharded(config)
    try:
        new.validate()
    except ConfigError as err:  # named by the reshard setting of the dimension the new mesh refuses (tp otherwise)
        field = {"cp": "reshard_cp", "ep": "reshard_ep", "experts": "reshard_ep", "pp": "reshard_pp",
                 "dp_strategy": "reshard_strategy"}.get(err.field, "reshard_tp")
        fix = {"reshard_strategy": "reshard_strategy = same", "reshard_cp": "reshard_cp = 0, this run's cp",
               "reshard_ep": "reshard_ep = 0, this run's ep"}.get(field, "reshard_tp = reshard_pp = 0, no continuation")
        raise ConfigError(field, f"{getattr(config, field)}: {mesh_label(new)} cannot continue this run "
                                 f"({fits} {fix}): that mesh refuses it: {err}") from None


def resharded(config):
    """The run continued on tp = reshard_tp, pp = reshard_pp, cp = reshard_cp and ep = reshard_ep (0: the run's; dp
    takes the rest of the ranks) with the dp strategy reshard_strategy (same: the run's), checkpointing nothing."""
    strategy = config.dp_strategy if config.reshard_strategy == "same" else config.reshard_strategy
    return dataclasses.replace(config, tp=config.reshard_tp, pp=config.reshard_pp, cp=config.reshard_cp or config.cp,
                               ep=config.reshard_ep or config.ep, dp_strategy=strategy, checkpoint_every=0,
                               kill_rank=-1, reshard_tp=0, reshard_pp=0, reshard_cp=0, reshard_ep=0,
                               reshard_strategy="same", checkpoint_save="sync", compare_schedules=False,
                               recompute="none", preset="none")


def train_with_checkpoints(rank: int, world: int, config, ctx, train_rank) -> dict:
    """This rank's run with its checkpoints (and the kill): the payload of train_rank plus what the result checks."""
    root, parent = ckpt.folder(ctx), ckpt.parent_folder(ctx)
    shapes = reference_shapes(config)
    killing = config.kill_rank >= 0
    attempt = inherit(rank, root, parent) + ctx.attempt
    if killing and attempt == 0:  # the same plan without checkpoints or the kill: what the resumed run must equal
        plain = train_rank(rank, world, config)
        root.mkdir(parents=True, exist_ok=True)
        np.savez(root / BASELINE.format(rank), **plain["params"])

    def fault(step):
        if attempt == 0 and rank == config.kill_rank and step == config.kill_step:
            ckpt.kill_self(root, rank, step)
    saver = ckpt.Checkpointer(root, config.checkpoint_every, rank, attempt=attempt,
                              asynchronous=config.checkpoint_save == "async", parent=parent)
    hook = MeshHook(saver, fault if killing else None, shapes)
    payload = train_rank(rank, world, config, ctx.progress, hook)
    out = {"attempt": attempt, "start": saver.start, "resumed_from": saver.resumed_from,
           "load_s": saver.load_seconds, "saves": saver.saves,
           "held": hook.state.held_bytes(), "parent": parent.parent.name if parent else None}
    if killing:
        with np.load(root / BASELINE.format(rank)) as base:
            params = payload["params"].items()
            out["bitwise"] = all(np.array_equal(v.view(np.uint64), base[k].view(np.uint64)) for k, v in params)
            out["baseline_err"] = max(float(np.abs(v - base[k]).max()) for k, v in params)
    last = saver.latest()
    if rank == 0:
        out.update(timeline=ckpt.read_timeline(root), files=ckpt.files_per_rank(last) if last else [],
                   pieces=pieces(last) if last else [], checkpoint=last.name if last else None)
    if config.reshard_tp:
        out["reshard"] = continue_on_another_mesh(rank, world, config, root, shapes, ctx.attempt, train_rank)
    payload["checkpoint"] = out
    return payload


def inherit(rank: int, root, parent) -> int:
    """A run resuming a failed one (`parent`: its checkpoint folder, from the store): the parent's timeline (rank 0) and
    this rank's uninterrupted baseline copied into this run's folder, so the history and the bit-for-bit check go on;
    the attempt this run starts at, numbered on from the parent's (0 for a run that resumes nothing)."""
    if not parent:
        return 0
    root.mkdir(parents=True, exist_ok=True)
    for name in ((ckpt.TIMELINE,) if rank == 0 else ()) + (BASELINE.format(rank),):
        if (parent / name).exists() and not (root / name).exists():
            shutil.copy(parent / name, root / name)
    return 1 + max((e.get("attempt", 0) for e in ckpt.read_timeline(parent)), default=0)


def continue_on_another_mesh(rank: int, world: int, config, root, shapes, attempt: int, train_rank) -> dict:
    """The newest checkpoint before the last step, loaded on tp = reshard_tp x pp = reshard_pp by the same processes
    (DCP reads each saved piece where it overlaps what a new rank holds) and trained to the end."""
    return continue_on(rank, world, resharded(config), [root], root, shapes, attempt, train_rank)


def continue_on(rank: int, world: int, new, roots: list, root, shapes, attempt: int, train_rank) -> dict:
    """The newest checkpoint under `roots` saved before the last step, loaded by this rank of the `new` plan (`world`
    ranks) and trained to the end: its payload's parameters, sources and losses, and DCP's reads."""
    source = ckpt.newest(roots, before=new.steps)
    if source is None:
        names = ", ".join(r.name for r in roots if r)
        raise ckpt.CheckpointError(f"no complete checkpoint before step {new.steps} in {names}")
    hook = MeshHook(ckpt.Checkpointer(root / "resharded", 0, rank, attempt=attempt, source=source), None, shapes)
    out = train_rank(rank, world, new, None, hook)
    return {**{k: out[k] for k in ("params", "sources", "losses", "last_stage", "coords")}, "from": source.name,
            "reads": hook.saver.reads, "held": hook.saver.held_bytes, "load_s": hook.saver.load_seconds}


def mesh_label(config) -> str:
    """tp x pp x dp, and cp and ep where they are more than 1; the dp strategy where dp > 1."""
    dims = " x ".join(f"{d} {getattr(config, d)}" for d in ("tp", "pp", "dp", "cp", "ep")
                      if d in ("tp", "pp", "dp") or getattr(config, d) > 1)
    return dims + (f" {config.dp_strategy}" if config.dp > 1 else "")




def regroup(rank: int, old: int, new: int, store, timeout_s: float, wait_s: float | None = None) -> None:
    """Replace this process's default group of `old` ranks by one of the first `new` ranks, over a fresh file store
    in the run's folder; ranks past `new` are left without a group. Every rank of both groups calls it. A rank outside
    the old group (idle while it worked) first waits for the old group (wait_for_old_group), so that all ranks enter
    gloo's rendezvous within moments of each other. A rendezvous that fails on any rank is tried again by all of
    them, up to TRIES times (join)."""
    import torch.distributed as dist

    if rank < old:
        dist.barrier()  # every member is here before the group is taken down (and before the store is opened)
        dist.destroy_process_group()
    if rank >= new:
        return
    joined = dist.FileStore(str(store), new)
    if rank == 0 and new > old:
        joined.set(DONE, str(time.time()))
    elif rank >= old:
        wait_for_old_group(joined, wait_s or timeout_s)
    join(rank, new, joined, timeout_s)


def wait_for_old_group(store, wait_s: float) -> None:
    """An idle rank's wait, on the store's file, until the old group's rank 0 has put DONE there (up to wait_s: the
    others' work, e.g. a continued training). Entering gloo's rendezvous at once instead, it would sit there for all
    that time, a listening socket open, bounded by the group's timeout: once the others' work outlasts it, the idle
    rank fails and the late peer's connectFullMesh finds it gone."""
    store.set_timeout(datetime.timedelta(seconds=wait_s))
    store.wait([DONE])


def join(rank: int, world: int, store, timeout_s: float) -> None:
    """Form the default gloo group of `world` ranks over `store`, tried until every rank has formed it and summed a
    1 over it. On the busy test machine gloo's rendezvous has failed, rarely, in the regroup back to the whole group
    ("connectFullMesh failed: Connection closed by peer"; the cause is not known). Each rank puts its verdict in the
    file store (which needs no sockets); if any rank failed, all leave the trial's group and form a fresh one under the
    next trial's keys. After TRIES failed trials the last error is raised."""
    import sys

    import torch
    import torch.distributed as dist

    store.set_timeout(datetime.timedelta(seconds=timeout_s))  # (the verdicts' wait)
    for trial in range(TRIES):
        error = ""
        try:
            dist.init_process_group("gloo", store=dist.PrefixStore(f"trial_{trial}", store), rank=rank,
                                    world_size=world, timeout=datetime.timedelta(seconds=timeout_s))
            ones = torch.ones(1)
            dist.all_reduce(ones)
            if ones.item() != world:
                error = f"the check all-reduce summed {ones.item():g}, not {world}"
        except RuntimeError as err:
            error = f"{type(err).__name__}: {err}"
        store.set(f"verdict_{trial}_{rank}", error or "ok")
        verdicts = [f"verdict_{trial}_{r}" for r in range(world)]
        store.wait(verdicts)
        failed = [v for v in store.multi_get(verdicts) if v != b"ok"]
        if not failed:
            return
        print(f"regroup: trial {trial} of {world} ranks failed on rank {rank}: {error or 'ok here'}; "
              f"{len(failed)} rank(s) failed", file=sys.stderr, flush=True)
        leave_group()
    raise RuntimeError(f"regroup of {world} ranks: all {TRIES} rendezvous trials failed; last: {failed[0].decode()}")


def leave_group() -> None:
    """Leave a failed trial's group as destroy_process_group leaves a process: no default group, and torch's group
    counter at 0, so the next trial's group has the same name (the store key prefix) on every rank even where the
    failed init had counted a group it never made."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    if dist.is_initialized():
        dist.destroy_process_group()
    distributed_c10d._world.group_count = 0
