"""Parameter servers (seeds 000 and 002): workers push gradients, a server updates the weights and returns them.
  server rank0      rank 0 works and serves (seed 000's DP on GPU0): it gathers every gradient, updates, broadcasts
                    the parameters; it receives (n-1)ψ and sends (n-1)ψ per step
  server dedicated  rank 0 only serves (the CPU parameter server); ranks 1..n-1 work
  mode sync         the server waits for every worker's gradient of the step, sums them, updates once
  mode async        each gradient applied as it arrives, the newest weights sent back; one computed on version v and
                    applied at version V has staleness V - v
  mode stale        bounded staleness: as async, but a worker more than `staleness` pushes ahead of the slowest is not
                    answered until the slowest catches up
The model: the tiny LLaMA of a dp-only mesh `plan`, float64, one flat vector on the wire (precision.flat_params order);
each worker's mean loss is weighted by its slice's share of the batch, so the workers' sum is the whole batch's.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from backend.comm.p2p import P2P, Transfer
from backend.parallel.tp_model import reference_model, tokens
from backend.parallel.precision import Adam, flat_params, load_flat
from backend.trace import Tracer


def worker_gradient(model, flat, plan, worker: int, workers: int) -> torch.Tensor:
    """The flat gradient of worker `worker`'s slice of the batch (tensor_split over the workers) at weights `flat`."""
    load_flat(model, flat)
    mine = tokens(plan).tensor_split(workers)[worker]
    model.zero_grad(set_to_none=True)
    (model.loss(mine) * (mine.shape[0] / plan.batch)).backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def worker_ranks(config, world: int) -> list[int]:
    """The ranks that compute gradients: all of them, or all but rank 0 (a dedicated server)."""
    return list(range(1, world)) if config.server == "dedicated" else list(range(world))


def _push(comm: P2P, tag: str, version: int, flat: torch.Tensor, to: int) -> None:
    """One versioned message, [version, *flat], to rank `to`; returns once it is sent."""
    msg = torch.cat([torch.tensor([float(version)], dtype=flat.dtype), flat])
    comm.post(tag, sends=[Transfer(msg, to, [comm.rank])])[0].wait()


def _batch_loss(model, flat, plan) -> float:
    """The loss on the whole global batch at weights `flat` (every step trains on it: the held-in loss)."""
    load_flat(model, flat)
    with torch.no_grad():
        return model.loss(tokens(plan)).item()


def run_rank(rank: int, world: int, config, plan, ctx) -> dict:
    tracer = Tracer(rank)
    tracer.align(dist.barrier)
    model = reference_model(plan)
    flat = flat_params(model)
    out = {"rank": rank, "trace": tracer.payload(), "sent": 0, "recv": 0, "updates": [], "eval": []}
    comm = P2P(rank, world, tracer)  # every message through our logged send/recv: the bytes on the wire counted there
    if config.server == "rank0" and config.mode == "sync":
        m, v, adam = torch.zeros_like(flat), torch.zeros_like(flat), Adam(config.lr)
        for step in range(config.steps):
            with tracer.span("compute", f"grad {step}"):
                g = worker_gradient(model, flat, plan, rank, world)
            if rank == 0:
                grads = [torch.empty_like(g) for _ in range(world - 1)]
                comm.exchange(step, "gather grads", recvs=[Transfer(t, w, [w]) for w, t in enumerate(grads, start=1)])
                with tracer.span("compute", f"update {step}", kind="optimizer"):
                    adam.update(flat, g + torch.stack(grads).sum(0), m, v)
                out["eval"].append({"update": step, "loss": _batch_loss(model, flat, plan)})
                comm.exchange(step, "send params", sends=[Transfer(flat, w, [0]) for w in range(1, world)])
            else:
                comm.exchange(step, "gather grads", sends=[Transfer(g, 0, [rank])])
                comm.exchange(step, "send params", recvs=[Transfer(flat, 0, [0])])
        out["params"] = flat.numpy().copy()
    else:
        workers = worker_ranks(config, world)
        if rank == 0:
            _serve(config, plan, model, flat, workers, comm, out, ctx)
        else:
            _work(config, plan, model, flat, workers, comm, out)
    out["sent"], out["recv"], out["trace"] = comm.bytes_sent, comm.bytes_recv, tracer.payload()
    return out


def _serve(config, plan, model, flat, workers, comm, out, ctx):
    P, tracer = flat.numel(), comm.tracer
    m, v, adam = torch.zeros_like(flat), torch.zeros_like(flat), Adam(config.lr)
    version, clocks, held, pending_sum = 0, {w: 0 for w in workers}, [], []
    msg = torch.empty(P + 1, dtype=flat.dtype)

    def reply(w):
        with tracer.span("send", f"params v{version} to {w}"):
            _push(comm, "params", version, flat, w)

    for w in workers:
        reply(w)
    total = len(workers) * config.steps
    for received in range(total):
        with tracer.span("recv", "gradient"):
            sender = comm.recv_any(msg, "gradient")
        based_on, grad = int(msg[0].item()), msg[1:].clone()
        clocks[sender] += 1
        if config.mode == "sync":
            pending_sum.append(grad)
            if len(pending_sum) == len(workers):
                with tracer.span("compute", f"update {version}"):
                    adam.update(flat, torch.stack(pending_sum).sum(0), m, v)
                version += 1
                pending_sum.clear()
                out["eval"].append({"update": version, "loss": _batch_loss(model, flat, plan)})
                for w in workers:
                    if clocks[w] < config.steps:
                        reply(w)
            continue
        with tracer.span("compute", f"update {version}"):
            adam.update(flat, grad, m, v)
        out["updates"].append({"update": version, "worker": sender, "step": clocks[sender] - 1, "based_on": based_on,
                               "staleness": version - based_on})
        version += 1
        out["eval"].append({"update": version, "loss": _batch_loss(model, flat, plan)})
        held.append(sender)
        slowest = min(clocks.values())
        for w in list(held):  # answer every worker that may go on: all of them (async), or within the bound (stale)
            if clocks[w] >= config.steps:
                held.remove(w)
            elif config.mode == "async" or clocks[w] - slowest <= config.staleness:
                held.remove(w)
                reply(w)
        if received % 10 == 0:
            ctx.progress(received / total, f"{received} gradients applied")
    out["params"] = flat.numpy().copy()


def _work(config, plan, model, flat, workers, comm, out):
    msg, tracer, rank = torch.empty(flat.numel() + 1, dtype=flat.dtype), comm.tracer, comm.rank
    for step in range(config.steps):
        with tracer.span("recv", f"params {step}"):
            comm.post("params", recvs=[Transfer(msg, 0, [0])])[0].wait()
        version, params = msg[0].item(), msg[1:].clone()
        with tracer.span("compute", f"grad {step}"):
            g = worker_gradient(model, params, plan, workers.index(rank), len(workers))
            if rank == workers[-1] and config.straggler_ms:  # a slow worker, to see staleness grow
                time.sleep(config.straggler_ms / 1000)
        with tracer.span("send", f"grad {step}"):
            _push(comm, "gradient", version, g, 0)
