"""3D parallel: the tiny LLaMA trained on a pp x dp x tp mesh (seed 002: "pipeline, then tensor, then data
parallel, together").

Each rank is pipeline stage mesh.index("pp") (its share of the blocks; the embedding on the first stage, the
head and loss on the last), holds the tensor-parallel shard mesh.index("tp") of every weight there
(backend/parallel/tp.py), and trains on data-parallel slice mesh.index("dp") of every step's batch:
  forward   micro-batch by micro-batch (GPipe: all forwards, then all backwards), activations sent to the
            same (dp, tp) coordinate of the next stage; within a stage, TP's f/g all-reduces
  backward  input gradients sent back stage to stage
  sync      the gradients all-reduced over dp (one flat ring all-reduce), then Adam on the local shard
Each micro-batch's mean loss is weighted by its share of the global batch's tokens, so the gradients summed
over micro-batches and dp ranks are those of one process on the whole batch, and Adam, elementwise, updates
each shard exactly as it updates those elements of the full tensor.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from backend.parallel.mesh import DeviceMesh
from backend.parallel.sp import SavedActivations
from backend.parallel.tp import TPDecoder
from backend.parallel.tp_model import reference_model, tokens
from backend.parallel.wire import Wire
from backend.trace import Tracer


def reference_training(config) -> dict:
    """One process, the whole batch, the same Adam: losses per step and the final weights. Every step sees the
    same batch (random tokens have nothing else to learn), so the loss must fall as the model memorises it."""
    model = reference_model(config)
    opt = torch.optim.Adam(model.parameters(), lr=config.lr)
    losses = []
    for step in range(config.steps):
        opt.zero_grad()
        loss = model.loss(tokens(config))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "state": {k: v.detach() for k, v in model.state_dict().items()}}


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


def train_rank(rank: int, world: int, config, progress=None) -> dict:
    mesh = DeviceMesh.build(rank, world, pp=config.pp, dp=config.dp, tp=config.tp)
    tracer = Tracer(rank)
    tp, dp = Wire.along(mesh, "tp", tracer), Wire.along(mesh, "dp", tracer)
    stage, stages = mesh.index("pp"), mesh.size("pp")
    model = TPDecoder(reference_model(config), tp, stage=stage, stages=stages)
    opt = torch.optim.Adam(model.parameters(), lr=config.lr)
    pipe = Pipe(mesh, tracer)
    tracer.align(dist.barrier)  # time zero when every rank holds its shard: the trace is training alone
    losses, activation_bytes = [], 0
    global_tokens = config.batch * config.seq
    for step in range(config.steps):
        mine = tokens(config).tensor_split(config.dp)[mesh.index("dp")]
        saved, total = [], 0.0
        memory = SavedActivations(model.parameters())
        for j, mb in enumerate(mine.tensor_split(config.microbatches)):
            shape = (mb.shape[0], config.seq, config.d_model)
            with tracer.span("compute", f"F{j}", kind="F", mb=j):
                x = model.embed(mb[:, :-1]) if model.first else pipe.recv(shape, stage - 1, 2 * j, f"activation {j}").requires_grad_()
                with memory:
                    y = model.run_blocks(x)
                if model.last:
                    loss, _ = model.head_loss(y, mb[:, 1:])
                    y = loss * (mb[:, 1:].numel() / global_tokens)  # this micro-batch's share of the global mean
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
        params = list(model.parameters())
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        padded = torch.zeros(-(-flat.numel() // config.dp) * config.dp, dtype=flat.dtype)  # even ring chunks
        padded[:flat.numel()] = flat
        summed = dp.all_reduce(padded, "backward", "data-parallel gradients")[:flat.numel()]
        offset = 0
        for p in params:
            p.grad.copy_(summed[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        with tracer.span("compute", f"adam {step}", kind="optimizer"):
            opt.step()
            opt.zero_grad()
        reported = torch.tensor([total], dtype=torch.float64)
        if config.dp > 1:
            dist.all_reduce(reported, group=mesh.group("dp"))  # reporting only: the step's loss on the last stage
        losses.append(reported.item())
        if progress and rank == 0:
            progress((step + 1) / config.steps, f"step {step + 1} of {config.steps}")
    n_params = sum(p.numel() for p in model.parameters())
    return {"rank": rank, "coords": {d: mesh.index(d) for d in ("pp", "dp", "tp")}, "last_stage": model.last,
            "losses": losses, "params": {k: p.detach().numpy().copy() for k, p in model.named_parameters()},
            "sources": model.sources(),
            "memory": {"parameters": n_params * 8, "gradients": n_params * 8, "optimizer states": 2 * n_params * 8,
                       "activations": activation_bytes},
            "bytes": {"tp": tp.sent_bytes, "pp": pipe.sent, "dp": dp.sent_bytes}, "flat_numel": flat.numel(),
            "layers_here": len(model.blocks), "mesh": mesh.describe(), "trace": tracer.payload()}

