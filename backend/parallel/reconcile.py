"""Data-parallel results reconciled with their references: every rank's report against one process training
the whole batch, memory held against the 2ψ/2ψ/3ψ formulas, bytes sent against the volume model.

ψ is the (padded) flat parameter vector in the compute dtype. Memory per rank, in elements:
  DDP      ψ params, ψ grads, 2ψ Adam            FSDP2 each parameter's rows chunked over n (torch.chunk)
  ZeRO-1   ψ, ψ, 2ψ/n                            ZeRO-2 ψ, ψ/n, 2ψ/n        ZeRO-3 ψ/n + one layer, ψ/n, 2ψ/n
In mixed precision the master copy adds ψ/n in the master dtype to the optimizer states: seed 000's
(2 + 2 + K)ψ with K = 12 for bf16 compute and fp32 master, m and v.
CPU offload (ZeRO-Offload on ZeRO-1/2, FSDP2's CPUOffloadPolicy) moves what is sharded to the host pool:
ZeRO-Offload's host holds the master shard, m, v (ψ/n each, master dtype) and the gradient shard (ψ/n, reduce
dtype), and per step each rank moves ψ/n gradient elements down (reduce dtype) and ψ/n parameters up (compute
dtype). FSDP2 offloads its sharded parameters, gradients and Adam states; it copies each parameter's padded
shard up before each all-gather (forward, and again in backward) and each gradient shard down once.
"""
from __future__ import annotations

import torch

from backend.parallel.loop import RankReport
from backend.parallel.workload import FP64, PRECISIONS, reference_run
from backend.result import Check, Result


def fsdp_local_elements(hidden: int, layers: int, n: int, rank: int) -> int:
    """FSDP2 shards every parameter along dim 0 as torch.chunk does: ceil(rows / n) rows per rank, fewer or none last."""
    rows_per = -(-hidden // n)
    rows = max(0, min(rows_per, hidden - rank * rows_per))
    return layers * (rows * hidden + rows)  # each Linear: weight (h, h) and bias (h,)


def stage_of(strategy: str) -> int:
    return int(strategy.removesuffix("-offload")[-1])


def offloaded(strategy: str) -> bool:
    return strategy.endswith("-offload")


def fsdp_padded_elements(hidden: int, layers: int, n: int) -> int:
    """FSDP2 pads every rank's shard of a parameter to ceil(rows / n) rows: the elements it copies per all-gather."""
    return layers * -(-hidden // n) * (hidden + 1)


def expected_memory(report: RankReport, config, n: int) -> dict[str, int]:
    """Bytes on the device per category (offloaded categories: 0 there; expected_host_memory holds them)."""
    p = PRECISIONS[report.precision]
    ci, ri, mi = p.item("compute"), p.item("reduce"), p.item("master")
    full = report.params.size
    shard = report.psi_bytes // ci // n
    layer = config.hidden * config.hidden + config.hidden
    master_copy = shard if p.mixed else 0
    if report.strategy in ("ddp", "torch ddp"):
        return {"parameters": full * ci, "gradients": full * ci, "optimizer states": 2 * full * mi}
    if report.strategy.startswith("fsdp"):
        local = fsdp_local_elements(config.hidden, config.layers, n, report.rank)
        on_device = 0 if offloaded(report.strategy) else 1
        return {"parameters": on_device * local * ci, "gradients": on_device * local * ci,
                "optimizer states": on_device * 2 * local * mi}
    stage = stage_of(report.strategy)
    return {"parameters": (full if stage < 3 else shard + layer) * ci,
            "gradients": full * ci if stage == 1 else shard * ri,
            "optimizer states": 0 if offloaded(report.strategy) else (2 * shard + master_copy) * mi}


def expected_host_memory(report: RankReport, config, n: int) -> dict[str, int]:
    """Bytes in the host pool per category: what offload moved off the device."""
    if not offloaded(report.strategy):
        return {}
    p = PRECISIONS[report.precision]
    if report.strategy.startswith("fsdp"):
        local = fsdp_local_elements(config.hidden, config.layers, n, report.rank)
        return {"parameters (shard)": local * p.item("compute"), "gradients (shard)": local * p.item("compute"),
                "optimizer states": 2 * local * p.item("master")}
    shard = report.psi_bytes // p.item("compute") // n
    return {"parameters (master shard)": shard * p.item("master"), "optimizer states": 2 * shard * p.item("master"),
            "gradients (shard)": shard * p.item("reduce")}


def expected_moved_per_step(report: RankReport, config, n: int) -> dict[str, int]:
    """Bytes one rank moves between the pools per step. ZeRO-Offload: the gradient shard down in the reduce dtype,
    the updated parameter shard up in the compute dtype (the paper's 2 + 2 bytes/param of ψ/n in fp16).
    FSDP2: every padded parameter shard up before each of its two all-gathers, each gradient shard down once."""
    p = PRECISIONS[report.precision]
    if report.strategy.startswith("fsdp"):
        local = fsdp_local_elements(config.hidden, config.layers, n, report.rank)
        return {"device_to_host": local * p.item("reduce"),
                "host_to_device": 2 * fsdp_padded_elements(config.hidden, config.layers, n) * p.item("compute")}
    shard = report.psi_bytes // p.item("compute") // n
    return {"device_to_host": shard * p.item("reduce"), "host_to_device": shard * p.item("compute")}


def expected_sent_per_step(report: RankReport, n: int) -> float:
    """Ring volume: the gradient reduce-scatter in the reduce dtype, the parameter all-gather(s) in the compute dtype;
    DDP: a ring all-reduce of each bucket padded to a multiple of n, 2P(n-1)/n."""
    p = PRECISIONS[report.precision]
    if report.strategy == "ddp":
        return sum(2 * (n - 1) * -(-b // n) * p.item("reduce") for b in report.extra["buckets"])
    psi = report.psi_bytes // p.item("compute")
    gathers = 2 if report.strategy == "zero3" else 1
    return psi * (p.item("reduce") + gathers * p.item("compute")) * (n - 1) / n


def combine(config, reports: list[RankReport], peer: str | None = None) -> Result:
    """One result from every rank's report; `peer` names the torch implementation in reports' extra['peer_params']."""
    n, first = len(reports), reports[0]
    precision = PRECISIONS[first.precision]
    ref = reference_run(config.workload, precision, slices=n if precision.mixed else 1)
    tol = 0.0 if precision.mixed else 1e-12
    same = "one process doing the same arithmetic (bf16 slices, fp32 sum, fp32 Adam)" if precision.mixed else \
        "single-process PyTorch, same Adam, float64"
    param_err = max((torch.from_numpy(r.params) - ref["params"]).abs().max().item() for r in reports)
    loss_err = max(abs(a - b) for a, b in zip(first.losses, ref["losses"]))
    checks = [Check("final parameters equal one process on the whole batch", param_err, tol, reference=same, detail="max |difference|"),
              Check("every step's loss equals the reference", loss_err, tol if not precision.mixed else 1e-6, reference=same)]
    if peer:
        peer_err = max((torch.from_numpy(r.extra["peer_params"]) - ref["params"]).abs().max().item() for r in reports)
        checks.append(Check(f"{peer} (the peer) equals the reference too", peer_err, 1e-12, reference="single-process PyTorch"))
    memory = [{"rank": r.rank, "pool": "device", "category": cat, "measured_bytes": got,
               "formula_bytes": expected_memory(r, config, n).get(cat)} for r in reports for cat, got in r.memory.items()]
    memory += [{"rank": r.rank, "pool": "host", "category": cat, "measured_bytes": got,
                "formula_bytes": expected_host_memory(r, config, n).get(cat)} for r in reports for cat, got in r.host_memory.items()]
    checks.append(Check("parameters, gradients and optimizer states held equal the formula",
                        max(abs(m["measured_bytes"] - m["formula_bytes"]) for m in memory if m["formula_bytes"] is not None), 0,
                        reference="ψ, ψ, 2ψ, divided by n where sharded (ZeRO pads to a multiple of n; FSDP2 chunks each "
                                  "parameter's rows); mixed precision adds the fp32 master shard"))
    volume = []
    if first.sent_bytes is not None:
        volume = [{"rank": r.rank, "sent_bytes_per_step": r.sent_bytes / config.steps,
                   "formula_bytes_per_step": expected_sent_per_step(r, n), "counted": "bytes our ring send/recv moved"}
                  for r in reports]
        checks.append(Check("bytes sent per step equal the formula",  # counted on the wire by our own send/recv
                            max(abs(v["sent_bytes_per_step"] - v["formula_bytes_per_step"]) for v in volume), 0,
                            reference="seed 000: 2ψ (DDP, each bucket padded to a multiple of n; ZeRO-1, 2), 3ψ (ZeRO-3), "
                                      "times (n-1)/n, each in its dtype"))
    moved = []
    if offloaded(first.strategy):
        moved = [{"rank": r.rank, "direction": d.replace("_", " "), "measured_bytes_per_step": r.extra["moved"][d] / config.steps,
                  "formula_bytes_per_step": expected_moved_per_step(r, config, n)[d]} for r in reports for d in ("device_to_host", "host_to_device")]
        checks.append(Check("bytes moved host <-> device per step equal the formula",
                             max(abs(row["measured_bytes_per_step"] - row["formula_bytes_per_step"]) for row in moved), 0,
                             reference=("ZeRO-Offload (Ren et al. 2021): the ψ/n gradient shard down in the reduce dtype, the ψ/n "
                                        "parameter shard up in the compute dtype, per rank per step" if first.strategy.startswith("zero") else
                                        "FSDP2 CPUOffloadPolicy: each padded parameter shard up per all-gather (2 per step), each "
                                        "gradient shard down once"),
                             detail="counted on the copies between the pools" if first.strategy.startswith("zero") else
                                    "counted on FSDP2's own Tensor.to calls (all_gather_inputs, foreach_reduce); on a CPU each returns the tensor itself, so these are the bytes FSDP2 asks to move"))
    label = first.strategy + (" bf16 mixed" if precision.mixed else "")
    curves = [{"step": i, "loss": l, "run": label} for i, l in enumerate(first.losses)] + \
             [{"step": i, "loss": l, "run": "reference (1 process)"} for i, l in enumerate(ref["losses"])]
    metrics = {"strategy": label, "world_size": n, "parameter_bytes": first.params.size * precision.item("compute"),
               "psi_padded_bytes": first.psi_bytes, "final_loss": first.losses[-1]}
    if moved:  # rank 0's, per step
        metrics.update({f"moved_{d}_bytes_per_step": first.extra["moved"][d] / config.steps for d in ("device_to_host", "host_to_device")})
        metrics["host_bytes"] = sum(first.host_memory.values())
    if "buckets" in first.extra:
        metrics["buckets_elements"] = first.extra["buckets"]
    notes = []
    if moved:
        notes.append("No accelerator here: the device and the host are both this CPU's memory, kept as two accounting "
                     "pools. What is measured is where each tensor is kept and every byte copied between the pools, not "
                     "the time a PCIe link would take.")
    if precision.mixed:
        exact = reference_run(config.workload, FP64)
        error = (torch.from_numpy(first.params) - exact["params"]).norm().item() / exact["params"].norm().item()
        metrics["relative_error_vs_float64"] = error
        notes.append(f"Against float64 training, the bf16 mixed-precision parameters differ by {100 * error:.3f} % (relative L2) "
                     f"after {config.steps} steps: the cost of bf16 compute, not of sharding (the sharded run is bitwise "
                     "equal to one process doing the same arithmetic).")
    else:
        notes.append("Seed 000 counts mixed precision: (2 + 2 + K)ψ with K = 12 (fp32 master, m, v); this workload "
                     "trains in float64 without a master copy, so the same split reads ψ + ψ + 2ψ here.")
    return Result(metrics=metrics, checks=checks, tables={"memory": memory, "volume": volume, "loss": curves, "moved": moved},
                  trace_events=[e for r in reports for e in r.trace["events"]], notes=notes)
