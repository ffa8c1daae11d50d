"""The mesh's one training loop: the tiny LLaMA (or the pipeline page's stack) on a pp x dp x cp x ep x tp mesh
(seed 002: "pipeline, then tensor, then data parallel, together"; context and expert parallel as further dimensions).

Each rank is pipeline stage mesh.index("pp") with the tp shard of its weights (tp.py), trains on its dp x ep slice of
every step's batch and its cp shard of each sequence's positions (cp.py; which tokens: token_split.py). A step walks
the schedule's actions (pp/executor.py), then sums the gradients (sp's norms over tp; cp; ep where replicated; dp by
the dp_strategy, mesh_dp.py) and takes Adam on the elements this rank owns. Each micro-batch's mean loss is weighted
by its share of the global batch's tokens, so the summed gradients are one process's on the whole batch, and Adam,
elementwise, updates a shard as it does those elements of the full tensor (the ranks' Adam is the workload's, written
out: no torch._dynamo import, seconds per rank). Each dimension records on a tracer of its own, so every event says
whose it is. With experts, every feed-forward is a dropless top-k MoE layer (routing does not depend on how the tokens
are grouped). Precision (precision.py): the stages compute in the compute dtype, the gradients are summed in the
reduce dtype; fp16 adds dynamic loss scaling, and a step that overflows on any rank is skipped by every rank.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from backend.parallel.cp import SequenceShard
from backend.parallel.mesh import DeviceMesh
from backend.parallel.mesh_dp import data_parallel
from backend.parallel.pp.executor import execute, keep_freed_memory
from backend.parallel.pp.recompute import ActivationMeter, MeteredStage
from backend.parallel.pp.schedules import ACTIONS, SCHEDULES, is_action, live_activations
from backend.parallel.parallelize import parallelize, sources
from backend.parallel.recompute import FlopCount, apply_selective_recompute
from backend.parallel.tp import part, sum_norm_grads
from backend.parallel.tp_model import reference_model, tokens
from backend.parallel.token_split import token_split
from backend.parallel.wire import Wire, sum_gradients
from backend.parallel.precision import PRECISIONS, Precision, flat_params, load_flat, named_weights
from backend.numerics.mixed_precision import DynamicLossScaler
from backend.trace import Tracer


def to_precision(model: nn.Module, precision: Precision) -> torch.Tensor:
    """The master copy of the model's (float64) initial weights, flat in the master dtype; the model itself cast to the
    compute dtype and loaded from it, as the reference casts it (a copy of the master, rounded once)."""
    master = flat_params(model).to(precision.master)
    model.to(precision.compute)
    load_flat(model, master)
    return master


class LossScale:
    """This rank's loss scale S: fp16's dynamic one (numerics.mixed_precision.DynamicLossScaler, GradScaler's rule) with
    each step's S and whether it was skipped recorded; otherwise S = 1 and no step is skipped."""

    def __init__(self, config):
        fp16 = PRECISIONS[config.precision].compute == torch.float16  # 5 exponent bits underflow small gradients
        self.scaler = (DynamicLossScaler(float(config.init_loss_scale))
                       if fp16 else None)  # (a plan without fp16 may have no init_loss_scale: the pipeline page's)
        self.scales, self.skipped = [], []

    @property
    def scale(self) -> float:
        return self.scaler.scale if self.scaler else 1.0

    def unscale(self, grads: torch.Tensor) -> tuple[torch.Tensor, bool, float]:
        """(grads ÷ S, whether any rank's gradients overflowed (the step is then skipped), S); records the step and
        updates S. S is a power of 2, so the division is exact."""
        if self.scaler is None:
            return grads, False, 1.0
        scale, overflow = self.scaler.scale, overflowed(grads)
        self.scales.append(scale)
        self.skipped.append(overflow)
        self.scaler.update(overflow)
        return grads / scale, overflow, scale


class MeshStage(MeteredStage):
    """Pipeline stage `s` of S for the executor: the tiny LLaMA's blocks of stage s at this rank's tp shard (the
    embedding on stage 0, norm, head and loss on stage S-1) on this rank's micro-batches and cp positions. The last
    stage returns its micro-batch's share of the global mean loss; the blocks' saved bytes are recorded per mb."""

    def __init__(self, chunk: nn.Module, s: int, S: int, batches: list, shard, columns, d_model: int,
                 global_tokens: int, sp: int = 1, entry: nn.Module | None = None, dtype: torch.dtype = torch.float64,
                 loss_scale: float = 1.0):
        self.chunk = self.module = chunk  # (module: what the executor reads)
        self.entry = entry  # dp_strategy fsdp2: the fully_shard-ed module the forward runs through (fsdp.StageEntry)
        self.sp = sp  # sequence parallel over sp tp ranks: a stage hands on its sequence shard
        self.index, self.last, self.shard = s, s == S - 1, shard
        self.inputs = [mb[:, :-1][:, columns] for mb in batches]
        self.targets = [mb[:, 1:][:, columns] for mb in batches]
        self.d_model, self.global_tokens, self.dtype = d_model, global_tokens, dtype  # dtype: the activations'
        self.loss_scale = loss_scale  # fp16: the loss scale S the backward starts from

    def input(self, mb: int) -> torch.Tensor:
        return self.inputs[mb]

    def input_like(self, mb: int) -> torch.Tensor:
        b, s = self.inputs[mb].shape
        return torch.empty((b, s // self.sp, self.d_model), dtype=self.dtype)

    def forward(self, x: torch.Tensor, mb: int) -> torch.Tensor:
        return self._forward(x, mb) if self.entry is None else self.entry(self._forward, x, mb)

    def _forward(self, x: torch.Tensor, mb: int) -> torch.Tensor:
        h = x if self.chunk.embed is None else self.chunk.embed(x)
        with self.recording(mb, x, self.chunk.parameters()):  # the blocks; x is what full recompute keeps
            y = self.chunk.run_blocks(h)
        if not self.last:
            return y
        loss, _ = self.chunk.head_loss(y, self.targets[mb])
        return loss * (self.targets[mb].numel() / self.global_tokens * self.loss_scale)  # share of the global mean, x S


class TinyLlama:
    """The loop's model choice for the mesh (the pipeline page brings its own Linear stack): this rank's stage chunks of
    the tiny LLaMA, run as MeshStages on this rank's tokens (parallel/token_split.py)."""

    def __init__(self, config, mesh: DeviceMesh, S: int, m: int, tp: Wire, ep: Wire, shard):
        self.config, self.S, self.tp, self.ep, self.shard = config, S, tp, ep, shard
        coords = {d: mesh.index(d) for d in mesh.shape}
        self.split = token_split(config.batch, config.seq, m, mesh.shape, coords, config.sp)
        self.batches = [tokens(config)[seqs] for seqs in self.split.sequences]  # this rank's sequences, per micro-batch

    def build(self, stages: list[int]) -> tuple[dict, nn.Module]:
        """This rank's stage chunks of the one model, each parallelized (tp, sp, ep, cp) and its attention core set for
        the recompute choice; and all of them as one module, in stage order."""
        reference = reference_model(self.config)
        chunks = {s: parallelize(reference, self.tp, self.config.sp, stage=s, stages=self.S, ep=self.ep, cp=self.shard)
                  for s in stages}
        for chunk in chunks.values():
            apply_selective_recompute(chunk, self.config.recompute == "selective")
        return chunks, nn.ModuleDict({f"stage{s}": chunk for s, chunk in chunks.items()})

    def stages(self, chunks: dict, entry, dtype: torch.dtype, loss_scale: float) -> dict:
        """This step's stage objects (`entry`: fsdp2's fully_shard-ed module per chunk, sync.entry)."""
        c = self.config
        return {s: MeshStage(chunk, s, self.S, self.batches, self.shard, self.split.positions, c.d_model,
                             c.batch * c.seq, c.tp if c.sp else 1, entry(chunk), dtype, loss_scale)
                for s, chunk in chunks.items()}

    def layers(self, chunks: dict) -> dict[int, list[int]]:
        """Each of this rank's stage chunks: the indices of the model's layers it holds."""
        return {s: list(range(*part(self.config.layers, s, self.S).indices(self.config.layers))) for s in chunks}

    def sources(self, chunks: dict) -> dict:
        return {f"stage{s}.{k}": src for s, c in chunks.items() for k, src in sources(c).items()}


def moe_calls(chunks: dict, layers: dict) -> list[dict]:
    """Every MoE layer call's routing statistics on this rank, named by the model layer it ran in."""
    return [dict(call, layer=layers[s][i]) for s, c in chunks.items() for i, b in enumerate(getattr(c, "blocks", ()))
            for call in getattr(b.ffn, "stats", [])]


def train_rank(rank: int, world: int, config, progress=None, checkpoint=None, model_choice=TinyLlama) -> dict:
    """This rank's training of `model_choice` (TinyLlama, or any class of its interface: the pipeline page's LinearStack).
    `checkpoint` (checkpoint/mesh_state.MeshHook): resume, fault mid-step, save as its interval says. Freed memory is
    kept (keep_freed_memory: no page faults charged to an action), so the replay can take each action's least CPU time
    over the steps; the last step's walk runs with an ActivationMeter. An asynchronous schedule (PipeDream) steps each
    stage's weights in the walk itself (SGD after each backward, executor.RankWalk): the loop sums and steps nothing."""
    keep_freed_memory()
    mesh = DeviceMesh.build(rank, world, pp=config.pp, dp=config.dp, cp=config.cp, ep=config.ep, tp=config.tp)
    tracer = Tracer(rank)  # the pipeline's actions; each other dimension's events on a tracer of its own
    along = {d: Tracer(rank) for d in ("tp", "dp", "cp", "ep")}
    tp, dp, cp, ep = (Wire.along(mesh, d, along[d]) for d in ("tp", "dp", "cp", "ep"))
    shard = SequenceShard(config.seq, cp) if config.cp > 1 else None
    plan, p, me = SCHEDULES[config.schedule], config.pp, mesh.index("pp")
    S, m = p * plan.chunks(config.virtual_stages), plan.microbatches(config.microbatches)
    choice = model_choice(config, mesh, S, m, tp, ep, shard)
    chunks, model = choice.build(plan.stages_on(me, p, config.virtual_stages))
    params = list(model.parameters())
    replicated_over_ep = replicated_mask(chunks, params)
    precision, loss_scale = PRECISIONS[config.precision], LossScale(config)
    sync = data_parallel(config, model, to_precision(model, precision), params, mesh, dp, along["dp"], precision)
    order = plan.actions(p, m, config.virtual_stages)[me]
    tracer.align(dist.barrier)  # time zero when every rank holds its shard: the trace is training alone
    for t in along.values():
        t.t0_ns = tracer.t0_ns
    step_us, losses, activations, kept, pp_bytes = [], [], {}, {}, 0  # step_us: each step's (start, end) on this rank
    walk, meter = dict.fromkeys(WALK), ActivationMeter()  # (a resumed run with no step left walks nothing)

    def make_stages():  # (fsdp2: each stage called through its fully_shard-ed module, sync.entry)
        return choice.stages(chunks, sync.entry, precision.compute, loss_scale.scale)
    start, losses = checkpoint.resume(sync, model, mesh, config.steps, loss_scale) if checkpoint else (0, losses)
    for step in range(start, config.steps):
        start_us = tracer.now_us()
        gathered = sync.weights_for_step(step)
        if gathered is not None:
            load_flat(model, gathered)
        stages = make_stages()
        if step == start:
            for s, st in stages.items():
                st.activations, st.kept = activations.setdefault(s, {}), kept.setdefault(s, {})
        meter = ActivationMeter() if step == config.steps - 1 else None
        walk = execute(order, plan, stages, mesh.ranks("pp"), me, p, m, tracer, recompute=config.recompute == "full",
                       pipedream=config if plan.asynchronous else None, meter=meter)
        pp_bytes += walk["sent_bytes"]
        if checkpoint:
            checkpoint.mid_step(step)
        scale, params = (1.0, list(model.parameters())) if plan.asynchronous else step_weights(
            config, model, sync, loss_scale, (tp, cp, ep), replicated_over_ep, precision, step)
        step_us.append((start_us, tracer.now_us()))  # (the loss reported below is not training)
        losses.append(reported_loss(walk["loss"] / scale, mesh))
        if checkpoint:
            checkpoint.after_step(step, losses[-1])
        if progress and rank == 0:
            progress((step + 1) / config.steps, f"step {step + 1} of {config.steps}")
    if checkpoint:
        checkpoint.finish()
    sync.close()
    final = named_weights(model) if plan.asynchronous else sync.final_named(model)  # (zero3, fsdp2: one more gather)
    layers = choice.layers(chunks)
    in_flight = peak_in_flight(order, activations, kept if config.recompute == "full" else None)
    sent = bytes_by_dimension(tp, pp_bytes, dp, cp, ep, sync.overlap)
    payload = {"rank": rank, "coords": {d: mesh.index(d) for d in ("pp", "dp", "cp", "ep", "tp")},
               "last_stage": S - 1 in chunks, "losses": losses, "params": final, "sources": choice.sources(chunks),
               "memory": {**sync.memory(), "activations": in_flight}, "host_memory": sync.host_memory(),
               "moved": sync.moved(), "param_numels": [p_.numel() for p_ in params],
               "param_shapes": {s: [list(p_.shape) for p_ in c.parameters()] for s, c in chunks.items()},
               "activations": {f"{s},{mb}": b for s, per in activations.items() for mb, b in per.items()},
               "order": [str(a) for a in order], "order_actions": [tuple(a) for a in order],
               "stages": {s: layers[s] for s in chunks}, "bytes": sent, "moe": moe_calls(chunks, layers),
               "replicated_over_ep": int(replicated_over_ep.sum()), "flat_numel": sum(p_.numel() for p_ in params),
               "layers": sorted(i for ls in layers.values() for i in ls),
               "layers_here": sum(len(ls) for ls in layers.values()), "trace": merged_trace(tracer, along, mesh),
               "step_us": step_us, "loss_scales": loss_scale.scales, "skipped": loss_scale.skipped,
               "walk": {k: walk[k] for k in WALK}, "activation_peak_bytes": meter.peak}
    if config.recompute != "none":  # after the payload: its steps' bytes, routing and events stay out of the run's own
        payload["price"] = recompute_price(config, order, plan, chunks, make_stages, mesh.ranks("pp"), me, p, m, rank)
    return payload


WALK = ("peak_live", "timeline", "versions", "grad_errors")  # the last step's, reported


def step_weights(config, model: nn.Module, sync, loss_scale: LossScale, wires: tuple, replicated_over_ep: torch.Tensor,
                 precision: Precision, step: int) -> tuple[float, list]:
    """After a synchronous step's walk: the gradients summed (sp's norms over tp, then over cp, ep and dp as the
    dp_strategy does), unscaled, and the strategy's Adam step taken and loaded. Returns the step's loss scale S and
    the parameters the gradients were read from (fsdp2: its unsharded ones, read afresh)."""
    tp, cp, ep = wires
    if config.sp:  # each tp rank's norms saw only its sequence shard: their gradients summed over tp, once a step
        sum_norm_grads(model, tp)
    params = list(model.parameters())
    grads, overflow, scale = loss_scale.unscale(gradients_over_cp_ep(  # (ddp overlap: summed over dp already)
        params, cp, ep, replicated_over_ep, precision.reduce, sync.gradients()))
    weights = sync.update(grads, step, skip=overflow)
    if weights is not None:
        load_flat(model, weights)
    model.zero_grad(set_to_none=True)
    return scale, params


class _Counted:
    """A stage whose forwards are FLOP-counted one by one (an outer counter still sees them: modes stack)."""

    def __init__(self, stage, log: list):
        self.stage, self.log = stage, log

    def __getattr__(self, name):
        return getattr(self.stage, name)

    def forward(self, x, mb):
        with FlopCount() as counter:
            out = self.stage.forward(x, mb)
        self.log.append({"stage": self.stage.index, "mb": mb, "grad": torch.is_grad_enabled(), "flops": counter.total})
        return out


def replicated_mask(chunks: dict, params: list) -> torch.Tensor:
    """One flag per element of the flat parameters: True where it is not a routed expert's (replicated over ep)."""
    experts = {id(p_) for c in chunks.values() for b in getattr(c, "blocks", ())
               for e in getattr(b.ffn, "experts", []) for p_ in e.parameters()}
    sizes = torch.tensor([p_.numel() for p_ in params])
    return torch.tensor([id(p_) not in experts for p_ in params]).repeat_interleave(sizes)


def gradients_over_cp_ep(params: list, cp: Wire, ep: Wire, replicated_over_ep: torch.Tensor,
                         reduce: torch.dtype = torch.float64, flat: torch.Tensor | None = None) -> torch.Tensor:
    """The flat gradient (`flat`, or the parameters' own), cast to the reduce dtype, summed over the context-parallel
    ranks, and over ep where the weights are replicated."""
    grads = torch.cat([p_.grad.reshape(-1) for p_ in params]).to(reduce) if flat is None else flat
    grads = sum_gradients(cp, grads, "context-parallel gradients")
    if ep.n > 1:
        grads[replicated_over_ep] = sum_gradients(ep, grads[replicated_over_ep], "expert-parallel replicated gradients")
    return grads


def overflowed(grads: torch.Tensor) -> bool:
    """Whether any rank's gradients hold an inf or NaN (an all-reduce of the flag over the world, so every rank skips
    the same steps: each pipeline stage and shard sees only its own gradients)."""
    flag = torch.tensor([0.0 if torch.isfinite(grads).all() else 1.0])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def reported_loss(loss: float, mesh: DeviceMesh) -> float:
    """Reporting only: the step's loss on the last stage, summed over dp, cp and ep."""
    reported = torch.tensor([loss], dtype=torch.float64)
    for dim in ("dp", "cp", "ep"):
        if mesh.size(dim) > 1:
            dist.all_reduce(reported, group=mesh.group(dim))
    return reported.item()


def bytes_by_dimension(tp: Wire, pp_bytes: int, dp: Wire, cp: Wire, ep: Wire, overlap=None) -> dict:
    """Bytes this rank sent, per dimension and purpose, from each dimension's wire (dp: and the overlap thread's)."""
    return {"tp": tp.sent(), "pp": pp_bytes, "cp ring": cp.sent("ring"),
            "dp gradients": dp.sent() + (overlap.wire.sent() if overlap else 0),
            "cp gradients": cp.sent("all_reduce"), "ep all-to-all": ep.sent(names=("dispatch", "combine", "counts")),
            "ep gradients": ep.sent("all_reduce")}


def merged_trace(tracer: Tracer, along: dict, mesh: DeviceMesh) -> dict:
    """The pipeline's events, then each dimension's, tagged with it (a group of one sends nothing: no dim)."""
    tagged = [{**e, "args": {**e["args"], **({"dim": d} if mesh.size(d) > 1 else {})}}
              for d, t in along.items() for e in t.events]
    return {**tracer.payload(), "events": list(tracer.events) + tagged}


def recompute_price(config, order, plan, chunks, make_stages, pp_ranks, me, p, m, rank) -> dict:
    """Recompute's price on this rank: one step of the same plan without recompute and one with it, each timed (CPU
    time of its F/B/I/W actions), then each FLOP-counted (recompute.FlopCount; forwards also one by one); the peak
    activations without it. Gradients are discarded, nothing is updated (checked in experiments/parallel/_recompute)."""
    full, selective = config.recompute == "full", config.recompute == "selective"

    def step(on: bool, stages: dict) -> tuple[dict, Tracer]:
        for c in chunks.values() if selective else ():
            apply_selective_recompute(c, on)
        tracer = Tracer(rank)
        walk = execute(order, plan, stages, pp_ranks, me, p, m, tracer, recompute=full and on)
        for c in chunks.values():
            c.zero_grad(set_to_none=True)
        return walk, tracer
    out, per = {}, {}
    for label, on in (("without", False), ("with", True)):
        stages = make_stages()
        for s, st in stages.items() if not on else ():  # what each (stage, micro-batch) saves without recompute
            st.activations, st.kept = per.setdefault(s, {}), {}
        walk, tracer = step(on, stages)
        actions = [e for e in tracer.events if is_action(e)]
        out[f"{label}_cpu_us"] = {k: sum(e["cpu_us"] for e in actions if e["args"]["kind"] == k) for k in ACTIONS}
        if on:
            out["recompute_cpu_us"] = walk["recompute_cpu_us"]
        else:
            out["without_forward_cpu_us"] = [e["cpu_us"] for e in actions if e["args"]["kind"] == "F"]
            out["peak_without"] = peak_in_flight(order, per)
    for label, on in (("without", False), ("with", True)):
        forwards = []
        with FlopCount() as counter:
            step(on, {s: _Counted(st, forwards) for s, st in make_stages().items()})
        out[f"{label}_flops"], out[f"{label}_forwards"] = counter.total, forwards
    for c in chunks.values() if selective else ():
        apply_selective_recompute(c, True)
    return out


def peak_in_flight(order, per_action, kept=None) -> int:
    """Peak bytes of activations alive on a rank walking its order (a micro-batch's stage activations live from its F
    to its B, or its W, which still reads them). per_action: {stage: {mb: bytes}}. With full recompute (`kept`, each
    stage input's bytes) only the inputs live from F to B, plus one micro-batch's whole activations during its B,
    recomputed there (a split backward recomputes in I and holds them until W)."""
    if kept is None:
        return live_activations(order, lambda stage, mb: per_action[stage][mb])
    alive, peak = {}, 0
    for kind, mb, stage in order:
        if kind == "F":
            alive[(stage, mb)] = kept[stage][mb]
        elif kind == "B":
            alive.pop((stage, mb))
            peak = max(peak, sum(alive.values()) + per_action[stage][mb])
        elif kind == "I":
            alive[(stage, mb)] = per_action[stage][mb]
        elif kind == "W":
            alive.pop((stage, mb))
        peak = max(peak, sum(alive.values()))
    return peak
