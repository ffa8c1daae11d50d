"""models.moe_routing: route one batch of tokens with softmax top-k, Switch top-1 (capacity factor, dropped tokens) and
DeepSeek-V3's group-limited sigmoid gate with its selection-only bias and a shared expert; the load per expert,
the balance loss, and auxiliary-loss-free balancing (the bias nudged against the load, step by step).

Every routing and the MoE layer's output are checked against a one-token-at-a-time plain-Python implementation
(backend/models/moe_reference.py). The torch.topk / scatter / gather / bincount steps of DeepSeek's gate are
recorded on the run's first tokens.
"""
from __future__ import annotations

import dataclasses
import math

import torch

from backend.config import Config, ConfigError, setting
from backend.limits import cost
from backend.experiments import define
from backend.models import moe, moe_reference as ref
from backend.result import Check, Result, Schema

WALKTHROUGH_TOKENS = 4
TOL = 1e-12  # float64 throughout; the two implementations add in different orders


@dataclasses.dataclass
class RoutingConfig(Config):
    tokens: int = setting(64, min=4, max=512, help="tokens routed")
    d_model: int = setting(32, min=4, max=128, help="model width")
    d_ff: int = setting(32, min=4, max=256, help="hidden width of each SwiGLU expert")
    n_experts: int = setting(16, min=2, max=64, help="routed experts N")
    top_k: int = setting(4, min=1, max=16, help="experts per token (softmax top-k and DeepSeek)")
    n_groups: int = setting(4, min=1, max=16, help="DeepSeek expert groups")
    topk_groups: int = setting(2, min=1, max=16, help="DeepSeek groups kept per token")
    route_scale: float = setting(2.5, min=0.1, max=10.0, help="DeepSeek weight scale (V3: 2.5)")
    capacity_factor: float = setting(1.25, min=0.25, max=4.0, help="Switch: capacity = ceil(cf · tokens / N)")
    renormalize: bool = setting(True, help="softmax top-k: renormalise the k weights to sum to 1 (Mixtral, GShard's top-2) "
                                           "or keep the softmax probabilities (DeepSeek-V2, Qwen1.5-MoE)")
    n_shared: int = setting(1, min=0, max=2, help="DeepSeek shared experts every token passes through")
    router_skew: float = setting(0.3, min=0.0, max=4.0, help="std of a fixed per-expert logit offset (a router that favours some experts)")
    bias_steps: int = setting(30, min=0, max=300, help="auxiliary-loss-free balancing steps")
    bias_rate: float = setting(0.02, min=0.0, max=1.0, help="bias update speed γ")
    seed: int = setting(0, min=0, max=2**31 - 1, help="tokens and weights")

    cost_drivers = ("tokens", "top_k", "bias_steps", "d_ff")

    def estimate(self):
        """The reference layer runs each token through each of its experts alone, for four routers: top_k + 1 +
        2·(top_k + shared) expert calls per token, each a slice, a SwiGLU module call and a weighted add (measured
        ~0.15 ms of CPU a call at the defaults, bench/limits.py); the gate runs once per balancing step."""
        expert_calls = self.tokens * (3 * self.top_k + 1 + 2 * min(self.n_shared, 1))
        expert_flops = 3 * 2 * self.d_model * self.d_ff * (1 + self.n_shared)
        return cost(data_bytes=self.n_experts * 3 * self.d_model * self.d_ff * 8 * 2 + self.tokens * self.n_experts * 8 * 40,
                    flops=expert_calls * expert_flops, ops=expert_calls * 6 + self.bias_steps * 20 + 5000)

    def check(self) -> None:
        if self.n_experts % self.n_groups:
            raise ConfigError("n_groups", f"{self.n_groups} does not divide n_experts={self.n_experts} (allowed: a divisor of n_experts)")
        if self.n_experts // self.n_groups < 2:
            raise ConfigError("n_groups", f"{self.n_groups} leaves fewer than 2 experts per group for the top-2 group score "
                              f"(allowed: at most {self.n_experts // 2})")
        if self.topk_groups > self.n_groups:
            raise ConfigError("topk_groups", f"{self.topk_groups} > n_groups={self.n_groups} (allowed: 1..{self.n_groups})")
        reachable = self.topk_groups * self.n_experts // self.n_groups
        if self.top_k > reachable:
            raise ConfigError("top_k", f"{self.top_k} experts cannot be chosen from {self.topk_groups} groups of "
                              f"{self.n_experts // self.n_groups} (allowed: 1..{reachable})")


def as_routes(r: moe.Routing) -> list[dict[int, float]]:
    return [{int(e): float(w) for e, w, k in zip(i, ws, ks) if k} for i, ws, ks in zip(r.indices, r.weights, r.kept)]


def route_error(got: list[dict[int, float]], want: list[dict[int, float]]) -> tuple[float, int]:
    """(largest weight difference, tokens whose expert set differs); inf error if any set differs."""
    differ = sum(set(a) != set(b) for a, b in zip(got, want))
    if differ:
        return math.inf, differ
    return max((abs(a[e] - b[e]) for a, b in zip(got, want) for e in a), default=0.0), 0


def walkthrough(logits: torch.Tensor, bias: torch.Tensor, c: RoutingConfig) -> list[dict]:
    """DeepSeek's gate on the first tokens, one tensor per step, as the seed's code computes it."""
    scores = logits.sigmoid()
    choice = (scores + bias).view(logits.shape[0], c.n_groups, -1)
    top2 = choice.topk(2, dim=-1)[0]
    group_scores = top2.sum(dim=-1)
    top_groups = group_scores.topk(c.topk_groups, dim=-1)[1]
    dropped = torch.ones_like(group_scores, dtype=torch.bool).scatter_(1, top_groups, False)
    masked = choice.masked_fill(dropped.unsqueeze(-1), float("-inf")).flatten(1)
    indices = torch.topk(masked, c.top_k, dim=-1)[1]
    gathered = scores.gather(1, indices)
    weights = gathered / gathered.sum(-1, keepdim=True) * c.route_scale
    steps = [
        ("sigmoid scores s", "scores = logits.sigmoid()", scores),
        ("scores + bias (for choosing only)", "choice = (scores + bias).view(tokens, n_groups, -1)", choice.flatten(1)),
        ("group score: sum of its top-2", "group_scores = choice.topk(2, dim=-1)[0].sum(dim=-1)", group_scores),
        ("best groups", "top_groups = group_scores.topk(topk_groups, dim=-1)[1]", top_groups),
        ("groups dropped (scatter)", "dropped = torch.ones(tokens, n_groups, dtype=bool).scatter_(1, top_groups, False)", dropped),
        ("top-k experts in kept groups", "indices = torch.topk(choice.masked_fill(dropped[..., None], -inf).flatten(1), k)[1]", indices),
        ("their unbiased scores (gather)", "weights = scores.gather(1, indices)", gathered),
        ("normalised × route_scale", "weights = weights / weights.sum(-1, keepdim=True) * route_scale", weights),
        ("load per expert (bincount)", "torch.bincount(indices.flatten(), minlength=n_experts)",
         torch.bincount(indices.flatten(), minlength=c.n_experts)[None]),
    ]
    return [{"step": name, "code": code, "shape": list(t.shape),
             "values": [[round(float(v), 4) if t.is_floating_point() else int(v) for v in row] for row in t.reshape(t.shape[0], -1)]}
            for name, code, t in steps]


def run(config: RoutingConfig, ctx) -> Result:
    torch.set_num_threads(1)
    c = config
    torch.manual_seed(c.seed)
    layer = moe.MoELayer(c.d_model, c.d_ff, c.n_experts, c.n_shared).double()
    x = torch.randn(c.tokens, c.d_model, dtype=torch.float64)
    skew = c.router_skew * torch.randn(c.n_experts, dtype=torch.float64)
    with torch.no_grad():
        logits = layer.router(x) + skew
        rows = logits.tolist()

        bias = torch.zeros(c.n_experts, dtype=torch.float64)
        balancing = []
        for step in range(c.bias_steps + 1):
            load = moe.deepseek_v3(logits, bias, c.top_k, c.n_groups, c.topk_groups, c.route_scale).load(c.n_experts)
            balancing.append({"step": step, "max_load_over_mean": float(load.max() / load.double().mean()),
                              "min_load_over_mean": float(load.min() / load.double().mean()),
                              "bias_spread": float(bias.max() - bias.min())})
            if step < c.bias_steps:
                bias = moe.update_bias(bias, load, c.bias_rate)

        capacity = moe.expert_capacity(c.tokens, 1, c.n_experts, c.capacity_factor)
        routers = {
            "softmax top-k": (moe.softmax_topk(logits, c.top_k, c.renormalize), ref.softmax_topk(rows, c.top_k, c.renormalize), None),
            "Switch top-1": (moe.switch_top1(logits, c.capacity_factor), ref.switch_top1(rows, c.capacity_factor), None),
            "DeepSeek-V3, bias 0": (moe.deepseek_v3(logits, torch.zeros_like(bias), c.top_k, c.n_groups, c.topk_groups, c.route_scale),
                                    ref.deepseek_v3(rows, [0.0] * c.n_experts, c.top_k, c.n_groups, c.topk_groups, c.route_scale), layer.shared),
            "DeepSeek-V3, balanced bias": (moe.deepseek_v3(logits, bias, c.top_k, c.n_groups, c.topk_groups, c.route_scale),
                                           ref.deepseek_v3(rows, bias.tolist(), c.top_k, c.n_groups, c.topk_groups, c.route_scale), layer.shared),
        }
        exact = ref.capacity(c.tokens, 1, c.n_experts, c.capacity_factor)
        checks = [Check("Switch capacity equals the exact ceil(cf · tokens / N)", abs(capacity - exact), 0,
                        reference=f"least whole C with C · N >= cf · tokens, integers only (= {exact})")]
        loads, summary = [], []
        for i, (name, (routing, want, shared)) in enumerate(routers.items()):
            ctx.progress(0.2 + 0.2 * i, name)
            got = as_routes(routing)
            err, differ = route_error(got, want)
            y = layer.routed(x, routing) + (shared(x) if shared is not None else 0)
            y_ref = ref.layer(x, want, layer.experts, shared)
            load = routing.load(c.n_experts)
            ref_load = [sum(e in r for r in want) for e in range(c.n_experts)]
            chosen = [[int(e) for e in row] for row in routing.indices]
            loss = float(moe.balance_loss(routing, c.n_experts))
            ref_loss = ref.balance_loss(chosen, routing.probs.tolist(), c.n_experts)
            checks += [
                Check(f"{name}: experts and weights per token equal the direct implementation", err, TOL,
                      reference="moe_reference (one token at a time, sorted lists)", detail=f"{differ} tokens with other experts"),
                Check(f"{name}: layer output equals the direct implementation", float((y - y_ref).abs().max()), TOL,
                      reference="each token through each chosen expert alone, weighted sum"),
                Check(f"{name}: load per expert (bincount) equals the count of routes", float(sum(abs(a - b) for a, b in zip(load.tolist(), ref_load))), 0,
                      reference="routes counted in Python"),
                Check(f"{name}: balance loss N·Σ f_i P_i equals the direct sum", abs(loss - ref_loss), TOL, reference="plain-Python sum"),
            ]
            balanced = c.tokens * routing.indices.shape[1] / c.n_experts  # the routes it offers, spread evenly
            loads += [{"router": name, "expert": e, "tokens": int(n), "balanced": balanced} for e, n in enumerate(load.tolist())]
            summary.append({"router": name, "balance_loss": loss, "max_load_over_mean": float(load.max() / load.double().mean()),
                            "experts_unused": int((load == 0).sum()), "dropped_tokens": int((~routing.kept).sum()),
                            "weight_sum_per_token": float(routing.weights.masked_fill(~routing.kept, 0).sum(-1).mean())})
    dropped = summary[1]["dropped_tokens"]
    return Result(
        metrics={"switch_capacity": capacity, "switch_dropped_tokens": dropped,
                 "imbalance_before_bias": balancing[0]["max_load_over_mean"], "imbalance_after_bias": balancing[-1]["max_load_over_mean"],
                 **{f"balance_loss.{s['router']}": s["balance_loss"] for s in summary}},
        tables={"summary": summary, "loads": loads, "balancing": balancing, "bias": [{"expert": e, "bias": b} for e, b in enumerate(bias.tolist())],
                "walkthrough": walkthrough(logits[:WALKTHROUGH_TOKENS], bias, c)},
        checks=checks,
        notes=[f"Switch capacity: ceil({c.capacity_factor} · {c.tokens} / {c.n_experts}) = {capacity} tokens per expert; "
               f"{dropped} tokens were dropped (they skip the layer, keeping only the residual).",
               "The balanced bias changes which experts are chosen, never the weights: those are the unbiased sigmoid scores."])


def _v1_balanced(result: dict) -> None:
    """Version 1 -> 2: each expert's perfectly balanced load, as the page computed it then (k routes per token, one
    for Switch top-1, over n_experts), from the run's stored settings."""
    cfg = result["config"]
    for row in result["tables"]["loads"]:
        row["balanced"] = cfg["tokens"] * (1 if row["router"] == "Switch top-1" else cfg["top_k"]) / cfg["n_experts"]


RESULT = Schema(
    metrics=(
        "switch_capacity", "switch_dropped_tokens", "imbalance_before_bias", "imbalance_after_bias",
        "balance_loss.softmax top-k", "balance_loss.Switch top-1", "balance_loss.DeepSeek-V3, bias 0",
        "balance_loss.DeepSeek-V3, balanced bias",
    ),
    tables={
        "summary": ("balance_loss", "dropped_tokens", "experts_unused", "max_load_over_mean", "router",
                    "weight_sum_per_token"),
        "loads": ("expert", "router", "tokens", "balanced"),
        "balancing": ("bias_spread", "max_load_over_mean", "min_load_over_mean", "step"),
        "bias": ("bias", "expert"),
        "walkthrough": ("code", "shape", "step", "values"),
    },
    version=2, upgrades={1: _v1_balanced},
)

EXPERIMENT = define(__name__, RoutingConfig,
                    "MoE routing: softmax top-k, Switch top-1 with capacity, DeepSeek-V3 group-limited with bias balancing",
                    run_fn=run, schema=RESULT)
