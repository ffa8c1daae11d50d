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
from backend.parallel import ddp, dp_ps, fsdp, zero
from backend.parallel.workload import reference_run, reference_run_mixed
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
    comm_delay_ms: int = setting(0, min=0, max=1000, help="simulated slow network: extra time per bucket all-reduce")


@dataclasses.dataclass
class ZeroConfig(DPConfig):
    stage: int = setting(1, min=1, max=3, help="ZeRO stage: 1 optimizer states, 2 and gradients, 3 and parameters")
    precision: str = setting("fp64", choices=("fp64", "bf16_mixed"),
                             help="fp64 throughout, or bf16 compute with fp32 master weights and Adam states (stages 1, 2)")

    def check(self) -> None:
        from backend.config import ConfigError

        super().check()
        if self.precision == "bf16_mixed" and self.stage == 3:
            raise ConfigError("precision", "bf16_mixed is built for stages 1 and 2 (allowed with stage=3: fp64)")


@dataclasses.dataclass
class FSDPConfig(DPConfig):
    pass


@dataclasses.dataclass
class PSConfig(DPConfig):
    mode: str = setting("sync", choices=("sync", "async", "stale"), help="synchronous, asynchronous, or bounded staleness")
    staleness: int = setting(1, min=0, max=16, help="stale mode: how many pushes a worker may run ahead of the slowest")
    server: str = setting("dedicated", choices=("rank0", "dedicated"), help="rank 0 also works (seed's GPU0 DP), or only serves")
    straggler_ms: int = setting(0, min=0, max=1000, help="extra time per step on the last worker")

    def check(self) -> None:
        from backend.config import ConfigError

        super().check()
        if self.server == "rank0" and self.mode != "sync":
            raise ConfigError("mode", f"{self.mode!r} needs server=dedicated (allowed with server=rank0: sync, seed 000's DP)")


def fsdp_local_elements(config, rank: int) -> int:
    """FSDP2 shards every parameter along dim 0 as torch.chunk does: ceil(rows / n) rows per rank, fewer or none last."""
    n, h = config.world_size, config.hidden
    rows_per = -(-h // n)
    rows = max(0, min(rows_per, h - rank * rows_per))
    return config.layers * (rows * h + rows)  # each Linear: weight (h, h) and bias (h,)


def expected_memory(strategy: str, config, psi_elements: int, param_elements: int, largest_layer: int, item: int,
                    rank: int = 0) -> dict:
    n = config.world_size
    shard = psi_elements // n
    full = param_elements
    local = fsdp_local_elements(config, rank)
    table = {
        "ddp": (full, full, 2 * full), "fsdp": (local, local, 2 * local),
        "zero1": (full, full, 2 * shard), "zero2": (full, shard, 2 * shard), "zero3": (shard + largest_layer, shard, 2 * shard),
    }[strategy]
    return {k: (None if e is None else e * item) for k, e in zip(("parameters", "gradients", "optimizer states"), table)}


def make_combine(strategy_of):
    def combine(config, payloads: list[dict]) -> Result:
        strategy = strategy_of(config)
        n = config.world_size
        if payloads[0].get("precision") == "bf16_mixed":
            return combine_mixed(config, payloads, strategy)
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
            want = expected_memory(strategy, config, psi, param_elements, largest, item, pl["rank"])
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
                                reference="ψ, ψ, 2ψ, divided by n where sharded (ZeRO pads to a multiple of n; "
                                          "FSDP2 chunks each parameter's rows)"))
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


def combine_mixed(config, payloads: list[dict], strategy: str) -> Result:
    """ZeRO in bf16 mixed precision: bitwise against one process doing the same arithmetic (bf16 slices, fp32 sum,
    fp32 Adam), and the mixed-precision error against float64 reported. Memory: seed 000's (2 + 2 + 12)ψ split."""
    n = config.world_size
    same = reference_run_mixed(config, slices=n)
    exact = reference_run(config)
    err = max((torch.from_numpy(pl["params"]) - same["params"]).abs().max().item() for pl in payloads)
    numel = payloads[0]["params"].size
    padded = payloads[0]["psi_bytes"] // 2
    shard = padded // n
    want = {"parameters": 2 * numel, "gradients": 2 * numel if config.stage == 1 else 4 * shard, "optimizer states": 12 * shard}
    memory = [{"rank": pl["rank"], "category": c, "measured_bytes": b, "formula_bytes": want.get(c)} for pl in payloads for c, b in pl["memory"].items()]
    formula_sent = (4 + 2) * padded * (n - 1) / n
    volume = [{"rank": pl["rank"], "sent_bytes_per_step": pl["sent"] / config.steps, "formula_bytes_per_step": formula_sent,
               "counted": "ring bytes moved: fp32 gradient reduce-scatter + bf16 parameter all-gather"} for pl in payloads]
    checks = [
        Check("bf16 mixed ZeRO equals one process doing the same arithmetic", err, 0.0,
              reference="single process: bf16 gradients of the same n slices summed in fp32, fp32 master Adam"),
        Check("memory held equals 2ψ + 2ψ (or 4ψ/n fp32 shard) + 12ψ/n", max(abs(r["measured_bytes"] - r["formula_bytes"]) for r in memory if r["formula_bytes"] is not None), 0,
              reference="seed 000: (2 + 2 + K)ψ, K = 12 for the fp32 master, m and v"),
        Check("bytes sent per step equal (4 + 2)ψ(n-1)/n", max(abs(r["sent_bytes_per_step"] - formula_sent) for r in volume), 0,
              reference="fp32 reduce-scatter and bf16 all-gather on a ring"),
    ]
    mp_error = (torch.from_numpy(payloads[0]["params"]) - exact["params"]).norm().item() / exact["params"].norm().item()
    curves = [{"step": i, "loss": l, "run": f"{strategy} bf16 mixed"} for i, l in enumerate(payloads[0]["losses"])] + \
             [{"step": i, "loss": l, "run": "reference float64 (1 process)"} for i, l in enumerate(exact["losses"])]
    return Result(metrics={"strategy": f"{strategy} (bf16 mixed)", "world_size": n, "parameter_bytes_bf16": numel * 2,
                           "relative_error_vs_float64": mp_error, "final_loss": payloads[0]["losses"][-1]},
                  checks=checks, tables={"memory": memory, "volume": volume, "loss": curves},
                  trace_events=[e for pl in payloads for e in pl["trace"]["events"]],
                  notes=[f"Against float64 training, the bf16 mixed-precision parameters differ by {100 * mp_error:.3f} % (relative L2) "
                         f"after {config.steps} steps: the cost of bf16 compute, not of sharding (the sharded run is bitwise "
                         "equal to one process doing the same arithmetic)."])


def combine_ps(config, payloads: list[dict]) -> Result:
    n, server = config.world_size, payloads[0]
    P = server["params"].size
    workers = n - 1 if config.server == "dedicated" else n
    checks, notes = [], []
    if config.mode == "sync":
        ref = reference_run(config)
        err = (torch.from_numpy(server["params"]) - ref["params"]).abs().max().item()
        checks.append(Check("synchronous server's parameters equal one process on the whole batch", err, 1e-12,
                            reference="single-process PyTorch, same Adam, float64"))
    else:
        first, last = server["eval"][0]["loss"], server["eval"][-1]["loss"]
        checks.append(Check("the server converges: held-out loss at the end below 0.8× the first update's", max(0.0, last - 0.8 * first), 0.0,
                            reference="the loss after the first update", detail=f"{first:.4f} → {last:.4f}"))
        stale = [u["staleness"] for u in server["updates"]]
        if config.mode == "stale":
            bound = (workers - 1) * (config.staleness + 1)
            checks.append(Check("bounded staleness holds: no gradient older than (W-1)(s+1) updates", max(0, max(stale) - bound), 0,
                                reference="the stale-synchronous bound", detail=f"max staleness {max(stale)}, bound {bound}"))
        notes.append(f"Staleness over {len(stale)} updates: mean {sum(stale) / len(stale):.2f}, max {max(stale)}.")
    if config.server == "rank0":
        formula = (n - 1) * P * 8 * config.steps
        checks.append(Check("rank 0 receives (n-1)ψ and sends (n-1)ψ per step (seed 000's DP)",
                            abs(server["recv"] - formula) + abs(server["sent"] - formula), 0, reference="seed 000",
                            detail="logical bytes of gloo's gather and broadcast"))
    volume = [{"rank": pl["rank"], "sent_bytes": pl["sent"], "recv_bytes": pl["recv"]} for pl in payloads]
    return Result(metrics={"strategy": f"parameter server ({config.mode}, {config.server})", "world_size": n, "workers": workers,
                           "final_eval_loss": server["eval"][-1]["loss"], "updates": len(server["eval"])},
                  checks=checks, notes=notes,
                  tables={"staleness": server["updates"], "eval": server["eval"], "volume": volume},
                  trace_events=[e for pl in payloads for e in pl["trace"]["events"]])


register("parallel.dp_ps", PSConfig, "parameter servers: rank 0 or dedicated; synchronous, asynchronous, bounded staleness",
         rank_fn=dp_ps.run_rank, combine=combine_ps, lanes=("compute", "collective", "send", "recv"))
register("parallel.ddp", DDPConfig, "our DDP (hooks, reverse-order buckets, overlapped async all-reduce) beside torch DDP",
         rank_fn=ddp.run_rank, combine=make_combine(lambda c: "ddp"), lanes=("compute", "collective"))
register("parallel.zero", ZeroConfig, "ZeRO-1/2/3 with Adam over our ring collectives: memory per rank and bytes sent vs 2ψ/2ψ/3ψ",
         rank_fn=zero.run_rank, combine=make_combine(lambda c: f"zero{c.stage}"), lanes=("compute", "collective", "comm"))
register("parallel.fsdp", FSDPConfig, "PyTorch FSDP2 (fully_shard per layer) on the same workload: the peer of our ZeRO-3",
         rank_fn=fsdp.run_rank, combine=make_combine(lambda c: "fsdp"), lanes=("compute",))
