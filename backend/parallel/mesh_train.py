"""3D (and 4D, 5D) parallel: the tiny LLaMA trained on a pp x dp x cp x ep x tp mesh (seed 002: "pipeline, then
tensor, then data parallel, together"; context and expert parallel as further dimensions).

Each rank is pipeline stage mesh.index("pp") (its share of the blocks; the embedding on the first stage, the
head and loss on the last), holds the tensor-parallel shard mesh.index("tp") of every weight there
(backend/parallel/tp.py), trains on data-parallel slice mesh.index("dp") of every step's batch, and within
each sequence on context-parallel shard mesh.index("cp") of the positions (zigzag, backend/parallel/cp.py):
  forward   micro-batch by micro-batch (GPipe: all forwards, then all backwards), activations sent to the
            same (dp, cp, tp) coordinate of the next stage; within a stage, TP's f/g all-reduces, and in each
            attention the K/V blocks of the other positions coming round the cp ring
  backward  input gradients sent back stage to stage (and dK/dV round the ring)
  sync      the gradients all-reduced over dp, then over cp (one flat ring all-reduce each; Megatron-LM runs
            one over the merged dp x cp group, the same sum), then Adam on the local shard
Each micro-batch's mean loss is weighted by its share of the global batch's tokens, so the gradients summed
over micro-batches, dp and cp ranks are those of one process on the whole batch, and Adam, elementwise,
updates each shard exactly as it updates those elements of the full tensor. The reference uses torch.optim.Adam;
the ranks use the workload's hand-written Adam (the same formula, and no torch._dynamo import: seconds per rank).

With experts > 0 every feed-forward is an MoE layer (dropless top-k, so routing does not depend on how the tokens
are grouped) and the ep dimension splits it by expert (backend/parallel/ep.py): ep ranks are data-parallel for
everything else (each trains on its own slice of the batch, split over dp x ep), and their tokens reach the
experts by all-to-all. An expert's gradient already sums every ep rank's tokens (the all-to-all's backward brought
them), so only the replicated weights are summed over ep; all are summed over dp and cp.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from backend.parallel.cp import SequenceShard
from backend.parallel.mesh import DeviceMesh
from backend.parallel.sp import SavedActivations
from backend.parallel.tp import TPDecoder
from backend.parallel.tp_model import reference_model, tokens
from backend.parallel.wire import Wire
from backend.parallel.workload import Adam, flat_params, load_flat
from backend.trace import Tracer


def reference_training(config) -> dict:
    """One process, the whole batch, the same Adam: losses per step and the final weights. Every step sees the
    same batch (random tokens have nothing else to learn), so the loss must fall as the model memorises it."""
    model = reference_model(config)
    opt = torch.optim.Adam(model.parameters(), lr=config.lr)
    losses, routing = [], []
    for step in range(config.steps):
        if config.experts:
            for b in model.blocks:
                b.ffn.routing_log = []  # this step's choices, one entry per sequence
        opt.zero_grad()
        loss = model.loss(tokens(config))
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if config.experts:  # (layer, sequence, position, choice): each token's experts at this step
            routing.append(torch.stack([torch.stack(b.ffn.routing_log) for b in model.blocks]))
    return {"losses": losses, "state": {k: v.detach() for k, v in model.state_dict().items()}, "routing": routing}


class Pipe:
    """Blocking send/recv to the neighbouring stage of this (dp, tp) coordinate, bytes counted."""

    def __init__(self, mesh: DeviceMesh, tracer: Tracer):
        self.ranks, self.stage, self.tracer, self.sent = mesh.ranks("pp"), mesh.index("pp"), tracer, 0

    def send(self, t: torch.Tensor, to: int, tag: int, what: str) -> None:
        with self.tracer.span("comm", f"send {what}", bytes=t.numel() * t.element_size()):
            dist.send(t.contiguous(), self.ranks[to], tag=tag)
        self.sent += t.numel() * t.element_size()

    def recv(self, shape, frm: int, tag: int, what: str) -> torch.Tensor:
        out = torch.empty(shape, dtype=torch.float64)
        with self.tracer.span("comm", f"recv {what}"):
            dist.recv(out, self.ranks[frm], tag=tag)
        return out


def sum_gradients(wire: Wire, flat: torch.Tensor, what: str) -> torch.Tensor:
    """Ring all-reduce of the flat gradient vector over one mesh dimension (zero-padded to equal chunks)."""
    if wire.n == 1:
        return flat
    padded = torch.zeros(-(-flat.numel() // wire.n) * wire.n, dtype=flat.dtype)
    padded[:flat.numel()] = flat
    return wire.all_reduce(padded, "backward", what)[:flat.numel()]


def train_rank(rank: int, world: int, config, progress=None) -> dict:
    mesh = DeviceMesh.build(rank, world, pp=config.pp, dp=config.dp, cp=config.cp, ep=config.ep, tp=config.tp)
    tracer = Tracer(rank)
    tp, dp, cp, ep = (Wire.along(mesh, d, tracer) for d in ("tp", "dp", "cp", "ep"))
    shard = SequenceShard(config.seq, mesh.index("cp"), config.cp, mesh.ranks("cp"), tracer) if config.cp > 1 else None
    columns = shard.mine if shard else slice(None)  # this rank's positions of every sequence
    local_seq = config.seq // config.cp
    stage, stages = mesh.index("pp"), mesh.size("pp")
    model = TPDecoder(reference_model(config), tp, stage=stage, stages=stages, ep_wire=ep)
    params = list(model.parameters())
    experts = {id(p) for b in model.blocks for e in getattr(b.ffn, "experts", []) for p in e.parameters()}
    replicated_over_ep = torch.tensor([id(p) not in experts for p in params]).repeat_interleave(
        torch.tensor([p.numel() for p in params]))
    weights = flat_params(model)
    adam, m, v = Adam(config.lr), torch.zeros_like(weights), torch.zeros_like(weights)
    pipe = Pipe(mesh, tracer)
    tracer.align(dist.barrier)  # time zero when every rank holds its shard: the trace is training alone
    losses, activation_bytes = [], 0
    global_tokens = config.batch * config.seq
    for step in range(config.steps):
        mine = tokens(config).tensor_split(config.dp * config.ep)[mesh.index("dp") * config.ep + mesh.index("ep")]
        saved, total = [], 0.0
        memory = SavedActivations(params)
        for j, mb in enumerate(mine.tensor_split(config.microbatches)):
            inputs, targets = mb[:, :-1][:, columns], mb[:, 1:][:, columns]
            shape = (mb.shape[0], local_seq, config.d_model)
            with tracer.span("compute", f"F{j}", kind="F", mb=j):
                x = model.embed(inputs) if model.first else pipe.recv(shape, stage - 1, 2 * j, f"activation {j}").requires_grad_()
                with memory:
                    y = model.run_blocks(x, shard)
                if model.last:
                    loss, _ = model.head_loss(y, targets)
                    y = loss * (targets.numel() / global_tokens)  # this micro-batch's share of the global mean
                    total += y.item()
            if not model.last:
                pipe.send(y.detach(), stage + 1, 2 * j, f"activation {j}")
            saved.append((x, y, shape))
        if step == 0:
            activation_bytes = memory.bytes  # everything GPipe holds at its peak: all micro-batches' blocks
        for j in reversed(range(len(saved))):
            x, y, shape = saved[j]
            with tracer.span("compute", f"B{j}", kind="B", mb=j):
                y.backward() if model.last else y.backward(pipe.recv(shape, stage + 1, 2 * j + 1, f"gradient {j}"))
            if not model.first:
                pipe.send(x.grad, stage - 1, 2 * j + 1, f"gradient {j}")
        grads = torch.cat([p.grad.reshape(-1) for p in params])
        grads = sum_gradients(cp, sum_gradients(dp, grads, "data-parallel gradients"), "context-parallel gradients")
        if ep.n > 1:
            grads[replicated_over_ep] = sum_gradients(ep, grads[replicated_over_ep], "expert-parallel replicated gradients")
        with tracer.span("compute", f"adam {step}", kind="optimizer"):
            adam.update(weights, grads, m, v)
            load_flat(model, weights)
            model.zero_grad(set_to_none=True)
        reported = torch.tensor([total], dtype=torch.float64)
        for dim in ("dp", "cp", "ep"):  # reporting only: the step's loss, on the last stage
            if mesh.size(dim) > 1:
                dist.all_reduce(reported, group=mesh.group(dim))
        losses.append(reported.item())
        if progress and rank == 0:
            progress((step + 1) / config.steps, f"step {step + 1} of {config.steps}")
    n_params = weights.numel()
    moe = [b.ffn.stats for b in model.blocks if hasattr(b.ffn, "stats")]
    return {"rank": rank, "coords": {d: mesh.index(d) for d in ("pp", "dp", "cp", "ep", "tp")}, "last_stage": model.last,
            "losses": losses, "params": {k: p.detach().numpy().copy() for k, p in model.named_parameters()},
            "sources": model.sources(),
            "memory": {"parameters": n_params * 8, "gradients": n_params * 8, "optimizer states": 2 * n_params * 8,
                       "activations": activation_bytes},
            "bytes": {"tp": tp.sent_bytes, "pp": pipe.sent, "cp ring": sum(r["sent_bytes"] for r in shard.ring.log) if shard else 0,
                      "dp gradients": dp.sent_bytes, "cp gradients": cp.sent_bytes,
                      "ep all-to-all": sum(r["sent_bytes"] for r in ep.log if r["name"] in ("dispatch", "combine", "counts")),
                      "ep gradients": sum(r["sent_bytes"] for r in ep.log if r["op"] == "all_reduce")},
            "moe": [dict(s_, layer=i) for i, calls in enumerate(moe) for s_ in calls],
            "replicated_over_ep": int(replicated_over_ep.sum()),
            "flat_numel": n_params, "layers_here": len(model.blocks), "mesh": mesh.describe(), "trace": tracer.payload()}
