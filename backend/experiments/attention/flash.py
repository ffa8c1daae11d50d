"""attention.flash: attention by one of three paths, checked against torch SDPA, with its memory traffic.

- triton: the FlashAttention-2 kernels; global-memory bytes per tensor counted inside the kernels
  and compared exactly with the closed form for the tiling.
- naive: S and P materialised; bytes per step measured from the tensors.
- tiled: FlashAttention's algorithm in PyTorch, for long sequences on a CPU; peak resident memory
  measured, beside the N² floats naive attention would need.
Also, for every path: seed 003's SRAM budget for the chosen SRAM size and head dim (Br, Bc and the words on
chip at each step of one tile iteration), its stated expressions checked against the step-by-step count.
Error criterion (FlashAttention's own): the implementation's max error against an fp32 SDPA
reference is within 2× that of SDPA computed in the same precision (+1e-6 for round-off in fp32).
"""
from __future__ import annotations

import dataclasses
import math
import resource
import time

import torch

from backend.attention.flash import io_model, online_softmax_example, online_softmax_seed_error, sram_budget, tiled_attention
from backend.config import Config, ConfigError, setting
from backend.limits import cost
from backend.experiments import define
from backend.result import Check, Result, Schema
from kernels.flash_attention import (TENSORS, closed_form_traffic, flash_backward, flash_forward, naive_attention,
                                     sdpa_reference)

POW2 = (16, 32, 64, 128)


@dataclasses.dataclass
class FlashConfig(Config):
    seq_len: int = setting(128, min=1, max=32_768, help="sequence length N")
    head_dim: int = setting(32, choices=POW2, help="head dimension d")
    heads: int = setting(2, min=1, max=32, help="heads")
    batch: int = setting(1, min=1, max=8, help="batch")
    causal: bool = setting(False, help="causal mask")
    block_m: int = setting(32, choices=(16, 32, 64, 128, 256, 512, 1024), help="query rows per tile (Triton: <= 128)")
    block_n: int = setting(32, choices=(16, 32, 64, 128, 256, 512, 1024), help="key/value rows per tile (Triton: <= 128)")
    dtype: str = setting("float32", choices=("float16", "float32", "bfloat16"), help="element type (bfloat16 on a GPU only)")
    impl: str = setting("triton", choices=("naive", "tiled", "triton"), help="which path")
    backward: bool = setting(True, help="also run and check the backward pass")
    sram_kib: int = setting(100, choices=(48, 100, 164, 228), help="on-chip SRAM per SM for the Br/Bc budget (KiB; 4090 100, A100 164, H100 228)")
    seed: int = setting(0, min=0, max=2**31 - 1, help="inputs")

    cost_drivers = ("seq_len", "batch", "heads")

    def estimate(self):
        """The reference holds every score in float64. Triton's interpreter starts in ~0.4 s of CPU, then a program
        (one query block of one head) costs ~7.5 ms before its loop and ~1.5 ms a key block (bench/limits.py: 768
        one-block programs took 7.3 s of CPU, 24 programs of 4 key blocks 1.35 s); the tiled path is a few torch ops a tile."""
        bh, s = self.batch * self.heads, self.seq_len
        passes = 3 if self.backward else 1  # a backward pass is about two forwards
        programs = bh * -(-s // self.block_m) * passes
        tiles = programs * -(-s // self.block_n)
        triton = self.impl == "triton"
        steps = programs * 300 + tiles * 60 if triton else tiles * 40 if self.impl == "tiled" else 0
        return cost(data_bytes=4 * bh * s * s * 8, flops=4 * bh * s * s * self.head_dim * passes * 2, ops=steps,
                    seconds=0.4 if triton else 0.0)

    def check(self) -> None:
        gpu = torch.cuda.is_available()
        work = self.batch * self.heads * self.seq_len ** 2
        if self.dtype == "bfloat16" and not gpu:
            raise ConfigError("dtype", "bfloat16 gives wrong numbers in Triton's interpreter (allowed here: float16, float32)")
        if self.impl == "triton" and not gpu and work > 2 ** 19:
            raise ConfigError("seq_len", f"batch·heads·N² = {work:,} is too slow for Triton's interpreter (allowed: <= {2 ** 19:,}, "
                                         f"e.g. N <= {int(math.sqrt(2 ** 19 / (self.batch * self.heads)))} here)")
        if self.impl == "naive" and work > 2 ** 28:
            raise ConfigError("seq_len", f"naive attention would hold batch·heads·N² = {work:,} scores (allowed: <= {2 ** 28:,})")
        if self.impl == "tiled" and work > 2 ** 31:
            raise ConfigError("seq_len", f"batch·heads·N² = {work:,} is too much work for the CPU (allowed: <= {2 ** 31:,})")
        if self.impl == "triton" and max(self.block_m, self.block_n) > 128:
            field = "block_m" if self.block_m > 128 else "block_n"
            raise ConfigError(field, f"{getattr(self, field)} rows per tile do not fit on chip for the Triton kernel (allowed: 16..128)")
        if self.backward and self.impl == "tiled":
            raise ConfigError("backward", "the tiled PyTorch path is forward only (allowed: false with impl=tiled)")


def _max_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# Seed 003's walk-through of one FlashAttention iteration as printed, in its Br = d case: the words each step adds (+)
# or frees (-), in Bc and d, and the two totals it states. Step 11 ("释放其他变量") gives no figure.
SEED_003_DELTAS = {1: lambda bc, d: 2 * bc * d, 2: lambda bc, d: 2 * d * d + 2 * d, 3: lambda bc, d: bc * d,
                   4: lambda bc, d: -2 * bc * d, 5: lambda bc, d: d + bc * d, 6: lambda bc, d: -bc * d, 7: lambda bc, d: d,
                   8: lambda bc, d: 2 * d, 9: lambda bc, d: -d * d, 10: lambda bc, d: -2 * d}
SEED_003_TOTALS = {3: lambda bc, d: 3 * bc * d + 2 * d * (d + 1), 4: lambda bc, d: bc * d + 2 * d * (d + 1)}


def seed_003_ledger(budget: dict, d: int) -> tuple[Check, str]:
    """Each step's change and the stated totals against seed 003's printed expressions (which assume Br = d). Its step 4
    frees 2·Bc·d for Q and K, counting Q as Bc x d; Q is Br x d, so that step (and the total after it) is compared only
    when Bc = d, and its difference is reported."""
    bc, br = budget["Bc"], budget["Br"]
    applies = br == d
    for st in budget["steps"]:
        n = st["step"]
        st["seed_delta_words"] = SEED_003_DELTAS[n](bc, d) if n in SEED_003_DELTAS and (applies or n == 1) else None
        st["seed_live_words"] = SEED_003_TOTALS[n](bc, d) if n in SEED_003_TOTALS and applies else None
    running = 0  # the seed's own ledger: its printed changes summed, where it prints every one so far
    for st in budget["steps"]:
        running = None if running is None or st["seed_delta_words"] is None else running + st["seed_delta_words"]
        st["seed_ledger_words"] = running
    compared = [st for st in budget["steps"] if st["seed_delta_words"] is not None and (st["step"] != 4 or bc == d)]
    error = sum(abs(st["delta_words"] - st["seed_delta_words"]) for st in compared)
    error += sum(abs(st["live_words"] - st["seed_live_words"]) for st in compared if st["seed_live_words"] is not None)
    step4 = budget["steps"][3]
    if not applies:
        detail, note = "Bc < d here, so Br = Bc and the seed's Br = d expressions apply to step 1 only", \
            f"Seed 003's walk-through assumes Br = d; with Bc = Br = {br} < d = {d} only its step 1 applies."
    else:
        detail = f"steps {', '.join(str(st['step']) for st in compared)} and the total after step 3"
        note = ("Seed 003's step 4 frees 2·Bc·d for Q and K, counting Q as Bc x d; Q is Br x d = d x d, so the tiles free "
                f"Bc·d + d² = {-step4['delta_words']:,} words, not {2 * bc * d:,}; the two agree only when Bc = d "
                f"(here Bc = {bc}), so step 4 is shown beside the seed's figure and not checked.") if bc != d else \
               "With Bc = d every one of seed 003's ten stated steps is compared."
    return Check("seed 003's SRAM walk-through: every step's change equals the seed's printed expression", error, 0,
                 reference="seed 003's per-step expressions (Br = d)", detail=detail), note


def run(config: FlashConfig, ctx) -> Result:
    """Attention by the chosen implementation (timed, its traffic counted), checked against SDPA; then the IO model,
    seed 003's SRAM budget and seed 000's online-softmax example, and the tile schedule for the page."""
    torch.set_num_threads(1)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, config.dtype)
    B, H, N, D = config.batch, config.heads, config.seq_len, config.head_dim
    g = torch.Generator().manual_seed(config.seed)
    q32, k32, v32 = (torch.randn(B, H, N, D, generator=g).to(device) for _ in range(3))
    do32 = torch.randn(B, H, N, D, generator=g).to(device)
    q, k, v, do = (t.to(dtype) for t in (q32, k32, v32, do32))
    ctx.progress(0.05, f"{config.impl} forward")
    out, grads, metrics, tables, checks = attend(config, q, k, v, do, ctx)
    metrics = {"device": device, "impl": config.impl, **metrics}
    ctx.progress(0.7, "reference")
    checks += accuracy_checks(config, out, grads, (q32, k32, v32, do32), (q, k, v, do))
    model_metrics, model_tables, model_checks, notes = models_and_seeds(config, q.element_size())
    metrics.update(model_metrics)
    tables.update(model_tables)
    checks += model_checks
    tables["tile_steps"] = steps = []
    if N <= 256:  # the tile schedule of (batch 0, head 0), replayed by the same algorithm in PyTorch, for the page
        tiled_attention(q32[0, 0], k32[0, 0], v32[0, 0], config.causal, config.block_m, config.block_n,
                        on_step=lambda i, j, m, l: steps.append({"step": len(steps), "q_tile": i, "kv_tile": j,
                                                                 "m": m.tolist(), "l": l.tolist()}))
    tables["tile_grid"] = tile_grid(steps, N, config.block_m, config.block_n)
    if config.impl == "tiled" and N >= 8192:
        notes.append(f"Resident memory grew by {metrics['peak_resident_growth_bytes'] / 2**20:.1f} MiB while the tiled "
                     f"path ran; naive attention would hold {B * H * N * N * 4 / 2**30:.2f} GiB of scores.")
    return Result(metrics=metrics, tables=tables, checks=checks, notes=notes)


def attend(config: FlashConfig, q, k, v, do, ctx):
    """The chosen implementation's forward (and, for Triton, backward), timed, with the resident memory it grew by and
    the bytes it moved: counted inside the Triton kernels (checked against the closed form) or by the naive path.
    Returns the output, the gradients (None unless computed), metrics, tables and checks."""
    B, H, N, D = config.batch, config.heads, config.seq_len, config.head_dim
    metrics, tables, checks = {}, {"traffic": []}, []  # the tiled path counts no traffic
    rss_before = _max_rss_bytes()
    start = time.perf_counter()
    grads = None
    if config.impl == "triton":
        counters = torch.zeros(len(TENSORS), dtype=torch.int64, device=q.device)
        out, lse = flash_forward(q, k, v, config.causal, config.block_m, config.block_n, counters)
        fwd_counts = counters.clone()
        if config.backward:
            ctx.progress(0.4, "triton backward")
            grads = flash_backward(q, k, v, out, lse, do, config.causal, config.block_m, config.block_n, counters)
        counted = dict(zip(TENSORS, counters.tolist()))
        closed = closed_form_traffic(B, H, N, D, q.element_size(), config.causal, config.block_m, config.block_n, config.backward)
        tables["traffic"] = [{"tensor": t, "pass": "forward", "bytes": int(c)} for t, c in zip(TENSORS, fwd_counts.tolist()) if c] + \
                            [{"tensor": t, "pass": "backward", "bytes": int(counted[t] - f)} for t, f in zip(TENSORS, fwd_counts.tolist()) if counted[t] - f] + \
                            [{"tensor": "S", "pass": "forward", "bytes": 0}, {"tensor": "P", "pass": "forward", "bytes": 0}]
        checks.append(Check("bytes counted in the kernels equal the closed form for the tiling",
                            sum(abs(counted[t] - closed[t]) for t in TENSORS), 0, reference="tile geometry",
                            detail=f"{sum(counted.values()):,} bytes counted"))
        metrics["hbm_bytes_counted"] = sum(counted.values())
    elif config.impl == "naive":
        out, traffic = naive_attention(q, k, v, config.causal)
        tables["traffic"] = [{"tensor": t, "pass": "forward", "bytes": b} for t, b in traffic.items()]
        metrics["hbm_bytes_counted"] = sum(traffic.values())
    else:
        out = tiled_attention(q, k, v, config.causal, config.block_m, config.block_n)
    metrics["seconds"] = round(time.perf_counter() - start, 4)
    metrics["peak_resident_growth_bytes"] = max(0, _max_rss_bytes() - rss_before)
    metrics["naive_scores_bytes_would_be"] = B * H * N * N * 4
    return out, grads, metrics, tables, checks


def accuracy_checks(config: FlashConfig, out, grads, fp32: tuple, same: tuple) -> list[Check]:
    """The output (and gradients) against torch's SDPA in fp32, within twice SDPA's own error in the dtype:
    FlashAttention's criterion. `fp32` and `same` are (q, k, v, dO) in fp32 and in the dtype."""
    dtype = same[0].dtype
    ref32, grads32 = sdpa_reference(*fp32[:3], config.causal, fp32[3] if config.backward else None)
    ref_same, grads_same = sdpa_reference(*same[:3], config.causal, same[3] if config.backward else None)
    err, err_ref = (out.float() - ref32).abs().max().item(), (ref_same.float() - ref32).abs().max().item()
    slack = 1e-6 if dtype == torch.float32 else 0.0
    checks = [Check(f"forward: error vs fp32 SDPA within 2× SDPA's own in {config.dtype}", err, 2 * err_ref + slack,
                    reference="torch scaled_dot_product_attention (fp32, and in the same dtype)",
                    detail=f"SDPA in {config.dtype}: {err_ref:.3g}")]
    if grads is not None:
        for name, mine, ref, same_grad in zip(("dQ", "dK", "dV"), grads, grads32, grads_same):
            e, e_ref = (mine.float() - ref).abs().max().item(), (same_grad.float() - ref).abs().max().item()
            checks.append(Check(f"backward {name}: error vs fp32 SDPA within 2× SDPA's own", e, 2 * e_ref + (1e-5 if dtype == torch.float32 else 0.0),
                                reference="autograd through torch SDPA", detail=f"SDPA in {config.dtype}: {e_ref:.3g}"))
    return checks


def models_and_seeds(config: FlashConfig, elem: int):
    """The IO model's traffic and the forward FLOPs; seed 003's SRAM budget walked step by step (checked against the
    seed's printed expressions) and seed 000's online-softmax example. Returns metrics, tables, checks, notes."""
    B, H, N, D = config.batch, config.heads, config.seq_len, config.head_dim
    metrics = {f"io_model.{k}": v for k, v in io_model(N, D, elem, config.block_m, config.block_n, B * H, config.causal).items()}
    metrics["forward_flops"] = 4 * N * N * D * B * H * (0.5 if config.causal else 1)
    budget = sram_budget(config.sram_kib * 1024, D, elem)
    metrics.update({"sram.Br": budget["Br"], "sram.Bc": budget["Bc"], "sram.words": budget["sram_words"],
                    "sram.peak_words": budget["peak_words"], "sram.peak_share": budget["peak_words"] / budget["sram_words"]})
    check, note = seed_003_ledger(budget, D)
    tables = {"sram_budget": budget["steps"], "online_softmax_example": online_softmax_example()}
    error, detail = online_softmax_seed_error(tables["online_softmax_example"])
    return metrics, tables, [check, Check(
        "seed 000's online-softmax example: the tiled update gives the seed's m, f, rescale and l",
        error, 1e-12, reference="seed 000, FlashAttention tiling example (x1 = [1, 2], x2 = [3, 4]); "
                                "torch.softmax for the normalised result", detail=detail)], [note]


def tile_grid(steps: list[dict], n: int, block_m: int, block_n: int) -> list[dict]:
    """Every (Q tile, K/V tile) of the score matrix with the step that computed it, None for a tile the schedule
    skipped (above the causal diagonal): the page's grid, coloured against the step chosen. Empty with no steps."""
    when = {(s["q_tile"], s["kv_tile"]): s["step"] for s in steps}
    return [{"q_tile": i, "kv_tile": j, "step": when.get((i, j))}
            for i in range(-(-n // block_m)) for j in range(-(-n // block_n))] if steps else []


def _v3_to_v4(result: dict) -> None:
    """Version 3 -> 4: the tile grid from the stored steps (the page searched the steps for each tile before)."""
    cfg = result["config"]
    result["tables"]["tile_grid"] = tile_grid(result["tables"]["tile_steps"], cfg["seq_len"], cfg["block_m"], cfg["block_n"])


def _v1_to_v2(result: dict) -> None:
    """Version 1 left out the traffic table where nothing was counted (the tiled path) and the tile steps above 256
    tokens; version 2 holds them empty."""
    result["tables"].setdefault("traffic", [])
    result["tables"].setdefault("tile_steps", [])


def _v2_to_v3(result: dict) -> None:
    """Version 2 -> 3: the budget's peak as a share of M (the page divided them before)."""
    m = result["metrics"]
    m["sram.peak_share"] = m["sram.peak_words"] / m["sram.words"]


RESULT = Schema(
    metrics=(
        "device", "impl", "hbm_bytes_counted", "seconds", "peak_resident_growth_bytes", "naive_scores_bytes_would_be",
        "io_model.sram_bytes_per_step", "io_model.standard_bytes", "io_model.flash_bytes",
        "io_model.flash_theta_N2d2_over_M", "forward_flops", "sram.Br", "sram.Bc", "sram.words", "sram.peak_words",
        "sram.peak_share",
    ),
    tables={
        "traffic": ("bytes", "pass", "tensor"),
        "sram_budget": ("delta_words", "live_bytes", "live_words", "seed_delta_words", "seed_ledger_words",
                        "seed_live_words", "step", "what"),
        "online_softmax_example": ("block", "f", "f_block", "f_so_far", "l", "l_closed_form", "m", "m_before",
                                   "reference_softmax", "rescale_exp(m_old-m)", "softmax"),
        "tile_steps": ("kv_tile", "l", "m", "q_tile", "step"),  # (batch 0, head 0) up to 256 tokens, else empty
        "tile_grid": ("q_tile", "kv_tile", "step"),  # every tile of tile_steps' grid, step None where skipped
    },
    optional=("hbm_bytes_counted",),  # the tiled path counts no traffic
    version=4, upgrades={1: _v1_to_v2, 2: _v2_to_v3, 3: _v3_to_v4},
)

EXPERIMENT = define(__name__, FlashConfig,
         "attention naive, tiled (PyTorch) or FlashAttention-2 in Triton: error vs SDPA, traffic counted in the kernel",
         run_fn=run, schema=RESULT)
