"""parallel.dp_ps: parameter servers (seeds 000 and 002) training the tiny LLaMA, push and pull over our P2P: workers
push gradients, a server updates the weights and returns them. Not SPMD, so not a transform of the mesh: the
strategy, its settings and its checks are this one file.
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

import dataclasses
import time

import torch
import torch.distributed as dist

from backend.comm.p2p import P2P, Transfer
from backend.config import ConfigError, setting
from backend.limits import with_wait
from backend.experiments import define
from backend.experiments.parallel import dp_model
from backend.experiments.parallel._reference import reference_training
from backend.parallel.precision import Adam, flat_params, load_flat
from backend.parallel.tp_model import reference_model, tokens
from backend.result import Check, Result, Schema
from backend.trace import Tracer


@dataclasses.dataclass
class PSConfig(dp_model.DPConfig):
    mode: str = setting("sync", choices=("sync", "async", "stale"), help="synchronous, asynchronous, or bounded staleness")
    staleness: int = setting(1, min=0, max=16, help="stale mode: how many pushes a worker may run ahead of the slowest")
    server: str = setting("dedicated", choices=("rank0", "dedicated"), help="rank 0 also works (seed's GPU0 DP), or only serves")
    straggler_ms: int = setting(0, min=0, max=1000, help="extra time per step on the last worker")

    cost_drivers = ("straggler_ms",) + dp_model.DPConfig.cost_drivers

    def estimate(self):
        """The mesh plan's (the same model, ranks and steps; its reference is the sync check's), plus the straggler's
        wait on every step."""
        return with_wait(shape_plan(self).estimate(), 2 * self.steps * self.straggler_ms / 1000)

    def check(self) -> None:
        super().check()
        if self.server == "rank0" and self.mode != "sync":
            raise ConfigError("mode", f"{self.mode!r} needs server=dedicated (allowed with server=rank0: sync, seed 000's DP)")
        dp_model.check_plan(self, "allreduce")


def shape_plan(config: PSConfig):
    """The tiny LLaMA's shape and tokens, as the data-parallel pages' dp-only mesh plan holds them."""
    return dp_model.mesh_plan(config, "allreduce")


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


def run_rank(rank: int, world: int, config: PSConfig, ctx) -> dict:
    """Rank `rank`'s part: the server (rank 0, which also works under server=rank0) or a worker."""
    plan = shape_plan(config)
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


def sync_error(plan, params) -> float:
    """Largest |difference| between the server's flat parameters and one float64 process training the whole batch
    with torch.optim.Adam (_reference.reference_training, the mesh's own reference), parameter by parameter."""
    ref, model = reference_training(plan)["state"], reference_model(plan)
    load_flat(model, torch.from_numpy(params))
    return max((p.detach() - ref[name]).abs().max().item() for name, p in model.named_parameters())


def combine_ps(config, plan, payloads: list[dict]) -> Result:
    torch.set_num_threads(1)  # the reference or replay: a tiny model's ops are too small to split (as the mesh's)
    n, server = config.world_size, payloads[0]
    P, workers = server["params"].size, len(worker_ranks(config, n))
    checks, notes = [], []
    if config.mode == "sync":
        checks.append(Check("synchronous server's parameters equal one process on the whole batch",
                            sync_error(plan, server["params"]), 1e-9,
                            reference="single-process PyTorch, float64, torch.optim.Adam on the whole batch "
                                      "(the mesh's reference)"))
    else:
        # What asynchronous updates must satisfy is not a convergence speed but their semantics: every gradient
        # applied exactly once, each computed on the parameter version it says, in the order the server applied them.
        # Replaying that sequence in one process must give the server's parameters exactly.
        replayed = replay_updates(config, plan, server["updates"])
        err = (torch.from_numpy(server["params"]) - replayed).abs().max().item()
        checks.append(Check("the server's parameters equal a one-process replay of its update log", err, 1e-12,
                            reference="one process: each logged gradient recomputed on the version it was based on, "
                                      "Adam applied in the server's order"))
        applied = sorted((u["worker"], u["step"]) for u in server["updates"])
        expected = sorted((w, s) for w in worker_ranks(config, n) for s in range(config.steps))
        checks.append(Check("every worker's gradient of every step applied exactly once", int(applied != expected), 0,
                            reference="workers × steps", detail=f"{len(applied)} updates"))
        first, last = server["eval"][0]["loss"], server["eval"][-1]["loss"]
        notes.append(f"Loss on the global batch {first:.4f} after the first update, {last:.4f} after the last.")
        stale = [u["staleness"] for u in server["updates"]]
        if config.mode == "stale":
            bound = (workers - 1) * (config.staleness + 1)
            checks.append(Check("bounded staleness holds: no gradient older than (W-1)(s+1) updates",
                                max(0, max(stale) - bound), 0, reference="the stale-synchronous bound",
                                detail=f"max staleness {max(stale)}, bound {bound}"))
        notes.append(f"Staleness over {len(stale)} updates: mean {sum(stale) / len(stale):.2f}, max {max(stale)}.")
    if config.server == "rank0":
        formula = (n - 1) * P * 8 * config.steps
        checks.append(Check("rank 0 receives (n-1)ψ and sends (n-1)ψ per step (seed 000's DP)",
                            abs(server["recv"] - formula) + abs(server["sent"] - formula), 0, reference="seed 000",
                            detail="bytes counted by our send/recv on the wire"))
    sent, received = sum(pl["sent"] for pl in payloads), sum(pl["recv"] for pl in payloads)
    checks.append(Check("every byte a rank sent another received (each side logged by its own send/recv)",
                        abs(sent - received), 0, reference="conservation over the wire", detail=f"{sent:,} B sent"))
    volume = [{"rank": pl["rank"], "sent_bytes": pl["sent"], "recv_bytes": pl["recv"]} for pl in payloads]
    return Result(metrics={"strategy": f"parameter server ({config.mode}, {config.server})", "world_size": n,
                           "workers": workers, "final_eval_loss": server["eval"][-1]["loss"],
                           "updates": len(server["eval"])},
                  checks=checks, notes=notes,
                  tables={"staleness": server["updates"], "eval": server["eval"], "volume": volume},
                  trace_events=[e for pl in payloads for e in pl["trace"]["events"]])


def replay_updates(config, plan, updates: list[dict]) -> torch.Tensor:
    """One process replays the server's log: update k applies the gradient worker w computed for its step on the
    parameters of version `based_on`, with the same Adam, in the logged order."""
    ranks = worker_ranks(config, config.world_size)
    model = reference_model(plan)
    flat = flat_params(model)
    m, v, adam = torch.zeros_like(flat), torch.zeros_like(flat), Adam(config.lr)
    versions = [flat.clone()]
    for u in updates:
        grad = worker_gradient(model, versions[u["based_on"]], plan, ranks.index(u["worker"]), len(ranks))
        adam.update(flat, grad, m, v)
        versions.append(flat.clone())
    return flat


RESULT = Schema(
    metrics=("strategy", "world_size", "workers", "final_eval_loss", "updates"),
    tables={"staleness": ("update", "worker", "step", "based_on", "staleness"), "eval": ("update", "loss"),
            "volume": ("rank", "sent_bytes", "recv_bytes")},
)

EXPERIMENT = define(__name__, PSConfig, "parameter servers training the tiny LLaMA: rank 0 or dedicated; synchronous, "
                    "asynchronous, bounded staleness", rank_fn=run_rank,
                    combine=lambda config, payloads: combine_ps(config, shape_plan(config), payloads),
                    lanes=("compute", "collective", "send", "recv"), schema=RESULT)
