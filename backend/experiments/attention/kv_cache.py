"""attention.kv_cache: generate with a real KV cache for MHA, MQA, GQA and MLA; measure the cache.

For each variant: the cache bytes per token per layer read off the cache tensors, beside the seed's
formula (MHA 2·n_h·d_h, GQA 2·n_g·d_h, MQA 2·d_h, MLA d_c + d_h^R, all × l layers); greedy decoding
with the cache checked against full recomputation; decode time per token as the context grows, with
the cache bytes each step reads. For MLA, the absorbed form (caches c_KV and k^R) is checked against
the naive one (expands, caches K and V) with the same weights. A model with DeepSeek-V3's
proportions scaled down 16× in width (128 heads, d_h 8, d_c 32, d_h^R 4) is measured live beside
DeepSeek-V3's own shape by formula.
"""
from __future__ import annotations

import dataclasses
import time

import numpy as np
import torch

from backend.attention.mla_rope import absorption_errors
from backend.attention.rope import relative_position_error
from backend.attention.variants import cache_formula_elements, mla_dataflow
from backend.config import Config, ConfigError, setting
from backend.limits import cost
from backend.experiments import define
from backend.graph.dot import to_dot
from backend.models.llama import ModelShape, TinyDecoder
from backend.result import Check, Result, Schema

VARIANTS = ("mha", "mqa", "gqa", "mla")
# fp32 logits of the same maths in another order (cached vs full, absorbed vs naive): well inside 1e-4.
LOGIT_TOLERANCE = 1e-4

# GPU memory (GiB) the tables of tokens that fit are drawn for.
GPUS = {"RTX 4090 (24 GiB)": 24, "A100 / H100 (80 GiB)": 80, "H200 (141 GiB)": 141}
# Published shapes, for the formula-only table (bf16 cache, 2 bytes per element).
PRESETS = {
    "LLaMA-2-7B (MHA)": dict(variant="mha", n_layers=32, n_heads=32, n_kv_heads=32, d_head=128, d_c=0, d_rope=0),
    "LLaMA-3-8B (GQA)": dict(variant="gqa", n_layers=32, n_heads=32, n_kv_heads=8, d_head=128, d_c=0, d_rope=0),
    "DeepSeek-V2 (MLA)": dict(variant="mla", n_layers=60, n_heads=128, n_kv_heads=128, d_head=128, d_c=512, d_rope=64),
    "DeepSeek-V3 (MLA)": dict(variant="mla", n_layers=61, n_heads=128, n_kv_heads=128, d_head=128, d_c=512, d_rope=64),
}


@dataclasses.dataclass
class KVCacheConfig(Config):
    variant: str = setting("all", choices=("all",) + VARIANTS, help="which attention to measure (all: each in turn)")
    n_heads: int = setting(8, min=1, max=128, help="query heads n_h")
    n_kv_heads: int = setting(2, min=1, max=128, help="K/V heads n_g for GQA (MHA uses n_h, MQA 1)")
    d_head: int = setting(16, min=2, max=128, help="head dimension d_h (even, for RoPE)")
    d_c: int = setting(64, min=1, max=1024, help="MLA latent dimension d_c")
    d_rope: int = setting(8, min=2, max=128, help="MLA decoupled RoPE dimension d_h^R (even)")
    n_layers: int = setting(2, min=1, max=8, help="layers l")
    context: int = setting(128, min=8, max=1024, help="tokens in the sequence (half prompt, half generated)")
    seed: int = setting(0, min=0, max=2**31 - 1, help="weights and prompt")

    cost_drivers = ("n_layers", "context", "n_heads", "d_head")

    def estimate(self):
        """Each variant's fp32 model (plus MLA's naive twin) generates `context` tokens, checked against a full
        recomputation: three passes of 2·params flops per token."""
        d_model = max(64, self.n_heads * self.d_head // 2)
        params = self.n_layers * 12 * d_model * max(d_model, self.d_c, self.n_heads * self.d_head)
        variants = len(VARIANTS) + 1 if self.variant == "all" else 2
        scores = self.n_heads * self.context * self.context * 4  # the full recomputation's attention, per layer
        return cost(data_bytes=3 * params * 4 + 4 * self.context * self.n_layers * self.n_heads * self.d_head * 4 + 3 * scores,
                    flops=variants * 3 * 2 * params * self.context,
                    ops=variants * 3 * self.context * self.n_layers * (2 + self.n_heads / 4))  # 0.35 s at 2 layers, 1.6 s at 7 measured

    def check(self) -> None:
        if self.n_heads % self.n_kv_heads:
            raise ConfigError("n_kv_heads", f"{self.n_kv_heads} does not divide n_heads={self.n_heads} (allowed: a divisor of n_heads)")
        if self.d_head % 2:
            raise ConfigError("d_head", f"{self.d_head} is odd (allowed: an even number in 2..128, RoPE rotates pairs)")
        if self.d_rope % 2:
            raise ConfigError("d_rope", f"{self.d_rope} is odd (allowed: an even number in 2..128, RoPE rotates pairs)")

    def shape(self, variant: str, mla_mode: str = "absorbed") -> ModelShape:
        return ModelShape(vocab=256, d_model=max(64, self.n_heads * self.d_head // 2), n_layers=self.n_layers,
                          n_heads=self.n_heads, n_kv_heads=self.n_kv_heads, d_head=self.d_head, d_c=self.d_c,
                          d_rope=self.d_rope, d_cq=max(self.d_c, 16), d_ff=256, variant=variant, mla_mode=mla_mode)


def _model(shape: ModelShape, seed: int) -> TinyDecoder:
    torch.manual_seed(seed)
    return TinyDecoder(shape).eval()


@torch.no_grad()
def generate(model: TinyDecoder, prompt: torch.Tensor, total: int):
    """Greedy decoding with the cache. Returns tokens, the logits of every position, per-step timings, caches."""
    caches = model.new_caches(total)
    logits = [model(prompt, 0, caches)]
    tokens = list(prompt.tolist())
    steps = []
    while len(tokens) < total:
        nxt = int(logits[-1][-1].argmax())
        pos = len(tokens)
        tokens.append(nxt)
        read = sum(c.bytes_used() for c in caches)  # this step attends over everything cached so far
        start = time.perf_counter()
        logits.append(model(torch.tensor([nxt]), pos, caches))
        steps.append({"context": pos, "ms_per_token": (time.perf_counter() - start) * 1e3, "cache_bytes_read": read,
                      "start_s": start})
    return torch.tensor(tokens), torch.cat(logits), steps, caches


def measure_variant(config: KVCacheConfig, variant: str) -> dict:
    shape = config.shape(variant)
    model = _model(shape, config.seed)
    g = torch.Generator().manual_seed(config.seed + 1)
    prompt = torch.randint(0, shape.vocab, (config.context // 2,), generator=g)
    tokens, cached_logits, steps, caches = generate(model, prompt, config.context)
    with torch.no_grad():
        full_logits = model(tokens)
    measured = sum(c.bytes_used() for c in caches) / (len(tokens) * shape.n_layers)
    item = caches[0].tensors[next(iter(caches[0].tensors))].element_size()
    formula = cache_formula_elements(variant, shape.n_heads, shape.n_kv_heads, shape.d_head, shape.d_c, shape.d_rope,
                                     1, "absorbed") * item
    out = {"variant": variant, "bytes_per_token_per_layer": measured, "formula_bytes": formula,
           "elements_per_token_per_layer": measured / item,
           "cache_tensors": {k: list(v.shape[1:]) for k, v in caches[0].tensors.items()},
           "decode_error": (cached_logits - full_logits).abs().max().item(), "steps": steps}
    if variant == "mla":
        naive = _model(config.shape("mla", "naive"), config.seed)
        naive.load_state_dict(model.state_dict())
        _, _, _, naive_caches = generate(naive, prompt, config.context)
        with torch.no_grad():  # same tokens through both forms
            out["absorbed_vs_naive_error"] = (naive(tokens) - full_logits).abs().max().item()
        out["naive_bytes_per_token_per_layer"] = sum(c.bytes_used() for c in naive_caches) / (len(tokens) * shape.n_layers)
    return out


# The decode-speed chart: a centred rolling median over this many steps, and Tukey's far fence (quartile ± 3 IQR).
ROLLING_STEPS = 9
FENCE_IQR = 3.0


def decode_speed_view(rows: list[dict]) -> dict:
    """The decode-speed chart's summary, drawn by the page. Each step gets its variant's centred rolling median of
    ROLLING_STEPS steps (`median_ms`, in place): one step the OS descheduled (a 100 ms spike) must not flatten the
    others. The axis spans the variants' far fences (Q1 − 3 IQR below ×0.8, floored at 0; Q3 + 3 IQR above ×1.2), not a
    quantile of all steps: on a busy machine more than 2 % of the steps can be descheduled ones; the steps above it
    are counted as off the chart."""
    if not rows:
        return {"axis_low_ms": None, "axis_high_ms": None, "off_chart_steps": 0, "slowest_ms": None}
    lows, highs, half = [], [], ROLLING_STEPS // 2
    for variant in dict.fromkeys(r["variant"] for r in rows):
        steps = sorted((r for r in rows if r["variant"] == variant), key=lambda r: r["context"])
        ms = np.array([r["ms_per_token"] for r in steps])
        for i, r in enumerate(steps):
            r["median_ms"] = float(np.median(ms[max(0, i - half): i + half + 1]))
        q1, q3 = np.quantile(ms, [0.25, 0.75])
        lows.append(q1 - FENCE_IQR * (q3 - q1))
        highs.append(q3 + FENCE_IQR * (q3 - q1))
    top = float(max(highs)) * 1.2
    slowest = max(r["ms_per_token"] for r in rows)
    return {"axis_low_ms": max(0.0, float(min(lows)) * 0.8), "axis_high_ms": top,
            "off_chart_steps": sum(r["ms_per_token"] > top for r in rows), "slowest_ms": slowest}


def deepseek_scaled(seed: int) -> dict:
    """DeepSeek-V3's head count with every width /16: cache elements per token per layer, MHA vs MLA, measured."""
    cfg = KVCacheConfig(n_heads=128, n_kv_heads=128, d_head=8, d_c=32, d_rope=4, n_layers=1, context=16, seed=seed)
    measured = {v: measure_variant(cfg, v)["elements_per_token_per_layer"] for v in ("mha", "mla")}
    return {"mha_elements": measured["mha"], "mla_elements": measured["mla"], "ratio": measured["mla"] / measured["mha"]}


def preset_table() -> list[dict]:
    """The published shapes by formula (bf16 cache), and the tokens whose cache fits each GPU's memory, all layers."""
    rows = []
    for gpu, gib in GPUS.items():
        for name, p in PRESETS.items():
            per_token = cache_formula_elements(p["variant"], p["n_heads"], p["n_kv_heads"], p["d_head"], p["d_c"], p["d_rope"], p["n_layers"])
            rows.append({"gpu": gpu, "model": name, "elements_per_token_per_layer": per_token // p["n_layers"],
                         "bytes_per_token_bf16": per_token * 2, "tokens_that_fit": int(gib * 2**30 // (per_token * 2))})
    return rows


def live_fit(rows: list[dict], n_layers: int) -> list[dict]:
    """The measured variants: tokens whose fp32 cache (all layers) fits each GPU's memory."""
    return [{"gpu": gpu, "variant": r["variant"], "tokens": int(gib * 2**30 // (r["bytes_per_token_per_layer"] * n_layers))}
            for gpu, gib in GPUS.items() for r in rows]


def mla_dataflow_dots(config: KVCacheConfig) -> list[dict]:
    """MLA's dataflow for one token at the measured MLA model's own shape, absorbed and naive, as DOT."""
    s = config.shape("mla")
    return [{"form": form, "dot": to_dot(mla_dataflow(s.n_heads, s.d_head, s.d_c, s.d_rope, s.d_cq, s.d_model, form == "absorbed"),
                                         rankdir="TB")} for form in ("absorbed", "naive")]


def rope_absorption(config: KVCacheConfig) -> tuple[list[Check], list[dict], dict]:
    """MLA's absorbed scores against the naive ones in float64, with RoPE on the compressed keys (seed 000's attempt,
    which must fail) and with decoupled RoPE (which must hold to rounding): see backend/attention/mla_rope.py."""
    even = config.d_c + config.d_c % 2  # seed 000's attempt rotates the latents, so they need an even width
    e = absorption_errors(T=min(config.context, 64), d_c=even, d_cq=max(even, 16), n_heads=config.n_heads,
                          d_head=config.d_head, d_rope=config.d_rope, seed=config.seed)
    comp, dec = e["compressed"], e["decoupled"]
    checks = [
        Check("mla, decoupled RoPE: absorbed (caches c_KV, k^R) equals naive, float64", dec["relative"], 1e-12,
              reference="naive scores [W^UQ c_Q; R_m q^R]·[W^UK c_KV; R_n k^R] per head, float64",
              detail=f"max |error| {dec['max_abs']:.1e} on scores up to {dec['scale']:.1f}"),
        Check("mla, RoPE on the compressed keys: absorbed departs from naive (it must)", 1e-2 / max(comp["relative"], 1e-300), 1.0,
              reference="naive scores (R_m W^UQ c_Q)·(R_n W^UK c_KV) per head, float64",
              detail=f"error here = 1e-2 / relative error, passes above 1 %: relative error {comp['relative']:.2f} "
                     f"(max |error| {comp['max_abs']:.1f})"),
        Check("mla, RoPE on the compressed keys: absorbed equals naive at m = n = 0 (R_0 = I)", comp["at_origin"] / comp["scale"], 1e-12,
              reference="the same naive score at position 0, where the rotation is the identity"),
    ]
    metrics = {"mla_rope.compressed_relative_error": comp["relative"], "mla_rope.decoupled_relative_error": dec["relative"]}
    return checks, e["rows"], metrics


def run(config: KVCacheConfig, ctx) -> Result:
    torch.set_num_threads(1)
    variants = VARIANTS if config.variant == "all" else (config.variant,)
    rows, speed, checks, events = [], [], [], []
    origin = time.perf_counter()
    for i, v in enumerate(variants):
        ctx.progress(i / (len(variants) + 1), f"generating with {v}")
        m = measure_variant(config, v)
        rows.append({k: m[k] for k in ("variant", "bytes_per_token_per_layer", "formula_bytes", "elements_per_token_per_layer")}
                    | {"cache_tensors": str(m["cache_tensors"])})
        speed += [{k: val for k, val in s.items() if k != "start_s"} | {"variant": v} for s in m["steps"]]
        events += [{"name": f"{v} decode at context {s['context']}", "lane": v, "rank": 0,
                    "ts": (s["start_s"] - origin) * 1e6, "dur": s["ms_per_token"] * 1e3,
                    "args": {"kind": "forward", "cache_bytes_read": s["cache_bytes_read"]}} for s in m["steps"]]
        checks.append(Check(f"{v}: cache bytes per token per layer equal the formula", abs(m["bytes_per_token_per_layer"] - m["formula_bytes"]),
                            0.0, reference="seed formula × 4 bytes (fp32)", detail=f"{m['bytes_per_token_per_layer']:.0f} B measured"))
        checks.append(Check(f"{v}: decoding with the cache equals full recomputation", m["decode_error"], LOGIT_TOLERANCE,
                            reference="forward over the whole sequence, no cache", detail="max |logit difference|, fp32"))
        if v == "mla":
            checks.append(Check("mla: absorbed (caches c_KV, k^R) equals naive (caches K, V)", m["absorbed_vs_naive_error"],
                                LOGIT_TOLERANCE, reference="naive MLA with the same weights", detail="max |logit difference|, fp32"))
            rows.append({"variant": "mla (naive)", "bytes_per_token_per_layer": m["naive_bytes_per_token_per_layer"],
                         "formula_bytes": config.n_heads * (2 * config.d_head + config.d_rope) * 4,
                         "elements_per_token_per_layer": m["naive_bytes_per_token_per_layer"] / 4, "cache_tensors": "k, v per head"})
    checks.append(Check("RoPE: q_m·k_n depends only on m - n", relative_position_error(config.d_head), 1e-10,
                        reference="the same dot products at shifted positions (float64)"))
    rope_rows = []
    if "mla" in variants:
        rope_checks, rope_rows, rope_metrics = rope_absorption(config)
        checks += rope_checks
    ctx.progress(len(variants) / (len(variants) + 1), "DeepSeek-V3 proportions")
    ds = deepseek_scaled(config.seed)
    checks.append(Check("DeepSeek-V3 proportions: MLA/MHA cache ratio measured equals 576/32768", abs(ds["ratio"] - 576 / 32768), 1e-12,
                        reference="formula on DeepSeek-V3's shape", detail=f"{ds['mla_elements']:.0f} vs {ds['mha_elements']:.0f} elements"))
    mha = next((r["bytes_per_token_per_layer"] for r in rows if r["variant"] == "mha"), None)
    for r in rows:
        r["saving_vs_mha_pct"] = None if mha is None else 100 * (1 - r["bytes_per_token_per_layer"] / mha)
    metrics = {"context": config.context, "n_layers": config.n_layers, "dtype": "float32",
               "deepseek_v3_formula_elements": {"mla": 512 + 64, "mha": 2 * 128 * 128},
               "deepseek_v3_scaled_measured_elements": {"mla": ds["mla_elements"], "mha": ds["mha_elements"]},
               "deepseek_v3_scaled_mla_over_mha_pct": 100 * ds["ratio"]}
    for r in rows:
        metrics[f"bytes_per_token_per_layer.{r['variant']}"] = r["bytes_per_token_per_layer"]
    if rope_rows:
        metrics.update(rope_metrics)
    metrics.update({f"decode_speed.{k}": v for k, v in decode_speed_view(speed).items()})
    return Result(metrics=metrics, checks=checks,
                  tables={"cache": rows, "decode_speed": speed, "presets": preset_table(), "fit": live_fit(rows, config.n_layers),
                          "mla_dataflow": mla_dataflow_dots(config), "mla_rope": rope_rows}, trace_events=events,
                  notes=["Timings are for a tiny fp32 model on this machine's CPU; at this size, time per token is "
                         "dominated by per-layer overheads, not by reading the cache."])


def _v1_to_v2(result: dict) -> None:
    """Runs stored before the live fit per GPU and the MLA dataflow were tabled, and when the published presets were
    tabled for the 80 GiB GPUs only: empty tables say what was not computed, and the presets' rows name their GPU."""
    result["tables"].setdefault("fit", [])
    result["tables"].setdefault("mla_dataflow", [])
    eighty = next(gpu for gpu, gib in GPUS.items() if gib == 80)
    for row in result["tables"]["presets"]:
        row.setdefault("gpu", eighty)


def _v2_to_v3(result: dict) -> None:
    """Runs stored before the measured MLA/MHA share was a metric (the page divided the elements)."""
    ds = result["metrics"]["deepseek_v3_scaled_measured_elements"]
    result["metrics"]["deepseek_v3_scaled_mla_over_mha_pct"] = 100 * ds["mla"] / ds["mha"]


def _v3_to_v4(result: dict) -> None:
    """Runs stored before the decode-speed chart's rolling median and axis range were computed here (the page did)."""
    result["metrics"].update({f"decode_speed.{k}": v for k, v in decode_speed_view(result["tables"]["decode_speed"]).items()})


RESULT = Schema(
    metrics=(
        "context", "n_layers", "dtype", "deepseek_v3_formula_elements", "deepseek_v3_scaled_measured_elements",
        "deepseek_v3_scaled_mla_over_mha_pct",
        "bytes_per_token_per_layer.*",  # one per variant measured (and "mla (naive)")
        "mla_rope.compressed_relative_error", "mla_rope.decoupled_relative_error",
        "decode_speed.axis_low_ms", "decode_speed.axis_high_ms", "decode_speed.off_chart_steps", "decode_speed.slowest_ms",
    ),
    tables={
        "cache": ("bytes_per_token_per_layer", "cache_tensors", "elements_per_token_per_layer", "formula_bytes",
                  "saving_vs_mha_pct", "variant"),
        "decode_speed": ("cache_bytes_read", "context", "median_ms", "ms_per_token", "variant"),
        "presets": ("bytes_per_token_bf16", "elements_per_token_per_layer", "gpu", "model", "tokens_that_fit"),
        "fit": ("gpu", "tokens", "variant"),  # empty in a run of version 1
        "mla_dataflow": ("dot", "form"),      # empty in a run of version 1
        "mla_rope": ("max_abs_error", "path", "query_position", "relative_error"),  # empty unless MLA was measured
    },
    optional=("mla_rope.compressed_relative_error", "mla_rope.decoupled_relative_error"),  # MLA measured only
    version=4, upgrades={1: _v1_to_v2, 2: _v2_to_v3, 3: _v3_to_v4},
)

EXPERIMENT = define(__name__, KVCacheConfig,
         "MHA/MQA/GQA/MLA generation with a real KV cache: bytes per token measured vs formula, MLA absorbed vs naive",
         run_fn=run, schema=RESULT)
