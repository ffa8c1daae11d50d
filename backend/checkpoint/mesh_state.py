"""The mesh's state in a checkpoint: each rank's pieces of the one model's tensors, and the hook its loop calls.

    hook = MeshHook(Checkpointer(folder(ctx), every=2, rank=rank), fault, reference_shapes(config))
    train_rank(rank, world, config, progress, hook)  # mesh_train calls it: resume, fault mid-step, save after a step

MeshState hands the Checkpointer each rank's pieces of the one model's tensors at their global offsets, whatever its
tp shard, pp stage and dp cut (any dp strategy, FSDP2 too, any precision), so a checkpoint loads onto another
tp x pp x dp x cp x ep mesh, dp strategy or world size of the same model (mesh_run.py runs that; mesh_checks.py checks
what was written against each rank's share)."""
from __future__ import annotations

import types
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from backend.checkpoint.checkpointer import Checkpointer, CheckpointError
from backend.checkpoint.pieces import Pieces, local_bytes


def rectangles(shape, x: int, y: int) -> list[tuple[tuple, tuple]]:
    """The elements [x, y) of a row-major tensor of `shape` (1-D or 2-D) as rectangles (offsets, sizes): a range of a
    1-D tensor, or a partial first row, whole rows and a partial last row."""
    if x >= y:
        return []
    if len(shape) == 1:
        return [((x,), (y - x,))]
    if len(shape) != 2:
        raise CheckpointError(f"a {len(shape)}-D parameter: only 1-D and 2-D ones are cut into rectangles")
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

    def _pieces(self, shapes: dict, tp_group) -> dict[str, Pieces]:
        writes, out = self._tp_writer(shapes, tp_group), {}
        for p, held, offsets, sizes in (self._fsdp_held() if self.fsdp else self._flat_held()):
            for ref, glob, narrow, piece in global_rectangles(p, shapes, offsets, sizes):
                for kind, view in held.items():
                    view = view.narrow(*narrow) if narrow else view
                    key = f"model.{ref}" if kind == "param" else f"optim.{ref}.{kind}"
                    out.setdefault(key, Pieces(shapes[ref], view.dtype)).add(glob, view, writes[piece])
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
        losses = Pieces(self.losses.shape, self.losses.dtype)
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
            out[mesh_category(key)] += local_bytes(value)
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
    saver: Checkpointer
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
