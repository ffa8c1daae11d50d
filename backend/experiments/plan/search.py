"""plan.search: every plan for a model on a cluster at a global batch and sequence length, ranked by predicted
throughput (every K/V exchange and rank order; the attention kernel the user's); the plans that do not fit or do not
divide, with the reason; for the best plan's nearest rivals, where each loses its time, and when its K/V exchange or
rank order decides."""
from __future__ import annotations

import dataclasses
import math

from backend.config import Config, setting
from backend.limits import cost
from backend.experiments import define
from backend.plan.settings import cluster, cluster_settings, load_model, model_setting
from backend.plan import published
from backend.plan import search as S
from backend.plan.predict import ATTENTION_KERNELS, ORDERS, check_kernel
from backend.result import Check, Result, Schema

GiB = 2 ** 30
_C = cluster_settings(nodes=8)


@dataclasses.dataclass
class PlanSearchConfig(Config):
    model: str = model_setting()
    gpu: str = _C["gpu"]
    nodes: int = _C["nodes"]
    gpus_per_node: int = _C["gpus_per_node"]
    network_gbps: float = _C["network_gbps"]
    global_batch: int = setting(256, min=1, max=1 << 20, help="sequences per step")
    seq_len: int = setting(8192, min=128, max=1 << 20, help="tokens per sequence")
    attention_kernel: str = setting("fa2", choices=ATTENTION_KERNELS, help="attention kernel every plan runs (your software "
                                    "choice, not searched): fa2 (PyTorch SDPA's flash backend), cudnn, fa3 at their published "
                                    "H100 speeds; Ampere: fa2 only")
    top: int = setting(20, min=1, max=200, help="ranked plans listed")

    cost_drivers = ("nodes",)

    def estimate(self):
        """The plans are the factorisations of the GPU count over the parallel dimensions, ~log2(GPUs)^3 of them, each
        ~1 ms of CPU (1.1 s of CPU at 64 GPUs, 1.5 s at 16,384 measured, with both K/V exchanges and rank orders)."""
        gpus = self.nodes * self.gpus_per_node
        return cost(ops=55 * math.log2(2 * gpus) ** 3)

    def check(self) -> None:
        load_model(self)
        check_kernel(cluster(self).gpu, self.attention_kernel)


def _row(r: dict) -> dict:
    t = r["time"]
    return {"plan": S.describe(r["plan"]), "cp_comm": r["plan"].cp_comm if r["plan"].cp > 1 else "", "order": r["plan"].order,
            "attention_kernel": r["plan"].attention_kernel, "dp": r["dp"], "tokens_per_s_per_gpu": r["tokens_per_s_per_gpu"], "mfu": r["mfu"],
            "memory_gib": r["memory_bytes"] / GiB, "step_s": t["step_s"], "bubble_s": t["bubble_s"],
            **{f"exposed_{k}_s": v for k, v in t["exposed_s"].items()}}


def run(config: PlanSearchConfig, ctx) -> Result:
    model, cl = load_model(config), cluster(config)
    eff = published.fit()
    ctx.progress(0.2, "searching")
    found = S.search(model, cl, config.global_batch, config.seq_len, eff, kernel=config.attention_kernel)
    ranked = found["ranked"]
    rows = [_row(r) for r in ranked[:config.top]]
    if ranked:
        best, index = ranked[0], S.twins(ranked)
        for row, r in zip(rows[1:], ranked[1:config.top]):
            row["why_not_best"] = "; ".join(x for x in (S.why_slower(best, r), S.choice_decides(r, index, best)) if x)
        rows[0]["why_not_best"] = "the best"
    reasons = {}
    for x in found["infeasible"]:
        key = x["reason"].split(":")[0] + (": " + x["reason"].split("(largest: ")[1].split(",")[0] if "largest" in x["reason"] else "")
        reasons.setdefault(key, {"reason": key, "plans": 0, "example": S.describe(x["plan"]) + " — " + x["reason"]})
        reasons[key]["plans"] += 1
    checks = [Check("every ranked plan fits in HBM", sum(r["memory_bytes"] > cl.gpu.hbm_bytes for r in ranked), 0,
                    reference="the plan's own memory model against the GPU's HBM"),
              Check("the ranking is by predicted tokens/s per GPU, best first",
                    sum(a["tokens_per_s_per_gpu"] < b["tokens_per_s_per_gpu"] for a, b in zip(ranked, ranked[1:])), 0,
                    reference="pairwise order")]
    metrics = {"plans_feasible": len(ranked), "plans_infeasible": len(found["infeasible"]), "plans_evaluated": found["evaluated"],
               "search_s": found["seconds"], "gpus": cl.gpus}
    if ranked:
        metrics.update({"best_tokens_per_s_per_gpu": ranked[0]["tokens_per_s_per_gpu"], "best_mfu": ranked[0]["mfu"],
                        "best_memory_gib": ranked[0]["memory_bytes"] / GiB})
    return Result(metrics=metrics, tables={"ranked": rows, "infeasible": sorted(reasons.values(), key=lambda r: -r["plans"])},
                  checks=checks, notes=["Predicted by the planner's model (constants fitted on the calibration rows); not measured."])


def _v1_to_v2(result: dict) -> None:
    """Runs stored before the search covered the K/V exchange, the rank order and the kernel: ring CP, Megatron's
    order and FlashAttention-2 were what every plan ran."""
    for row in result["tables"].get("ranked", []):
        row.setdefault("cp_comm", "ring" if "cp1 " not in row["plan"] else "")
        row.setdefault("order", next(iter(ORDERS)))
        row.setdefault("attention_kernel", "fa2")


RESULT = Schema(
    metrics=("plans_feasible", "plans_infeasible", "plans_evaluated", "search_s", "gpus",
             "best_tokens_per_s_per_gpu", "best_mfu", "best_memory_gib"),
    tables={"ranked": ("plan", "cp_comm", "order", "attention_kernel", "dp", "tokens_per_s_per_gpu", "mfu", "memory_gib", "step_s", "bubble_s", "exposed_dp_s",
                       "exposed_tp_s", "exposed_pp_s", "exposed_cp_s", "exposed_ep_s", "why_not_best"),
            "infeasible": ("reason", "plans", "example")},
    optional=("best_tokens_per_s_per_gpu", "best_mfu", "best_memory_gib"),  # only when some plan fits
    version=2, upgrades={1: _v1_to_v2},
)

EXPERIMENT = define(__name__, PlanSearchConfig, "every parallel plan for a model and cluster, ranked by predicted throughput, with why the rest lose",
                    run_fn=run, schema=RESULT)
