"""The mesh's checkpoints: its state as DCP pieces, its settings, its run with them, and what the result checks.

    hook = MeshHook(Checkpointer(folder(ctx), every=2, rank=rank), fault, reference_shapes(config))
    train_rank(rank, world, config, progress, hook)  # mesh_train calls it: resume, fault mid-step, save after a step

MeshState hands checkpoint.py's Checkpointer each rank's pieces of the one model's tensors at their global offsets,
whatever its tp shard, pp stage and dp cut (any dp strategy, FSDP2 too, any precision), so a checkpoint loads onto
another tp x pp x dp x cp x ep mesh, dp strategy or world size of the same model. parallel.mesh's settings
(checkpoint_every, checkpoint_save, kill_rank, kill_step, reshard_*) save every k steps (dcp.async_save with
checkpoint_save = async), kill a rank by SIGKILL mid-step for the spawner (or torchrun) to restart every rank from the
last checkpoint, and continue the last checkpoint before the end on another mesh in the same processes. What it
checks: each rank's file against its share of the model, the final weights bit for bit against the same plan run
without checkpoints or the kill (attempt 0, first), the killed process gone, and the continuation against one
float64 process, with DCP's reads as the resharding map."""
from __future__ import annotations

import dataclasses
import shutil
import types
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from backend.config import ConfigError
from backend.parallel import checkpoint as ckpt
from backend.parallel.precision import PRECISIONS
from backend.result import Check

BASELINE = "uninterrupted_rank{}.npz"


def rectangles(shape, x: int, y: int) -> list[tuple[tuple, tuple]]:
    """The elements [x, y) of a row-major tensor of `shape` (1-D or 2-D) as rectangles (offsets, sizes): a range of a
    1-D tensor, or a partial first row, whole rows and a partial last row."""
    if x >= y:
        return []
    if len(shape) == 1:
        return [((x,), (y - x,))]
    if len(shape) != 2:
        raise ckpt.CheckpointError(f"a {len(shape)}-D parameter: only 1-D and 2-D ones are cut into rectangles")
    cols = shape[1]
    (r0, c0), (r1, c1) = divmod(x, cols), divmod(y, cols)
    if r0 == r1:
        return [((r0, c0), (1, c1 - c0))]
    out = []
    if c0:
        out.append(((r0, c0), (1, cols - c0)))
        r0 += 1
    if r1 > r0:
        out.append(((r0, 0), (r1 - r0, cols)))
    if c1:
        out.append(((r1, 0), (1, c1)))
    return out


def source_pieces(p: torch.nn.Parameter, shapes: dict) -> list[tuple[str, int | None, int, int, int]]:
    """A rank's parameter as the reference pieces it holds (parallelize's `source`: a dim and the (name, slice) pieces
    concatenated along it): (reference name, dim, start in the reference along dim, start here along dim, length)."""
    dim, parts = p.source
    if dim is None:
        (ref, _), = parts
        return [(ref, None, 0, 0, 0)]
    out, here = [], 0
    for ref, s in parts:
        start, stop, _ = s.indices(shapes[ref][dim])
        out.append((ref, dim, start, here, stop - start))
        here += stop - start
    return out


def global_rectangles(p, shapes: dict, offsets, sizes):
    """A rectangle of a rank's parameter (offsets, sizes in its own coordinates) in the reference tensors it comes
    from: (reference name, global offsets, the narrow (dim, start, length) of the rectangle or None for all of it,
    the source piece)."""
    out = []
    for ref, dim, start, here, length in source_pieces(p, shapes):
        if dim is None:
            out.append((ref, tuple(offsets), None, (ref, dim, start, length)))
            continue
        lo, hi = max(offsets[dim], here), min(offsets[dim] + sizes[dim], here + length)
        if lo < hi:
            glob = list(offsets)
            glob[dim] = start + lo - here
            out.append((ref, tuple(glob), (dim, lo - offsets[dim], hi - lo), (ref, dim, start, length)))
    return out


class MeshState:
    """The mesh run's state on one rank, as Checkpointer saves and loads it, keyed by the one model's
    parameter names: each reference tensor (and Adam's m and v of it) is a Pieces of the rectangles this rank holds at
    their global offsets, whatever its tp shard (parallelize's sources), pp stage (which layers) and dp cut: the ZeRO
    cut of its flat vector, or FSDP2's dim-0 rows of each DTensor (the offset DTensor itself gives). So a checkpoint of
    tp 2 x pp 2 loads on tp 1 x pp 4, FSDP2's on dp 2 or under ZeRO-1, and one of another model (another shape, or a
    layer more) is refused by name. In mixed precision the weights saved are the master copy (Adam's m, v beside it).
    A piece held by several ranks is written once: by the lowest tp rank holding it (a replicated norm; KV heads shared
    over tp), and among identical dp, cp or ep replicas by the lowest rank (DCP's deduplication). Adam's step, the
    reported losses (the last stage's) and fp16's loss scaler (S, its clean-step count, each step's S and skips) are
    saved beside them."""

    def __init__(self, sync, model: torch.nn.Module, steps: int, shapes: dict, tp_group=None, loss_scale=None):
        self.sync, self.model = sync, model
        self.fsdp = getattr(sync, "strategy", None) == "fsdp2"
        self.last = any(getattr(c, "head", None) is not None for c in model.values())
        self.losses = torch.zeros(steps, dtype=torch.float64)
        self.adam_step, self.step = torch.tensor(0), torch.tensor(0)  # Adam's, and the next step to run
        self.scaler = loss_scale if loss_scale is not None and getattr(loss_scale, "scaler", None) else None
        if self.scaler:  # fp16: S and its clean steps, each step's S and whether it was skipped
            self.scaler_state = torch.zeros(2, dtype=torch.float64)
            self.scales, self.skipped = torch.zeros(steps, dtype=torch.float64), torch.zeros(steps, dtype=torch.int64)
        self.params = self._sourced()
        self.tensors = self._pieces(shapes, tp_group)

    def _sourced(self) -> list:
        """This rank's parameters in order, each with its source (FSDP2's from before it swapped the parameters for
        DTensors, which lose it)."""
        if self.fsdp:
            return [types.SimpleNamespace(source=a["source"]) for a in self.sync.attrs.values()]
        return list(self.model.parameters())

    def _adams(self) -> list:
        """The Adam objects whose step counts this rank's updates: one (ours), or one per DTensor (FSDP2's)."""
        return [adam for adam, _, _ in self.sync.adams] if self.fsdp else [self.sync.adam]

    def _pieces(self, shapes: dict, tp_group) -> dict[str, ckpt.Pieces]:
        writes, out = self._tp_writer(shapes, tp_group), {}
        for p, held, offsets, sizes in (self._fsdp_held() if self.fsdp else self._flat_held()):
            for ref, glob, narrow, piece in global_rectangles(p, shapes, offsets, sizes):
                for kind, view in held.items():
                    view = view.narrow(*narrow) if narrow else view
                    key = f"model.{ref}" if kind == "param" else f"optim.{ref}.{kind}"
                    out.setdefault(key, ckpt.Pieces(shapes[ref], view.dtype)).add(glob, view, writes[piece])
        return out

    def _flat_held(self):
        """(parameter, {kind: view}, offsets, sizes) of each rectangle of a parameter in this rank's ZeRO cut [lo, hi)
        of the flat (master) vector and of Adam's m and v (the whole vector unless ZeRO), views into them."""
        s = self.sync
        total = sum(p.numel() for p in self.params)
        lo = s.dp.index * s.owned.numel() if s.zero else 0
        hi = min(lo + s.owned.numel(), total)
        at = 0
        for p in self.params:
            a, b = at, at + p.numel()
            at = b
            cols = p.shape[1] if p.dim() == 2 else 1
            stride = (cols, 1) if p.dim() == 2 else (1,)
            for offsets, sizes in rectangles(tuple(p.shape), max(a, lo) - a, min(b, hi) - a):
                start = a - lo + offsets[0] * cols + (offsets[1] if p.dim() == 2 else 0)
                yield p, {kind: flat.as_strided(sizes, stride, flat.storage_offset() + start)
                          for kind, flat in (("param", s.owned), ("exp_avg", s.m), ("exp_avg_sq", s.v))}, offsets, sizes

    def _fsdp_held(self):
        """The same for FSDP2: each DTensor's local rows (and Adam's m, v of them) at the offset DTensor computes for
        this rank (torch.chunk's rows of dim 0); a rank past the last row holds none of that parameter."""
        for p, shard, (_, m, v) in zip(self.params, self.sync.shards, self.sync.adams):
            local = shard.to_local().detach()  # (the same storage, outside autograd: DCP loads into it in place)
            if local.numel():
                yield p, {"param": local, "exp_avg": m, "exp_avg_sq": v}, dtensor_offset(shard), tuple(local.shape)

    def _tp_writer(self, shapes: dict, tp_group) -> dict[tuple, bool]:
        """Whether this rank writes each reference piece it holds: no lower tp rank holds the same one."""
        mine = {(ref, dim, start, length) for p in self.params
                for ref, dim, start, _, length in source_pieces(p, shapes)}
        lower = set()
        if tp_group is not None and dist.get_world_size(tp_group) > 1:
            every = [None] * dist.get_world_size(tp_group)
            dist.all_gather_object(every, mine, group=tp_group)
            lower = set().union(*every[:dist.get_rank(tp_group)])
        return {piece: piece not in lower for piece in mine}

    def checkpoint_state(self) -> dict:
        self.adam_step.fill_(self._adams()[0].step)
        losses = ckpt.Pieces(self.losses.shape, self.losses.dtype)
        losses.add((0,), self.losses, self.last)  # the reported losses: the last stage's
        out = {**self.tensors, "optim.step": self.adam_step, "loop.step": self.step, "loop.losses": losses}
        if self.scaler:
            ran = len(self.scaler.scales)
            self.scaler_state.copy_(torch.tensor([self.scaler.scaler.scale, self.scaler.scaler.clean_steps]))
            self.scales[:ran] = torch.tensor(self.scaler.scales, dtype=torch.float64)
            self.skipped[:ran] = torch.tensor(self.scaler.skipped, dtype=torch.int64)
            out.update({"loop.loss_scaler": self.scaler_state, "loop.loss_scales": self.scales,
                        "loop.skipped": self.skipped})
        return out

    def load_checkpoint_state(self, state: dict) -> None:
        """After DCP loaded into the views: Adam's step, and the model's weights from them (ZeRO-1/2 gather their
        shards; ZeRO-3 gathers at every step's start anyway; FSDP2 holds them in its DTensors, unsharded at each step's
        start). fp16: the loss scaler's S and clean-step count, and its history (the run's checks compare every
        step's S and skip)."""
        from backend.parallel.precision import load_flat

        for adam in self._adams():
            adam.step = int(state["optim.step"])
        if self.scaler:  # (and each step's S and skip before the loaded step, as the run records them)
            scale, clean = self.scaler_state.tolist()
            self.scaler.scaler.scale, self.scaler.scaler.clean_steps = float(scale), int(clean)
            self.scaler.scales = self.scales[:int(self.step)].tolist()
            self.scaler.skipped = [bool(x) for x in self.skipped[:int(self.step)].tolist()]
        if self.fsdp:
            return
        if self.sync.strategy != "zero3":  # (zero1/2: all-gathered; otherwise the master cast to the compute dtype)
            self.sync.weights = self.sync.compute_weights()
        if self.sync.weights is not None:
            load_flat(self.model, self.sync.weights)

    def held_bytes(self) -> dict[str, int]:
        """Tensor bytes this rank hands DCP by category (before deduplication): the weights (master copy), Adam's
        m and v of them, and the rest (Adam's step, the losses, the loss scaler)."""
        out = {"weights": 0, "Adam m, v": 0, "the rest": 0}
        for key, value in self.checkpoint_state().items():
            out[mesh_category(key)] += ckpt.local_bytes(value)
        return out



def dtensor_offset(shard) -> tuple[int, ...]:
    """Where a DTensor's local tensor starts in its global tensor, as DTensor computes it for this rank (what DCP
    itself writes for a DTensor)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    return tuple(compute_local_shape_and_global_offset(shard.shape, shard.device_mesh, shard.placements)[1])


def mesh_category(key: str) -> str:
    """What a mesh checkpoint's key holds: the weights, Adam's m and v, or the rest (steps, losses, loss scaler)."""
    if key.startswith("model."):
        return "weights"
    return "Adam m, v" if key.endswith((".exp_avg", ".exp_avg_sq")) else "the rest"


@dataclass
class MeshHook:
    """What backend/parallel/mesh_train.train_rank calls (a few lines there) to resume, fault and save. `shapes`: the
    one model's parameter shapes (reference_shapes), the global tensors the checkpoint holds."""
    saver: ckpt.Checkpointer
    fault: object = None  # fault(step), mid-step (after the pipeline's forwards and backwards)
    shapes: dict = field(default_factory=dict)
    state: MeshState | None = None

    def resume(self, sync, model, mesh, steps: int, loss_scale=None) -> tuple[int, list[float]]:
        """Load the newest checkpoint into this rank's state (and fp16's loss scaler): the step to run next and the
        losses so far as this rank reports them (0 off the last stage, as its steps do)."""
        self.state = MeshState(sync, model, steps, self.shapes, mesh.group("tp") if mesh.size("tp") > 1 else None,
                               loss_scale)
        start = self.saver.resume(self.state)
        return start, self.state.losses[:start].tolist() if self.state.last else [0.0] * start

    def mid_step(self, step: int) -> None:
        if self.fault:
            self.fault(step)

    def after_step(self, step: int, loss: float) -> None:
        self.state.losses[step] = loss
        self.state.step.fill_(step + 1)
        self.saver.after_step(step, self.state)

    def finish(self) -> None:
        self.saver.finish()


def reference_shapes(config) -> dict[str, tuple]:
    """The one model's parameter shapes (the global tensors of a mesh checkpoint), from its config."""
    from backend.parallel.tp_model import reference_model

    return {k: tuple(v.shape) for k, v in reference_model(config).named_parameters()}


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
                   pieces=ckpt.pieces(last) if last else [], checkpoint=last.name if last else None)
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


def checks_and_tables(config, payloads, ref, cut) -> tuple[list[Check], dict, dict]:
    """The checkpoint checks, metrics and tables of a mesh run with checkpoint_every > 0."""
    from backend.store import pid_alive

    first = payloads[0]["checkpoint"]
    timeline, files, checks = first["timeline"], first["files"], []
    metrics = dict(attempts=first["attempt"] + 1, checkpoint=first["checkpoint"],
                   checkpoint_tensor_bytes=sum(f["tensor bytes"] for f in files),
                   checkpoint_file_bytes=sum(f["bytes"] for f in files),
                   save_s_mean=float(np.mean([s["seconds"] for s in first["saves"]])) if first["saves"] else None,
                   checkpoint_save=config.checkpoint_save, **step_times(timeline, first["attempt"]))
    byte_checks, per_rank = bytes_checks(config, payloads, ref) if files else ([], [])
    checks += byte_checks
    if config.kill_rank >= 0:
        kills = [e for e in timeline if e["event"] == "kill"]
        bitwise = all(p["checkpoint"]["bitwise"] for p in payloads)
        err = max(p["checkpoint"]["baseline_err"] for p in payloads)
        checks.append(Check("final parameters equal the uninterrupted run's bit for bit",
                            0.0 if bitwise else max(err, 1e-300), 0,
                            reference="the same plan trained without checkpoints or the kill, in the same processes "
                                      "(attempt 0, first)", detail="bits compared as uint64 on every rank"))
        gone = bool(kills) and not pid_alive(kills[0]["pid"])
        checks.append(Check("the killed rank died by SIGKILL, its process is gone, and every rank restarted",
                            0 if gone and first["attempt"] == 1 else 1, 0,
                            reference="timeline: a kill (its pid no longer alive), then attempt 1 from the last "
                                      "checkpoint"))
        metrics.update(killed_rank=config.kill_rank, killed_in_step=config.kill_step, resumed_from_step=first["start"],
                       steps_redone=config.kill_step - first["start"], load_s=first["load_s"])
    tables = {"checkpoint_timeline": [{**e, "t_s": e["t"] - timeline[0]["t"]} for e in timeline] if timeline else [],
              "checkpoint_files": files, "checkpoint_bytes_per_rank": per_rank,
              "checkpoint_share_per_rank": share_per_rank(per_rank)}
    if config.reshard_tp:
        more_checks, more_metrics, more_tables = reshard_result(config, payloads, ref, cut)
        checks += more_checks
        metrics.update(more_metrics)
        tables.update(more_tables)
    return checks, metrics, tables


def bytes_checks(config, payloads, ref) -> tuple[list[Check], list[dict]]:
    """The last checkpoint's tensor bytes against the model's state: in all, and each rank's file by category against
    its share (bytes_per_rank's rows, returned with the checks)."""
    first = payloads[0]["checkpoint"]
    files, checks = first["files"], []
    stored = sum(f["tensor bytes"] for f in files)
    item = PRECISIONS[config.precision].item("master")
    model = 3 * item * sum(v.numel() for v in ref["state"].values()) + rest_bytes(config)
    checks.append(Check("tensor bytes in the last checkpoint equal the model's state exactly (each piece written once)",
                        abs(stored - model), 0,
                        reference=f"the one-process model's state_dict: weights (the {config.precision} master "
                                  f"copy) and Adam m and v ({item} B each a parameter), Adam's step and the loop's "
                                  "step (int64), "
                                  "the losses (8 B a step)" + (", the loss scaler (S, clean steps, each step's S and "
                                                               "skip)" if config.precision == "fp16_mixed" else ""),
                        detail=f"{stored:,} B stored in {len(files)} files, {model:,} B counted"))
    per_rank = bytes_per_rank(config, payloads, first["pieces"])
    checks.append(Check("each rank's checkpoint file holds exactly its share: its weights, Adam m, v and the rest",
                        sum(abs(r["written_bytes"] - r["expected_bytes"]) for r in per_rank), 0,
                        reference="each rank's elements of the model from its parallelize sources, pp stage and dp cut "
                                  "(ZeRO: ⌈ψ/dp⌉ of the flat vector; FSDP2: torch.chunk's rows), each written by the "
                                  "holder of lowest (tp index, rank); the steps and loss scaler by rank 0, the losses "
                                  "by the first last-stage rank",
                        detail="; ".join(f"rank {r}: {sum(x['written_bytes'] for x in per_rank if x['rank'] == r):,} B"
                                         for r in sorted({x['rank'] for x in per_rank}))))
    return checks, per_rank


def reshard_result(config, payloads, ref, cut, new_plan=None) -> tuple[list[Check], dict, dict]:
    """The checks, metrics and tables of the continuation on the other mesh (`new_plan`; resharded(config) unless
    given), from the ranks that ran it: its parameters and every step's loss against one float64 process, each new
    rank's reads against the tensor bytes it loaded into (DCP's load plan must cover exactly what the rank holds),
    and DCP's reads as the resharding map: every read (reshard_map), and the bytes each new rank read from each saved
    rank (reshard_bytes)."""
    new = [p["checkpoint"]["reshard"] for p in payloads if p["checkpoint"].get("reshard")]
    param_err = max(float(np.abs(v - cut(ref["state"], n["sources"])[k].numpy()).max())
                    for n in new for k, v in n["params"].items())
    last = next(n for n in new if n["last_stage"])
    loss_err = max(abs(a - b) for a, b in zip(last["losses"], ref["losses"]))
    plan = f"{mesh_label(config)} -> {mesh_label(new_plan or resharded(config))}"
    reference = "TinyDecoder, float64, torch.optim.Adam, one process, all the steps"
    read = {i: sum(r["bytes"] for r in n["reads"]) for i, n in enumerate(new)}
    checks = [
        Check(f"resharded ({plan}): final parameters equal one process", param_err, 1e-9, reference=reference,
              detail="max |difference|"),
        Check("resharded: every step's loss equals one process", loss_err, 1e-9, reference=reference),
        Check("resharded: each new rank's reads add up to the tensor bytes it holds",
              sum(abs(read[i] - n["held"]) for i, n in enumerate(new)), 0,
              reference="the pieces of the model's tensors (and Adam's m, v) each new rank loaded into",
              detail=", ".join(f"rank {i}: {b:,} B read" for i, b in read.items())),
    ]
    metrics = {"reshard_plan": plan, "reshard_from": new[0]["from"], "reshard_load_s": max(n["load_s"] for n in new)}
    reads, pairs = [r for n in new for r in n["reads"]], {}
    for row in reads:
        pairs[(row["new rank"], row["saved rank"])] = pairs.get((row["new rank"], row["saved rank"]), 0) + row["bytes"]
    return checks, metrics, {"reshard_map": reads, "reshard_bytes": [
        {"new rank": a, "saved rank": b, "bytes": v} for (a, b), v in sorted(pairs.items())]}


def mesh_label(config) -> str:
    """tp x pp x dp, and cp and ep where they are more than 1; the dp strategy where dp > 1."""
    dims = " x ".join(f"{d} {getattr(config, d)}" for d in ("tp", "pp", "dp", "cp", "ep")
                      if d in ("tp", "pp", "dp") or getattr(config, d) > 1)
    return dims + (f" {config.dp_strategy}" if config.dp > 1 else "")


def resume_bytes(config, payload: dict) -> int:
    """Bytes a rank sends over dp to load a checkpoint: ZeRO-1/2 all-gather the loaded master shards, cast to the
    compute dtype, into the whole weights (a ring over the flat vector padded to a multiple of dp); the others none
    (ZeRO-3 and FSDP2 gather at each step's start anyway, all-reduce and DDP load whole weights)."""
    from backend.comm.collectives import ring_bytes

    if config.dp_strategy not in ("zero1", "zero2") or config.dp == 1:
        return 0
    shard = -(-payload["flat_numel"] // config.dp)
    return ring_bytes("all_gather", shard, config.dp, PRECISIONS[config.precision].item("compute"))


def rest_bytes(config) -> int:
    """The checkpoint's tensors beside the weights and Adam's m, v: Adam's step and the loop's step (int64), the losses
    (float64 a step), and under fp16 the loss scaler (S and its clean steps, float64; each step's S and skip flag)."""
    return 8 + 8 + 8 * config.steps + (16 + 16 * config.steps if config.precision == "fp16_mixed" else 0)


def held_elements(config, payload: dict, shapes: dict, base: dict) -> np.ndarray:
    """The elements of the one model (numbered ref by ref, `base`: each reference tensor's first number) whose weights
    and Adam states this rank keeps: its parameters as parallelize's sources cut them from the reference tensors (in
    model order), then its dp cut: ZeRO's ⌈ψ/dp⌉ of the flat vector, FSDP2's ⌈rows/dp⌉ rows of each parameter."""
    params = []
    for dim, parts in payload["sources"].values():
        numbered = {ref: base[ref] + np.arange(int(np.prod(shapes[ref]))).reshape(shapes[ref]) for ref, _ in parts}
        if dim is None:
            params.append(numbered[parts[0][0]])
        else:
            params.append(np.concatenate([numbered[ref][(slice(None),) * dim + (sl,)] for ref, sl in parts], axis=dim))
    k, i = config.dp, payload["coords"]["dp"]
    if config.dp_strategy == "fsdp2":
        return np.concatenate([x[i * -(-x.shape[0] // k):(i + 1) * -(-x.shape[0] // k)].ravel() for x in params])
    flat = np.concatenate([x.ravel() for x in params])
    if config.dp_strategy.startswith("zero"):
        shard = -(-flat.size // k)
        flat = flat[i * shard:(i + 1) * shard]
    return flat


def expected_per_rank(config, payloads) -> dict[int, dict[str, int]]:
    """Each rank's bytes in the checkpoint by category, from the settings and each rank's parameters: every element of
    the model written once, by the rank of lowest (tp index, rank) holding it, as its weight and Adam's m and v at the
    master dtype's size; the steps (and fp16's scaler) by rank 0, the losses by the lowest rank on the last stage."""
    shapes = reference_shapes(config)
    base, at = {}, 0
    for ref in sorted(shapes):
        base[ref], at = at, at + int(np.prod(shapes[ref]))
    written, item, out = np.zeros(at, dtype=bool), PRECISIONS[config.precision].item("master"), {}
    for p in sorted(payloads, key=lambda p: (p["coords"]["tp"], p["rank"])):
        ids = held_elements(config, p, shapes, base)
        new = np.unique(ids[~written[ids]])
        written[new] = True
        out[p["rank"]] = {"weights": item * new.size, "Adam m, v": 2 * item * new.size, "the rest": 0}
    out[0]["the rest"] += rest_bytes(config) - 8 * config.steps
    out[min(p["rank"] for p in payloads if p["last_stage"])]["the rest"] += 8 * config.steps
    return out


def bytes_per_rank(config, payloads, pieces: list[dict]) -> list[dict]:
    """Each rank's tensor bytes in the checkpoint's files by category (DCP's metadata: which file, so which rank, holds
    each piece), beside expected_per_rank's, and what the rank held before deduplication."""
    expected = expected_per_rank(config, payloads)
    held = {p["rank"]: p["checkpoint"]["held"] for p in payloads}
    written: dict[tuple[int, str], int] = {}
    for x in pieces:
        at = (x["rank"], mesh_category(x["key"]))
        written[at] = written.get(at, 0) + x["bytes"]
    return [{"rank": r, "category": c, "written_bytes": written.get((r, c), 0), "expected_bytes": e,
             "held_bytes": held[r][c]} for r, cats in sorted(expected.items()) for c, e in cats.items()]


def share_per_rank(per_rank: list[dict]) -> list[dict]:
    """Each rank's whole file against its whole share: bytes_per_rank's categories summed per rank (what the page draws
    as a tick over each rank's stacked bar)."""
    out: dict[int, dict] = {}
    for row in per_rank:
        total = out.setdefault(row["rank"], {"rank": row["rank"], "written_bytes": 0, "expected_bytes": 0})
        total["written_bytes"] += row["written_bytes"]
        total["expected_bytes"] += row["expected_bytes"]
    return [out[r] for r in sorted(out)]


def step_intervals(timeline: list[dict], attempt: int) -> tuple[list[float], list[float]]:
    """The wall time from one step's end to the next (rank 0's timeline, the attempt given), split into the steps that
    began with a save (sync: the whole save; async: its staging and the wait for the previous write) and those that
    did not, in seconds."""
    ends = [e for e in timeline if e.get("attempt") == attempt and e["event"] in ("step", "save")]
    saving, plain = [], []
    for i, (a, b) in enumerate(zip(ends, ends[1:])):
        if a["event"] == "step":
            nxt = next((e for e in ends[i + 1:] if e["event"] == "step"), None)
            if nxt and nxt["step"] == a["step"] + 1:
                (saving if b["event"] == "save" else plain).append(nxt["t"] - a["t"])
    return saving, plain


def step_times(timeline: list[dict], attempt: int) -> dict:
    """step_intervals' medians: with and without a save (None where there is none)."""
    saving, plain = step_intervals(timeline, attempt)
    med = lambda x: float(np.median(x)) if x else None  # noqa: E731
    return {"step_s_with_save": med(saving), "step_s_without_save": med(plain)}


BENCH = "bench/results/checkpoint.json"


def bench_rows(path=None) -> tuple[dict, list[dict]] | None:
    """bench/checkpoint.py's measured figures as read from its JSON (None while it has not been run): where and when
    it ran (machine, load average at the start), and a row per plan and save mode: the save's blocking time (median,
    min-max), the load, the steps after a save and without one (medians), the checkpoint's tensor bytes against the
    model's state and the largest rank's."""
    import json
    from pathlib import Path

    path = Path(path) if path else Path(__file__).resolve().parents[2] / BENCH
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    about = {"machine": data["device"].get("name"), "when": data["when"],
             "load": data["load_average_1_5_15_min_at_start"][0]}
    r3 = lambda x: None if x is None else round(x, 3)  # noqa: E731
    rows = [{"plan": r["plan"], "save": r["mode"], "blocking (s)": r3(r["save_blocking"].get("median_s")),
             "min-max (s)": f"{r['save_blocking']['min_s']:.3f}-{r['save_blocking']['max_s']:.3f}",
             "load (s)": r3(r["load"]["seconds_slowest_rank"]),
             "step, saving (s)": r3(r["step_after_save"].get("median_s")),
             "step, not (s)": r3(r["step_without_save"].get("median_s")),
             "bytes / model (B)": f"{r['checkpoint_tensor_bytes']:,} / {r['model_state_bytes']:,}",
             "top rank (B)": max(x["written_bytes"] for x in r["per_rank_bytes"])} for r in data["rows"]]
    return about, rows
