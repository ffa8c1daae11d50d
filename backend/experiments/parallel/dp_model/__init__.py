"""(A package, not a module: the experiment registry requires every module here to define an experiment.)
The data-parallel experiments (parallel.ddp, parallel.zero, parallel.fsdp) on the tiny LLaMA, the one model every other
parallel page trains, run as a dp-only plan of parallel.mesh (tp = pp = cp = ep = 1, one micro-batch) through the mesh's
own loop and dp strategy (backend/parallel/mesh_dp.py: DDP's buckets overlapping the backward and its simulated slow
link, ZeRO-1/2/3, ZeRO-Offload, bf16 mixed precision; FSDP2 and its CPUOffloadPolicy:
backend/parallel/fsdp.FullyShardedStages), with torch DDP as DDP's peer, checked by the mesh's checks: parameters and
losses against one float64 process, dp bytes and memory per rank against the models. The Linear+tanh MLP these pages
once trained is retired: `model=mlp` is refused by name, and runs stored with it still open (result_schema)."""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

from backend.config import Config, ConfigError, setting
from backend.result import Check, Result, Schema, Shapes

LLAMA = "tiny LLaMA"


@dataclasses.dataclass
class DPConfig(Config):
    """The settings every data-parallel experiment shares: the tiny LLaMA's shape (the names the MLP had, so old links
    keep their values) and the rank count."""

    world_size: int = setting(4, min=2, max=8, help="data-parallel ranks n")
    hidden: int = setting(64, min=4, max=1024, help="the tiny LLaMA's d_model")
    layers: int = setting(4, min=1, max=16, help="decoder blocks")
    batch: int = setting(32, min=1, max=4096, help="global batch per step, split over ranks: 8-token sequences")
    steps: int = setting(5, min=1, max=100, help="training steps")
    lr: float = setting(0.01, min=0.0, max=1.0, help="Adam learning rate")
    seed: int = setting(0, min=0, max=2**31 - 1, help="weights and data")
    model: str = setting("tiny_llama", choices=("tiny_llama",), help="the one model of the parallel pages (the older "
                         "Linear+tanh MLP is retired; its stored runs still open)")

    cost_drivers = ("batch", "hidden", "steps", "layers", "world_size")

    def check(self) -> None:
        if self.batch < self.world_size:
            raise ConfigError("batch", f"{self.batch} is smaller than world_size={self.world_size} (allowed: >= world_size)")


def mesh_plan(config, dp_strategy: str):
    """The experiment's settings as parallel.mesh's plan: every rank data parallel, the tiny LLaMA d_model = hidden."""
    from backend.experiments.parallel.mesh import MeshConfig

    return MeshConfig(world_size=config.world_size, tp=1, pp=1, microbatches=1, dp_strategy=dp_strategy, layers=config.layers,
                      d_model=config.hidden, batch=config.batch, steps=config.steps, lr=config.lr, seed=config.seed,
                      bucket_kb=getattr(config, "bucket_kb", 4), overlap=getattr(config, "overlap", False),
                      precision=getattr(config, "precision", "fp64"), offload=getattr(config, "offload", False),
                      comm_delay_ms=getattr(config, "comm_delay_ms", 0))


def check_plan(config, dp_strategy: str) -> None:
    """The mesh's plan valid; a refusal of the plan names this experiment's own setting (d_model is `hidden` here)."""
    try:
        mesh_plan(config, dp_strategy).validate()
    except ConfigError as err:
        raise ConfigError("hidden" if err.field == "d_model" else err.field, str(err).split(": ", 1)[-1]) from None


def run_rank(rank, world, config, ctx, dp_strategy: str, peer: bool = False):
    """This rank's mesh run of the plan; `peer`: then torch's DistributedDataParallel on the same model and batch."""
    from backend.experiments.parallel import mesh

    plan = mesh_plan(config, dp_strategy)
    payload = mesh.run_rank(rank, world, plan, ctx)
    if peer:
        payload["peer_params"] = torch_ddp_peer(plan, rank, world)
    return payload


def torch_ddp_peer(config, rank: int, world: int) -> dict:
    """torch's DistributedDataParallel training the tiny LLaMA of a dp-only mesh plan (`config`, a MeshConfig) in
    float64: this rank's slice of the global batch (tensor_split over the ranks, as the mesh cuts it), torch.optim.Adam,
    the reference's initial weights. DDP averages the gradients over the ranks, so the local mean loss is weighted by
    the slice's share of the batch times the rank count. Returns the final weights by state_dict name, in float64."""
    from torch.nn.parallel import DistributedDataParallel

    from backend.parallel.tp_model import reference_model, tokens

    class Loss(torch.nn.Module):  # DDP's reducer syncs only a backward that followed a forward through the wrapper
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, batch):
            return self.model.loss(batch)

    model = reference_model(config)
    ddp = DistributedDataParallel(Loss(model), bucket_cap_mb=config.bucket_kb / 1024)
    opt = torch.optim.Adam(model.parameters(), lr=config.lr, foreach=False)
    mine = tokens(config).tensor_split(world)[rank]
    for _ in range(config.steps):
        opt.zero_grad()
        (ddp(mine) * (mine.shape[0] / config.batch * world)).backward()
        opt.step()
    return {k: v.detach().double().numpy().copy() for k, v in model.state_dict().items()}


def peer_check(plan, payloads) -> Check:
    """torch DDP's final weights (every rank's) against one float64 process on the whole batch (torch.optim.Adam)."""
    from backend.experiments.parallel._reference import reference_training

    ref = reference_training(dataclasses.replace(plan, precision="fp64"))["state"]
    error = max(float(np.abs(p["peer_params"][k] - ref[k].numpy()).max()) for p in payloads for k in ref)
    return Check("torch DistributedDataParallel (the peer) on the same model equals one process", error, 1e-9,
                 reference="single-process PyTorch, float64, torch.optim.Adam on the whole batch",
                 detail="max |difference| over every rank's parameters; the peer runs float64 whatever the run's precision")


def combine(config, payloads, dp_strategy: str, label: str) -> Result:
    """The mesh's result, with what the data-parallel page reads: the strategy and model, and the dp bytes per rank
    (sent on our ring, against the mesh's byte model)."""
    from backend.experiments.parallel import mesh

    plan = mesh_plan(config, dp_strategy)
    result = mesh.combine(plan, payloads)
    if all("peer_params" in p for p in payloads):
        result.checks.append(peer_check(plan, payloads))
    name = f"{label} · {LLAMA}"
    result.metrics.update({"strategy": name, "model": "tiny_llama", "world_size": config.world_size})
    for row in result.tables["loss"]:
        if not row["run"].startswith("reference"):
            row["run"] = name
    result.tables["volume"] = [{"rank": p["rank"], "sent_bytes": p["bytes"]["dp gradients"],
                                "formula_bytes": mesh.predicted_bytes(plan, p, [])["dp gradients"],
                                "counted": "our ring's send/recv, whole run"} for p in payloads]
    result.notes.append(f"The {LLAMA} (d_model {plan.d_model}, {plan.layers} blocks, {plan.batch} sequences of {plan.seq} "
                        f"tokens) trained by parallel.mesh's loop with tp = pp = cp = ep = 1: every rank data parallel. Bytes are the "
                        "whole run's (ZeRO-3 and FSDP2 add one all-gather at the end to report the weights).")
    return result


def _v1_named_no_model(result: dict) -> None:
    """Version 1 MLP runs did not name their model (the tiny LLaMA's always did)."""
    result["metrics"].setdefault("model", "mlp")


def result_schema() -> Shapes:
    """The keys of parallel.ddp, zero and fsdp, one shape per model: parallel.mesh's result with the strategy, the model and
    the dp bytes per rank (combine above), or the retired MLP loop's, kept so its stored runs still open (its optional
    keys came with a setting: buckets: DDP; moved bytes and host memory: offload; the error against float64: bf16_mixed)."""
    from backend.experiments.parallel import mesh

    named = ("model", "strategy", "world_size")
    version = dict(version=2, upgrades={1: _v1_named_no_model})
    mlp_optional = ("buckets_elements", "moved_device_to_host_bytes_per_step", "moved_host_to_device_bytes_per_step",
                    "host_bytes", "relative_error_vs_float64")
    mlp = Schema(metrics=(*named, "parameter_bytes", "psi_padded_bytes", "final_loss", *mlp_optional),
                 tables={"memory": ("rank", "pool", "category", "measured_bytes", "formula_bytes"),
                         "volume": ("rank", "sent_bytes_per_step", "formula_bytes_per_step", "counted"),
                         "loss": ("step", "loss", "run"),
                         "moved": ("rank", "direction", "measured_bytes_per_step", "formula_bytes_per_step")},  # empty: no offload
                 optional=mlp_optional, **version)
    llama = Schema(metrics=(*named, *mesh.RESULT.metrics),
                   tables={**mesh.RESULT.tables, "volume": ("rank", "sent_bytes", "formula_bytes", "counted")},
                   optional=mesh.RESULT.optional, **version)
    return Shapes(by="model", shapes={"mlp": mlp, "tiny_llama": llama})
