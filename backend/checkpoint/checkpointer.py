"""Sharded checkpoints with torch.distributed.checkpoint (DCP): the mechanics, whatever state is saved.

    saver = Checkpointer(folder(ctx), every=2, rank=rank)  # the mesh's MeshHook (mesh_state.py) drives it

Each rank hands DCP its own pieces of global tensors at their offsets (pieces.py), so DCP reshards them onto any
other cut of the same tensors. A checkpoint is complete once `manifest.json` (every file's size and sha256) is written,
last: a folder without it, or whose files do not match it, or whose tensors have other shapes than the state's, is
refused by name. Checkpoints live only under the run's own folder in the data dir (or the unrecorded run's scratch
folder); a run that resumes a failed one reads the parent's folder, found from its own record in the store
(parent_folder). Each save and start goes on the run's timeline; kill_self is the fault a test or a run injects.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch.distributed as dist

from backend.checkpoint import pieces as dcp_pieces

CHECKPOINTS = "checkpoints"
MANIFEST = "manifest.json"
TIMELINE = "timeline.jsonl"
KEEP = 2  # complete checkpoints kept per run


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used: missing, corrupt, or saved from another model."""


def folder(ctx) -> Path:
    """The run's own checkpoint folder: <data dir>/runs/<id>/checkpoints, or the unrecorded run's scratch folder."""
    if ctx.run_id and ctx.store_root:
        return Path(ctx.store_root) / "runs" / ctx.run_id / CHECKPOINTS
    if ctx.scratch_dir:
        return Path(ctx.scratch_dir) / CHECKPOINTS
    raise CheckpointError("checkpoints need a run folder (a recorded run) or a scratch folder (an unrecorded one)")


@dataclass
class Checkpointer:
    """Save every `every` steps into root/step_<k>/, resume from the newest complete one. The state saved is a
    MeshState's: checkpoint_state() (its tensors, the next step under "loop.step") and load_checkpoint_state()."""
    root: Path
    every: int  # 0: never save (a run that only resumes, e.g. on another plan)
    rank: int
    attempt: int = 0
    source: Path | None = None  # resume from this checkpoint (saved on another plan) instead of root's newest
    parent: Path | None = None  # a failed run's checkpoint folder, resumed from while root holds none (parent_folder)
    asynchronous: bool = False  # DCP's async_save: stage a copy, write it in a thread over its own gloo group
    saves: list[dict] = field(default_factory=list)  # each save's step, blocking seconds and folder name
    load_seconds: float | None = None
    resumed_from: str | None = None
    start: int = 0  # the step the loaded checkpoint was saved after (0: none loaded)
    reads: list[dict] = field(default_factory=list)  # what this rank's load read from which saved file (read_map)
    held_bytes: int = 0  # tensor bytes of the state this rank loaded into
    _pending: tuple | None = None  # (future, path, record) of an async save still writing
    _group: object = None

    def __post_init__(self):
        if self.asynchronous:  # collective: every rank builds its Checkpointer at the same point
            self._group = dist.new_group(backend="gloo")

    def latest(self) -> Path | None:
        return newest([self.root]) or newest([self.parent])

    def after_step(self, step: int, state) -> None:
        """Log the step on the run's timeline (rank 0) and save when the interval says so."""
        self.finish()  # an async save started after the previous step has had this step to write
        if self.rank == 0:
            log_event(self.root, event="step", step=step, attempt=self.attempt)
        if self.every and (step + 1) % self.every == 0:
            self.save(step, state)

    def save(self, step: int, state) -> None:
        import torch.distributed.checkpoint as dcp

        path = self.root / f"step_{step + 1:05d}"
        self.finish()
        started = time.perf_counter()
        tensors, future = state.checkpoint_state(), None
        if self.asynchronous:
            future = dcp.async_save(tensors, checkpoint_id=str(path), process_group=self._group,
                                    async_stager=dcp_pieces.Stager(), planner=dcp_pieces.save_planner())
        else:
            dcp.save(tensors, checkpoint_id=str(path), planner=dcp_pieces.save_planner())
        self._pending = (future, path, {"step": step + 1, "seconds": time.perf_counter() - started, "path": path.name})
        if future is None:
            self.finish()

    def finish(self) -> None:
        """Wait for a save still writing, then make it complete: every rank's files in the manifest, the newest KEEP
        complete checkpoints kept (a long run must not fill the data dir). The blocking time is the save's: what the
        step paid (the staging, for an async save) is recorded when it was started."""
        if not self._pending:
            return
        future, path, record = self._pending
        self._pending = None
        if future:
            future.result()
        write_manifest(path, self.rank)
        self.saves.append(record)
        if self.rank == 0:
            for old in sorted(complete(self.root), key=_step_of)[:-KEEP]:
                shutil.rmtree(old)
            log_event(self.root, event="save", step=record["step"], seconds=record["seconds"], attempt=self.attempt,
                      blocking="staging" if self.asynchronous else "whole save")

    def resume(self, state) -> int:
        """Load the newest complete checkpoint into the state (in place); the next step to run."""
        import torch.distributed.checkpoint as dcp

        path = self.source or self.latest()
        if path is None:
            if self.rank == 0:
                log_event(self.root, event="start", step=0, attempt=self.attempt)
            return 0
        started = time.perf_counter()
        tensors = state.checkpoint_state()
        verify(path, tensors)
        planner = dcp_pieces.recording_planner()
        dcp.load(tensors, checkpoint_id=str(path), planner=planner)
        self.reads = dcp_pieces.read_map(planner.local_plan.items, planner.metadata, self.rank)
        self.held_bytes = sum(dcp_pieces.local_bytes(v) for v in tensors.values())
        state.load_checkpoint_state(tensors)
        self.load_seconds = time.perf_counter() - started
        self.resumed_from, self.start = path.name, _step_of(path)
        step = int(tensors["loop.step"].item())
        if self.rank == 0:
            log_event(self.root, event="start", step=step, attempt=self.attempt, load_seconds=self.load_seconds)
        return step


def parent_folder(ctx) -> Path | None:
    """The checkpoint folder of the failed run this run resumes: its record's parent, looked up in the store
    (JobRunner.resume checked it), never a path from a setting or a link. None for a run that resumes nothing."""
    if not (ctx.run_id and ctx.store_root):
        return None
    from backend.store import RunStore

    store = RunStore(ctx.store_root)
    me = store.get(ctx.run_id)
    if me is None or not me.parent:
        return None
    parent = store.get(me.parent)
    if parent is None or parent.experiment != me.experiment:
        raise CheckpointError(f"run {me.id} resumes {me.parent}, which is not a run of {me.experiment} in this store")
    return Path(ctx.store_root) / "runs" / parent.id / CHECKPOINTS


def resumable(store, run_id: str):
    """The record of a run that can be resumed: failed, with a complete checkpoint whose files match its manifest.
    Else CheckpointError saying why."""
    from backend.store import is_run_id

    rec = store.get(run_id) if is_run_id(run_id) else None
    allowed = "(allowed: the id of a failed run with a checkpoint)"
    if rec is None:
        raise CheckpointError(f"no run {run_id!r} in this store {allowed}")
    if rec.status != "failed":
        raise CheckpointError(f"run {rec.id} {rec.status}: only a failed run is resumed {allowed}")
    last = newest([Path(store.root) / "runs" / rec.id / CHECKPOINTS])
    if last is None:
        raise CheckpointError(f"run {rec.id} left no complete checkpoint to resume from {allowed}")
    verify_files(last)
    return rec


def _step_of(path: Path) -> int:
    return int(path.name.split("_")[1])


def complete(root: Path) -> list[Path]:
    """The complete checkpoints (with their manifest) under root; a symlinked folder is never read."""
    if not root.exists() or root.is_symlink():
        return []
    return [p for p in root.glob("step_*") if not p.is_symlink() and (p / MANIFEST).exists()]


def newest(roots: list[Path | None], before: int | None = None) -> Path | None:
    """The newest complete checkpoint under the roots (a run's own folder and the failed run it resumed), or with
    `before` the newest saved before that step (one a run can still continue from); None where there is none."""
    done = [p for root in roots if root for p in complete(root) if before is None or _step_of(p) < before]
    return max(done, key=_step_of, default=None)



def _entry(path: Path, rank: int) -> dict:
    """A file's line in the manifest: its size, sha256 and the rank that wrote it."""
    with open(path, "rb") as f:
        return {"bytes": path.stat().st_size, "sha256": hashlib.file_digest(f, "sha256").hexdigest(), "rank": rank}


def write_manifest(path: Path, rank: int) -> None:
    """Every rank hashes the files it wrote (DCP names them __<rank>_<i>.distcp); rank 0 writes the manifest last,
    so a folder with a manifest is a complete checkpoint."""
    mine = {f.name: _entry(f, rank) for f in path.glob(f"__{rank}_*.distcp")}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    if rank == 0:
        files = {k: v for d in every for k, v in d.items()}
        files[".metadata"] = _entry(path / ".metadata", 0)
        tmp = path / (MANIFEST + ".tmp")
        tmp.write_text(json.dumps({"files": files}, indent=1))
        tmp.replace(path / MANIFEST)
    dist.barrier()


def verify_files(path: Path) -> None:
    """Refuse a checkpoint whose manifest is unreadable or whose files are missing or differ from it (sha256)."""
    try:
        files = json.loads((path / MANIFEST).read_text())["files"]
    except (OSError, ValueError, KeyError) as err:
        raise CheckpointError(f"checkpoint {path.name}: its manifest is unreadable ({err})") from None
    for name, want in sorted(files.items()):
        f = path / name
        if not f.is_file() or f.is_symlink():
            raise CheckpointError(f"checkpoint {path.name} is corrupt: file {name} (rank {want['rank']}) is missing")
        if _entry(f, want["rank"]) != want:
            raise CheckpointError(f"checkpoint {path.name} is corrupt: file {name} (rank {want['rank']}) does not "
                                  f"match its sha256 in {MANIFEST}")


def verify(path: Path, expected: dict) -> None:
    """Refuse a checkpoint whose files differ from its manifest, or whose tensors are not this model's."""
    from torch.distributed.checkpoint import FileSystemReader

    verify_files(path)
    saved = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    for key, value in expected.items():
        size = tuple(value.size())
        if key not in saved:
            raise CheckpointError(f"checkpoint {path.name} is from another model or strategy: it has no {key!r} "
                                  f"(it holds {', '.join(sorted(saved)[:4])}, ...)")
        have = tuple(getattr(saved[key], "size", ()) or ())
        if have != size and key.startswith("loop."):
            raise CheckpointError(f"checkpoint {path.name} is from a run of another length: {key} has shape "
                                  f"{list(have)} there, {list(size)} here (allowed: the same steps)")
        if have != size:
            raise CheckpointError(f"checkpoint {path.name} is from another model: {key} has shape {list(have)} there, "
                                  f"{list(size)} here")


def files_per_rank(path: Path) -> list[dict]:
    """Each file of a checkpoint: its rank, bytes on disk, and the tensor bytes it holds (from DCP's metadata)."""
    payload: dict[str, int] = {}
    for piece in dcp_pieces.pieces(path):
        payload[piece["file"]] = payload.get(piece["file"], 0) + piece["bytes"]
    files = json.loads((path / MANIFEST).read_text())["files"]
    return [{"file": name, "rank": v["rank"], "bytes": v["bytes"], "tensor bytes": payload.get(name, 0)}
            for name, v in sorted(files.items())]


def log_event(root: Path, **event) -> None:
    """Append one event (a step done, a save, a kill, a resume) to the run's timeline, with the wall time."""
    root.mkdir(parents=True, exist_ok=True)
    with open(root / TIMELINE, "a") as f:
        f.write(json.dumps({"t": time.time(), **event}) + "\n")


def read_timeline(root: Path) -> list[dict]:
    path = root / TIMELINE
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def kill_self(root: Path, rank: int, step: int) -> None:
    """The fault: this rank ends by SIGKILL (no exception, no clean-up), as a lost node does."""
    log_event(root, event="kill", rank=rank, step=step, pid=os.getpid())
    os.kill(os.getpid(), signal.SIGKILL)


