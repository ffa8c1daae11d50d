"""plan.training: one training plan for a real model on a real cluster, predicted: memory per GPU by category against
HBM, the step split into compute, recompute, exposed communication per dimension and pipeline bubble, a Gantt of
one step replayed from the Schedule's own per-rank orders at the predicted costs, TFLOP/s, MFU, tokens/s per GPU,
days and GPU-hours for D tokens, and the published rows' errors (calibration and validation apart).
"""
from __future__ import annotations

import dataclasses

from backend import experiments
from backend.config import Config, setting
from backend.limits import PROCESS_BYTES, Estimate, cost
from backend.experiments import define
from backend.plan.settings import cluster, cluster_settings, load_model, model_setting
from backend.experiments.plan import _live as live
from backend.plan import gantt, published
from backend.plan import models as M
from backend.plan.predict import (ATTENTION_KERNELS, CP_COMMS, DP_STRATEGIES, ORDERS, PLAN_SCHEDULES, RECOMPUTE, Plan,
                                  attention_share, evaluate)
from backend.result import Check, Result, Schema

GiB = 2 ** 30
_C = cluster_settings(gpu="H100 SXM 96GB")


@dataclasses.dataclass
class PlanTrainingConfig(Config):
    model: str = model_setting()
    gpu: str = _C["gpu"]
    nodes: int = setting(1, min=1, max=16384, help="nodes")
    gpus_per_node: int = _C["gpus_per_node"]
    network_gbps: float = _C["network_gbps"]
    tp: int = setting(1, min=1, max=64, help="tensor-parallel degree")
    sp: bool = setting(True, help="sequence parallel (with tp > 1)")
    cp: int = setting(1, min=1, max=64, help="context-parallel degree")
    cp_comm: str = setting("ring", choices=CP_COMMS, help="context parallel's K/V exchange: ring attention (overlapped) or "
                                                          "Llama 3's all-gather (exposed)")
    attention_kernel: str = setting("fa2", choices=ATTENTION_KERNELS, help="attention kernel on Hopper, at its published H100 "
                                    "speed (FlashAttention-3 paper): fa2 (PyTorch SDPA's flash backend), cudnn, fa3; Ampere: fa2")
    ep: int = setting(1, min=1, max=256, help="expert-parallel degree (MoE models)")
    order: str = setting(next(iter(ORDERS)), choices=tuple(ORDERS), help="rank order, outermost dimension first (nodes hold "
                         "consecutive ranks, so it decides which groups cross the node): " + "; ".join(f"{k}: {v}" for k, v in ORDERS.items()))
    pp: int = setting(1, min=1, max=128, help="pipeline stages")
    vp: int = setting(1, min=1, max=8, help="virtual stages per pipeline rank (interleaved schedule)")
    schedule: str = setting("1f1b", choices=PLAN_SCHEDULES, help="pipeline schedule")
    dp_strategy: str = setting("fsdp", choices=DP_STRATEGIES, help="data-parallel strategy")
    hsdp_shard: int = setting(8, min=1, max=4096, help="HSDP: ranks one copy is sharded over")
    micro_batch: int = setting(2, min=1, max=64, help="sequences per micro-batch")
    global_batch: int = setting(16, min=1, max=1 << 20, help="sequences per step")
    seq_len: int = setting(8192, min=128, max=1 << 20, help="tokens per sequence")
    recompute: str = setting("selective", choices=RECOMPUTE, help="activation recomputation")
    precision: str = setting("bf16", choices=("bf16", "fp8"), help="matmul precision (fp8 where the GPU has it)")
    grad_bytes: int = setting(2, choices=(2, 4), help="bytes per gradient element (4: fp32 main gradients)")
    fused: bool = setting(True, help="elementwise ops fused (torch.compile, Megatron's kernels); off: eager PyTorch, each op "
                                     "its own pass over HBM")
    tokens_b: float = setting(2000.0, min=0.001, max=1e6, help="tokens to train, billions")
    live_check: bool = setting(False, help="also run the plan scaled down through parallel.mesh (tiny widths, each dimension "
                                           "above 1 at 2, at most 8 gloo ranks; the plan's schedule, virtual stages, dp "
                                           "strategy and recompute) and check it against the planner's functions (~30 s)")

    cost_drivers = ("live_check",)

    def estimate(self):
        own = cost(ops=10_000)  # the plan's arithmetic and its Gantt: 0.74 s of CPU at the defaults measured
        if not self.live_check:
            return own
        from backend.plan.predict import validate
        dp = validate(load_model(self), cluster(self), self.plan())
        mesh = experiments.get("parallel.mesh").config_cls(**live.settings(self.plan(), load_model(self), dp)).estimate()
        return Estimate(own.memory_bytes + mesh.memory_bytes - PROCESS_BYTES, own.seconds + mesh.seconds)

    def plan(self) -> Plan:
        return Plan(tp=self.tp, sp=self.sp, cp=self.cp, cp_comm=self.cp_comm, attention_kernel=self.attention_kernel, order=self.order, ep=self.ep, pp=self.pp, vp=self.vp, schedule=self.schedule,
                    dp_strategy=self.dp_strategy, hsdp_shard=self.hsdp_shard, micro_batch=self.micro_batch,
                    global_batch=self.global_batch, seq_len=self.seq_len, recompute=self.recompute,
                    precision=self.precision, grad_bytes=self.grad_bytes, fused=self.fused)

    def check(self) -> None:
        from backend.plan.predict import validate
        dp = validate(load_model(self), cluster(self), self.plan())
        if self.live_check:
            live.settings(self.plan(), load_model(self), dp)


def published_tables(eff) -> tuple[list[dict], list[dict], list[Check]]:
    """Korthikanti's and ZeRO's exact cells, and every measured row's error, each as a check."""
    exact, checks = [], []
    for name, pp, vp, micro, m, *want in published.KORTHIKANTI:
        got = published.korthikanti_cells(name, pp, vp, micro, m)
        for (label, value), w in zip(got.items(), want):
            exact.append({"row": f"{name}: {label}", "published_GiB": w, "predicted_GiB": value, "error": value / w - 1})
    for (s, want), (_, got) in zip(published.ZERO, published.zero_cells().items()):
        exact.append({"row": f"ZeRO 7.5B, 64 GPUs: {s}", "published_GiB": want, "predicted_GiB": got, "error": got / want - 1})
    checks.append(Check("Korthikanti Fig. 1 memory cells reproduced exactly", max(abs(r["error"]) for r in exact[:12]), 1e-12,
                        reference=published.KORTHIKANTI_SOURCE))
    checks.append(Check("ZeRO Fig. 1 per-device memory to the printed digit (0.05 GB)",
                        max(abs(r["predicted_GiB"] - r["published_GiB"]) for r in exact[12:]), 0.05, reference=published.ZERO_SOURCE))
    rows = published.errors(eff)
    return exact, rows, checks


def run(config: PlanTrainingConfig, ctx) -> Result:
    model, cl, plan = load_model(config), cluster(config), config.plan()
    ctx.progress(0.1, "fitting the constants on the calibration rows")
    eff = published.fit()
    r = evaluate(model, cl, plan, eff, config.tokens_b * 1e9)
    ctx.progress(0.5, "replaying the schedule")
    bars = gantt.replay(plan, r)
    counts = M.counts(model)
    mem = {k: v for k, v in r["memory"].items() if not k.startswith("_") and k != "stage"}
    t = r["time"]
    exact, rows, checks = published_tables(eff)
    if plan.pp > 1 and bars:
        replayed = max(b["ts"] + b["dur"] for b in bars) / 1e6
        checks.append(Check("the Gantt's replayed makespan equals the pipeline time the plan predicts",
                            abs(replayed / t["pipeline_s"] - 1), 0.02 if gantt.formula_exact(plan) else 0.25,
                            reference="backend/trace.replay of the Schedule's per-rank orders at the same costs",
                            detail=f"replay {replayed:.3f} s, model {t['pipeline_s']:.3f} s"))
    live_row = {}
    if config.live_check:
        ctx.progress(0.6, "running the plan scaled down on gloo ranks")
        live_checks, live_row = live.run(plan, model, r["dp"])
        checks += live_checks
    metrics = {"parameters": counts["total"], "active_parameters": counts["active"], "dp": r["dp"],
               "memory_gib": r["memory_bytes"] / GiB, "hbm_gib": cl.gpu.hbm_bytes / GiB, "fits": r["fits"],
               "step_s": t["step_s"], "compute_s": t["compute_s"], "recompute_s": t["recompute_s"], "bubble_s": t["bubble_s"],
               **{f"exposed_{k}_s": v for k, v in t["exposed_s"].items()}, "optimizer_s": t["optimizer_s"],
               "tokens_per_s_per_gpu": r["tokens_per_s_per_gpu"], "model_tflops_per_gpu": r["model_tflops_per_gpu"],
               "mfu": r["mfu"], "train_days": r["train_days"], "gpu_hours": r["gpu_hours"],
               "efficiency_linear": eff.linear(cl.gpu), "efficiency_attention": attention_share(cl.gpu, plan.attention_kernel, eff),
               "allocator_fragmentation": eff.fragmentation, "peak_moment": r["memory"]["_moment"],
               "worst_calibration_error": max(abs(x["error"]) for x in rows if x["role"] == "calibration"),
               "worst_validation_error": max(abs(x["error"]) for x in rows if x["role"] == "validation")}
    links = [{"dimension": k, "size": getattr(plan, k, r["dp"]) if k != "dp" else r["dp"], "link": v} for k, v in t["links"].items()]
    return Result(
        metrics=metrics,
        tables={"memory": [{"category": k, "bytes": v, "stage": r["memory"]["stage"]} for k, v in mem.items()],
                "time": [{"part": "compute", "seconds": t["compute_s"]}, {"part": "recompute", "seconds": t["recompute_s"]},
                         {"part": "pipeline bubble", "seconds": t["bubble_s"]}, {"part": "optimizer step", "seconds": t["optimizer_s"]}]
                + [{"part": f"exposed {k} communication", "seconds": v} for k, v in t["exposed_s"].items()],
                "gantt": bars, "links": links, "published_exact": exact, "published": rows,
                "hopper_500w": [published.hopper_500w_account(eff)], "dp128_by_virtual_stages": published.dp128_by_virtual_stages(eff),
                "cp131k_by_attention_kernel": published.cp131k_by_attention_kernel(),
                "live": [live_row] if live_row else []},
        checks=checks,
        notes=[f"A model, not a measurement: constants fitted on the calibration rows (GEMM tiles in full waves at {eff.linear(cl.gpu):.3f} of {cl.gpu.name}'s peak, "
               f"attention {attention_share(cl.gpu, plan.attention_kernel, eff):.3f} of peak ({plan.attention_kernel}), allocator fragmentation {eff.fragmentation:.1%} of the allocated peak); validation rows are predicted with them."])


def _v1_to_v2(result: dict) -> None:
    """Runs stored before attention ran at a published kernel's H100 speed: the CP row's kernel table and the HBM2e's
    cost in the 500 W account were not computed."""
    result["tables"].setdefault("cp131k_by_attention_kernel", [])
    for row in result["tables"].get("hopper_500w", []):
        row.setdefault("HBM2e cost (modelled: throughput at 2.4 ÷ at 3.35 TB/s)", None)


RESULT = Schema(
    metrics=("parameters", "active_parameters", "dp", "memory_gib", "hbm_gib", "fits", "step_s", "compute_s", "recompute_s",
             "bubble_s", "exposed_dp_s", "exposed_tp_s", "exposed_pp_s", "exposed_cp_s", "exposed_ep_s", "optimizer_s",
             "tokens_per_s_per_gpu", "model_tflops_per_gpu", "mfu", "train_days", "gpu_hours", "efficiency_linear",
             "efficiency_attention", "allocator_fragmentation", "peak_moment", "worst_calibration_error", "worst_validation_error"),
    tables={
        "memory": ("bytes", "category", "stage"),
        "time": ("part", "seconds"),
        "gantt": ("rank", "kind", "stage", "mb", "ts", "dur"),  # empty when pp = 1 or the step has too many actions
        "links": ("dimension", "link", "size"),
        "published_exact": ("error", "predicted_GiB", "published_GiB", "row"),
        "published": ("error", "predicted", "published", "quantity", "role", "row", "source", "tolerance", "within"),
        "hopper_500w": ("fitted 500 W ÷ 700 W", "power cap at most (NVL ÷ SXM peak)", "source", "unexplained factor",
                        "HBM2e cost (modelled: throughput at 2.4 ÷ at 3.35 TB/s)"),
        "dp128_by_virtual_stages": ("error", "predicted", "published", "virtual stages"),
        "cp131k_by_attention_kernel": ("attention kernel", "error", "hopper matmul (refitted)", "predicted", "published", "within"),
        "live": ("batch", "cp", "dp_strategy", "ep", "experts", "layers", "microbatches", "mirrors", "pp", "recompute",
                 "schedule", "seq", "steps", "tp", "virtual_stages", "world_size"),  # empty unless live_check
    },
    version=2, upgrades={1: _v1_to_v2},
)

EXPERIMENT = define(__name__, PlanTrainingConfig,
                    "one training plan at real scale: memory by category, step time by part, Gantt, MFU, days; published rows' errors",
                    run_fn=run, schema=RESULT)
