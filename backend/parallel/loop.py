"""One training loop for every SPMD data-parallel strategy, picotron's shape: the loop owns the steps, the
data slice and the loss bookkeeping; a strategy owns what differs (how the model is held, how gradients
are synchronised, how the optimizer steps) through a few hooks:

    setup(model)                    wrap or shard the model; create optimizer state
    forward_backward(xs, ys, step)  -> (local loss, activation bytes saved); the default is plain autograd
                                    through forward(x), the model itself unless a strategy wraps it
    after_backward(step)            synchronise gradients (all-reduce, reduce-scatter, ...)
    optimizer_step(step)            update what this rank owns (and gather what it needs next step)
    memory()                        bytes held per category after the first step (on the device)
    host_memory()                   bytes held per category in the host pool (CPU offload; none by default)
    final_params()                  the full flat parameters (for the check; after the bytes are counted)

Each rank's data is its dp slice of the global batch (`mesh`), and every rank returns a typed RankReport.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from backend.parallel.mesh import DeviceMesh
from backend.parallel.workload import FP64, Precision, Workload, activation_bytes, batch, local_slice, loss_fn, make_model
from backend.trace import Tracer


@dataclass
class RankReport:
    """What one rank measured in a training run."""
    rank: int
    strategy: str
    losses: list[float]          # the global loss of every step (summed over the dp group)
    params: np.ndarray           # final full flat parameters, float64
    memory: dict[str, int]       # bytes held after the first step: parameters, gradients, optimizer states, activations
    psi_bytes: int               # the (padded) flat parameter vector's bytes in the compute dtype: seed 000's ψ
    sent_bytes: int | None       # bytes this rank put on the wire for gradient/parameter sync; None: not counted by us
    precision: str = "fp64"
    trace: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)  # strategy-specific measurements (bucket sizes, ...)
    host_memory: dict[str, int] = field(default_factory=dict)  # bytes held in the host pool after the first step (offload)


class Strategy:
    """The default hooks: every rank holds the whole model and does nothing to synchronise (one rank trains alone)."""

    name = "single"
    loss_multiplier = 1  # strategies built on torch's averaging collectives (DDP, FSDP2) scale the local loss by n

    def __init__(self, workload: Workload, mesh: DeviceMesh, tracer: Tracer, precision: Precision = FP64):
        self.workload, self.mesh, self.tracer, self.precision = workload, mesh, tracer, precision
        self.rank, self.world = mesh.index("dp"), mesh.size("dp")
        self.model: torch.nn.Module | None = None

    def setup(self, model: torch.nn.Module) -> None:
        self.model = model.to(self.precision.compute)

    def before_forward(self, step: int) -> None:
        pass

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def forward_backward(self, xs: torch.Tensor, ys: torch.Tensor, step: int) -> tuple[torch.Tensor, int]:
        w, p = self.workload, self.precision
        self.model.zero_grad(set_to_none=True)
        with self.tracer.span("compute", f"forward {step}", kind="forward"):
            out, act = activation_bytes(lambda: self.forward(xs.to(p.compute)))
            loss = loss_fn(w, out.to(p.master), ys.to(p.master))
        with self.tracer.span("compute", f"backward {step}", kind="backward"):
            (loss * self.loss_multiplier).backward()
        return loss, act

    def after_backward(self, step: int) -> None:
        pass

    def optimizer_step(self, step: int) -> None:
        raise NotImplementedError

    def memory(self) -> dict[str, int]:
        raise NotImplementedError

    def host_memory(self) -> dict[str, int]:
        return {}

    def sent_bytes(self) -> int | None:
        return None

    def final_params(self) -> torch.Tensor:
        raise NotImplementedError

    def psi_bytes(self) -> int:
        return sum(p.numel() for p in self.model.parameters()) * self.precision.item("compute")

    def extra(self) -> dict:
        return {}

    def checkpoint_state(self) -> dict:
        """What a checkpoint holds of this rank's model and optimizer (backend/parallel/checkpoint.py): tensors
        that alias the strategy's own, so DCP's load writes into them."""
        raise NotImplementedError(f"{self.name} has no checkpoint state")

    def load_checkpoint_state(self, state: dict) -> None:
        """After DCP loaded `state` (from checkpoint_state()): restore what is not an aliased tensor."""


def start_rank(rank: int, world_size: int, **mesh_sizes: int) -> tuple[DeviceMesh, Tracer]:
    """This rank's mesh (all ranks data parallel unless sizes say otherwise) and a tracer aligned across ranks."""
    mesh = DeviceMesh.build(rank, world_size, **(mesh_sizes or {"dp": world_size}))
    tracer = Tracer(rank)
    tracer.align(dist.barrier)
    return mesh, tracer


def train(strategy: Strategy, progress=None, checkpoint=None, fault=None) -> RankReport:
    """Run the workload's steps under `strategy`; returns this rank's report. With a `checkpoint`
    (checkpoint.Checkpointer) it resumes from the newest checkpoint and saves every N steps, the step, the
    losses so far and the random state with the model; `fault(step)` runs mid-step, after the backward."""
    w, mesh, tracer = strategy.workload, strategy.mesh, strategy.tracer
    strategy.setup(make_model(w))
    state = {"loop.step": torch.tensor(0), "loop.losses": torch.zeros(w.steps, dtype=torch.float64),
             f"rng.{mesh.rank}": torch.get_rng_state()}
    start = checkpoint.resume(strategy, state) if checkpoint else 0
    torch.set_rng_state(state[f"rng.{mesh.rank}"])
    losses, memory, host = state["loop.losses"][:start].tolist(), {}, {}
    for step in range(start, w.steps):
        x, y = batch(w, step)
        xs, ys = (local_slice(t, mesh.index("dp"), mesh.size("dp")) for t in (x, y))
        strategy.before_forward(step)
        loss, activations = strategy.forward_backward(xs, ys, step)
        if fault:
            fault(step)
        strategy.after_backward(step)
        with tracer.span("compute", f"adam {step}", kind="optimizer"):
            strategy.optimizer_step(step)
        total = torch.tensor([loss.item()], dtype=torch.float64)
        if mesh.size("dp") > 1:
            dist.all_reduce(total, group=mesh.group("dp"))
        losses.append(total.item())
        if checkpoint:
            state["loop.step"].fill_(step + 1)
            state["loop.losses"][step] = total.item()
            state[f"rng.{mesh.rank}"] = torch.get_rng_state()
            checkpoint.after_step(step, strategy, state)
        if step == start:
            memory, host = {**strategy.memory(), "activations": activations}, strategy.host_memory()
        if progress and mesh.rank == 0:
            progress((step + 1) / w.steps, f"step {step + 1} of {w.steps}")
    if checkpoint:
        checkpoint.finish()  # an async save still writing
    sent = strategy.sent_bytes()  # before final_params, whose gather is reporting, not training
    return RankReport(rank=mesh.rank, strategy=strategy.name, losses=losses,
                      params=strategy.final_params().double().numpy().copy(), memory=memory,
                      psi_bytes=strategy.psi_bytes(), sent_bytes=sent,
                      precision="bf16_mixed" if strategy.precision.mixed else "fp64",
                      trace=tracer.payload(), extra=strategy.extra(), host_memory=host)
