"""(A package, not a module: the experiment registry requires every module here to define an experiment.)
The data-parallel experiments (parallel.ddp, parallel.zero, parallel.fsdp) on either model: `tiny_llama` (the default),
the one model every other parallel page trains, run as a dp-only plan of parallel.mesh (tp = pp = cp = ep = 1, one
micro-batch) through the mesh's own loop and dp strategy (backend/parallel/mesh_dp.py: DDP's buckets overlapping the
backward, ZeRO-1/2/3, ZeRO-Offload, bf16 mixed precision; FSDP2: backend/parallel/fsdp.FullyShardedStages), with torch
DDP as DDP's peer, checked by the mesh's checks: parameters and losses against one float64 process, dp bytes and
memory per rank against the models; or `mlp`, the Linear+tanh workload of backend/parallel/loop.py (older runs, DDP's
simulated slow network, FSDP2's CPUOffloadPolicy)."""
from __future__ import annotations

import dataclasses

import numpy as np

from backend.config import ConfigError, setting
from backend.result import Check, Result, Schema, Shapes

MODELS = ("mlp", "tiny_llama")
LLAMA = "tiny LLaMA"


def model_setting():
    return setting("tiny_llama", choices=MODELS, help="tiny_llama: the one model of the other parallel pages (hidden as "
                   "d_model, layers as blocks, batch as 8-token sequences), trained by the mesh's loop as a dp-only plan; "
                   "mlp: the Linear+tanh workload of the older runs (its slow-network view, FSDP2's CPU offload)")


def mesh_plan(config, dp_strategy: str):
    """The experiment's settings as parallel.mesh's plan: every rank data parallel, the tiny LLaMA d_model = hidden."""
    from backend.experiments.parallel.mesh import MeshConfig

    return MeshConfig(world_size=config.world_size, tp=1, pp=1, microbatches=1, dp_strategy=dp_strategy, layers=config.layers,
                      d_model=config.hidden, batch=config.batch, steps=config.steps, lr=config.lr, seed=config.seed,
                      bucket_kb=getattr(config, "bucket_kb", 4), overlap=getattr(config, "overlap", False),
                      precision=getattr(config, "precision", "fp64"), offload=getattr(config, "offload", False))


def check_plan(config, dp_strategy: str, mlp_only: dict) -> None:
    """With tiny_llama: each MLP-only setting (name: (the value the mesh's loop runs, why)) at that value, and the mesh's
    plan valid; a refusal of the plan names this experiment's own setting (d_model is `hidden` here)."""
    if config.model != "tiny_llama":
        return
    for name, (allowed, why) in mlp_only.items():
        if getattr(config, name) != allowed:
            raise ConfigError(name, f"{getattr(config, name)} with model=tiny_llama: {why} (allowed with tiny_llama: "
                                    f"{str(allowed).lower()}, or model=mlp)")
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
        from backend.parallel.ddp import torch_ddp_peer

        payload["peer_params"] = torch_ddp_peer(plan, rank, world)
    return payload


def peer_check(plan, payloads) -> Check:
    """torch DDP's final weights (every rank's) against one float64 process on the whole batch (torch.optim.Adam)."""
    from backend.parallel.mesh_train import reference_training

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


def combine_mlp(config, reports, peer: str | None = None) -> Result:
    """The MLP loop's result (backend/parallel/reconcile.combine), naming its model as the tiny LLaMA's does."""
    from backend.parallel.reconcile import combine as reconcile

    result = reconcile(config, reports, peer=peer)
    result.metrics["model"] = "mlp"
    return result


def _v1_named_no_model(result: dict) -> None:
    """Version 1 MLP runs did not name their model (the tiny LLaMA's always did)."""
    result["metrics"].setdefault("model", "mlp")


def result_schema() -> Shapes:
    """The keys of parallel.ddp, zero and fsdp, one shape per model: the MLP loop's (combine_mlp) or parallel.mesh's result
    with the strategy, the model and the dp bytes per rank (combine above). Each requires its own keys; the MLP's
    optional ones come with a setting (buckets: DDP; moved bytes and host memory: offload; the error against float64:
    bf16_mixed)."""
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
