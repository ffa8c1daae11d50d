"""parallel.ddp, parallel.zero, parallel.fsdp: the data-parallel family on gloo ranks, all on one workload.

Each run is checked against one process training the whole batch with the same Adam (float64): the loss
of every step and the final parameters. Per rank it reports the memory it actually holds by category,
beside the formula for the strategy (ψ = parameter bytes; our training is float64 with no master copy, so
parameters ψ, gradients ψ, Adam's m and v 2ψ, each divided by n where the strategy shards it), and the
bytes it sent, beside 2ψ(n-1)/n (DDP, ZeRO-1, ZeRO-2) or 3ψ(n-1)/n (ZeRO-3).
"""
from __future__ import annotations

import dataclasses

import torch

from backend.config import Config, setting
from backend.experiments import register
from backend.parallel import ddp, fsdp, zero
from backend.parallel.workload import reference_run
from backend.result import Check, Result


@dataclasses.dataclass
class DPConfig(Config):
    world_size: int = setting(4, min=2, max=8, help="data-parallel ranks n")
    hidden: int = setting(64, min=4, max=1024, help="layer width")
    layers: int = setting(4, min=1, max=16, help="Linear+tanh layers")
    batch: int = setting(32, min=1, max=4096, help="global batch per step (split over ranks)")
    steps: int = setting(5, min=1, max=100, help="training steps")
    lr: float = setting(0.01, min=0.0, max=1.0, help="Adam learning rate")
    seed: int = setting(0, min=0, max=2**31 - 1, help="weights and data")

    def check(self) -> None:
        from backend.config import ConfigError

        if self.batch < self.world_size:
            raise ConfigError("batch", f"{self.batch} is smaller than world_size={self.world_size} (allowed: >= world_size)")


@dataclasses.dataclass
class DDPConfig(DPConfig):
    bucket_kb: int = setting(25, min=1, max=1 << 20, help="bucket size in KiB")
    overlap: bool = setting(True, help="launch each bucket's all-reduce during backward")


@dataclasses.dataclass
class ZeroConfig(DPConfig):
    stage: int = setting(1, min=1, max=3, help="ZeRO stage: 1 optimizer states, 2 and gradients, 3 and parameters")


@dataclasses.dataclass
class FSDPConfig(DPConfig):
    pass


def expected_memory(strategy: str, config, psi_elements: int, param_elements: int, largest_layer: int, item: int) -> dict:
    n = config.world_size
    shard = psi_elements // n
    full = param_elements
    table = {
        "ddp": (full, full, 2 * full), "fsdp": (None, None, None),
        "zero1": (full, full, 2 * shard), "zero2": (full, shard, 2 * shard), "zero3": (shard + largest_layer, shard, 2 * shard),
    }[strategy]
    return {k: (None if e is None else e * item) for k, e in zip(("parameters", "gradients", "optimizer states"), table)}


def make_combine(strategy_of):
    def combine(config, payloads: list[dict]) -> Result:
        strategy = strategy_of(config)
        n = config.world_size
        ref = reference_run(config)
        param_err = max((torch.from_numpy(pl["params"]) - ref["params"]).abs().max().item() for pl in payloads)
        loss_err = max(abs(a - b) for a, b in zip(payloads[0]["losses"], ref["losses"]))
        checks = [Check("final parameters equal one process on the whole batch", param_err, 1e-12,
                        reference="single-process PyTorch, same Adam, float64", detail="max |difference|"),
                  Check("every step's loss equals the reference", loss_err, 1e-12, reference="single-process loss")]
        if "peer_params" in payloads[0]:
            peer_err = max((torch.from_numpy(pl["peer_params"]) - ref["params"]).abs().max().item() for pl in payloads)
            checks.append(Check("torch DistributedDataParallel (the peer) equals the reference too", peer_err, 1e-12,
                                reference="single-process PyTorch"))
        item = 8
        param_elements = payloads[0]["params"].size
        largest = config.hidden * config.hidden + config.hidden
        psi = payloads[0]["psi_bytes"] // item
        memory, volume = [], []
        for pl in payloads:
            want = expected_memory(strategy, config, psi, param_elements, largest, item)
            for cat, got in pl["memory"].items():
                memory.append({"rank": pl["rank"], "category": cat, "measured_bytes": got, "formula_bytes": want.get(cat)})
            if pl["sent"] is not None:
                factor = 3 if strategy == "zero3" else 2
                volume.append({"rank": pl["rank"], "sent_bytes_per_step": pl["sent"] / config.steps,
                               "formula_bytes_per_step": factor * pl["psi_bytes"] * (n - 1) / n,
                               "counted": "ring bytes moved (our send/recv)" if strategy.startswith("zero") else "logical volume of a ring all-reduce"})
        gaps = [abs(r["measured_bytes"] - r["formula_bytes"]) for r in memory if r["formula_bytes"] is not None]
        if gaps:
            checks.append(Check("parameters, gradients and optimizer states held equal the formula", max(gaps), 0,
                                reference="ψ, ψ, 2ψ, divided by n where sharded (padded to a multiple of n)"))
        if volume and strategy.startswith("zero"):
            checks.append(Check("bytes sent per step equal the formula", max(abs(r["sent_bytes_per_step"] - r["formula_bytes_per_step"]) for r in volume), 0,
                                reference="seed 000: 2ψ (ZeRO-1, 2), 3ψ (ZeRO-3), times (n-1)/n"))
        curves = [{"step": i, "loss": l, "run": strategy} for i, l in enumerate(payloads[0]["losses"])] + \
                 [{"step": i, "loss": l, "run": "reference (1 process)"} for i, l in enumerate(ref["losses"])]
        metrics = {"strategy": strategy, "world_size": n, "parameter_bytes": param_elements * item, "psi_padded_bytes": psi * item,
                   "final_loss": payloads[0]["losses"][-1]}
        if "buckets" in payloads[0]:
            metrics["buckets_elements"] = payloads[0]["buckets"]
        return Result(metrics=metrics, checks=checks, tables={"memory": memory, "volume": volume, "loss": curves},
                      trace_events=[e for pl in payloads for e in pl["trace"]["events"]],
                      notes=["Seed 000 counts mixed precision: (2 + 2 + K)ψ with K = 12 (fp32 master, m, v); this workload "
                             "trains in float64 without a master copy, so the same split reads ψ + ψ + 2ψ here."])
    return combine


register("parallel.ddp", DDPConfig, "our DDP (hooks, reverse-order buckets, overlapped async all-reduce) beside torch DDP",
         rank_fn=ddp.run_rank, combine=make_combine(lambda c: "ddp"), lanes=("compute", "collective"))
register("parallel.zero", ZeroConfig, "ZeRO-1/2/3 with Adam over our ring collectives: memory per rank and bytes sent vs 2ψ/2ψ/3ψ",
         rank_fn=zero.run_rank, combine=make_combine(lambda c: f"zero{c.stage}"), lanes=("compute", "collective", "comm"))
register("parallel.fsdp", FSDPConfig, "PyTorch FSDP2 (fully_shard per layer) on the same workload: the peer of our ZeRO-3",
         rank_fn=fsdp.run_rank, combine=make_combine(lambda c: "fsdp"), lanes=("compute",))
