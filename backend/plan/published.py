"""Published measurements the planner is held to, and the fit of its few constants.

Analytic memory rows (exact formulas, to the last printed digit): Korthikanti et al. 2022, Fig. 1; ZeRO
(Rajbhandari et al. 2020), Fig. 1. Measured rows: torchtitan's H100 benchmark (docs/performance.md, Table 1 and its
128-GPU run), the Llama 3 paper's 405B pre-training, Narayanan et al. 2021's GPT-3 175B on 1,024 A100s.

The constants (the share of peak a full wave of GEMM tiles sustains on Ampere, on Hopper at 700 W and on the 500 W
H100 96GB; attention's ratio to it; the caching allocator's fragmentation fraction) are fitted ONLY on the rows
marked "calibration"; every "validation" row is predicted with those constants and its error reported apart.
"""
from __future__ import annotations

import dataclasses
import functools

from backend.plan import costs
from backend.plan import models as M
from backend.plan.clusters import GPUS, Cluster
from backend.plan.predict import Efficiency, Plan, evaluate, reserved_bytes, validate

GiB = 2 ** 30

# Korthikanti et al. 2022, Fig. 1 (s = 2048, t = 8): (model, pp, virtual stages, micro-batch, micro-batches in flight
# needed for the steady state), and the figure's GiB: parameters+optimizer, activations without recompute, with
# sequence parallel + selective recompute. 530B's 139 = L(1 + (p−1)/(p·v)) with v = 3 (one layer per chunk).
KORTHIKANTI = [
    ("megatron-gpt-22b", 1, 1, 4, 1, 45.5625, 59.25, 9.5625),
    ("megatron-gpt-175b", 8, 3, 1, 64, 45.5625, 66.84375, 12.3515625),
    ("megatron-gpt-530b", 35, 3, 1, 70, 31.640625, 114.0234375, 23.076171875),
    ("megatron-gpt-1t", 64, 1, 1, 64, 32.958984375, 131.25, 26.5625),
]
KORTHIKANTI_SOURCE = "Korthikanti et al. 2022, Reducing Activation Recomputation in Large Transformer Models, Fig. 1"

# ZeRO Fig. 1: ψ = 7.5B, K = 12, N_d = 64: GB per device
ZERO = [("ddp", 120.0), ("zero1", 31.4), ("zero2", 16.6), ("zero3", 1.9)]
ZERO_SOURCE = "Rajbhandari et al. 2020, ZeRO, Fig. 1 (7.5B parameters, K = 12, 64 GPUs)"


def korthikanti_cells(name: str, pp: int, vp: int, micro: int, m: int) -> dict[str, float]:
    """The three cells the planner computes for one Fig. 1 model: 18 bytes (fp16 weights, fp32 gradients, Adam's
    fp32 master, m, v) per layer-matrix parameter over t·p; the first stage's activations by the schedule."""
    from backend.plan.predict import memory
    model = M.load(name)
    psi = M.matrix_params_per_layer(model) * model.layers / (8 * pp)
    states = sum(costs.state_bytes(psi, 1, "ddp", 4).values())
    out = {"parameters+optimizer": states / GiB}
    for label, rec, sp in (("activations, no recompute", "none", False), ("activations, SP + selective", "selective", True)):
        plan = Plan(tp=8, sp=sp, pp=pp, vp=vp, schedule="interleaved_1f1b" if vp > 1 else "1f1b", dp_strategy="ddp",
                    micro_batch=micro, global_batch=micro * m, seq_len=2048, recompute=rec)
        cluster = Cluster(GPUS["A100 80GB SXM"], nodes=pp)
        out[label] = memory(model, cluster, plan, validate(model, cluster, plan))["_stages"]["first"]["activations (layers)"] / GiB
    return out


def zero_cells() -> dict[str, float]:
    return {s: sum(costs.state_bytes(7.5e9, 64, s, 2).values()) / 1e9 for s, _ in ZERO}


@dataclasses.dataclass(frozen=True)
class Row:
    name: str
    role: str                 # calibration | validation
    model: str
    gpu: str
    nodes: int
    plan: Plan
    quantity: str             # tokens_per_s_per_gpu | hardware_tflops_per_gpu | model_tflops_per_gpu | reserved_gib | train_days
    published: float
    tolerance: float
    source: str
    tokens: float = 0.0


_TT = ("torchtitan docs/performance.md (Dec 2024): Llama 3.1 8B, FSDP, H100 96GB HBM2e 500 W, local batch 2, seq 8192, selective AC; "
       "attention by PyTorch SDPA's flash backend, FlashAttention-2 (cuDNN opt-in on H100 since pytorch/pytorch#138522; "
       "#142132: SDPA 329 TFLOP/s against cuDNN's 631 on H100, Dec 2024 nightly)")
_L3_KERNEL = ("attention kernel not stated in the paper: FlashAttention-3's published H100 speeds taken (the fastest bf16 H100 "
              "kernel of 2024, co-written at Meta), a lower bound on attention's time; the CP row under each kernel is reported")
_L3 = ("Llama 3 paper (Dubey et al. 2024), Table 4: 405B, 8,192 H100, TP 8, CP 1, PP 16, DP 64, seq 8,192, 16M tokens a batch; Sec. "
       "3.3.2: interleaved, one layer removed from the first and the last stage so that 'the first model chunk on the first stage has "
       "only the embedding': one-layer chunks, v = 128/16 = 8; " + _L3_KERNEL)
_L3_16K = ("Llama 3 paper, Table 4: 16,384 H100, TP 8, PP 16, DP 128 at seq 8,192 (400 TFLOP/s, 41%) or CP 16, DP 8 at 131,072 "
           "(380, 38%), 16M tokens a batch; v = 8 inferred from Sec. 3.3.2 (one-layer chunks), the paper prints no v; CP: Sec. "
           "3.3.2's all-gather of K and V (exposed), 2·CP zigzag chunks; " + _L3_KERNEL)
_NR = "Narayanan et al. 2021, Sec. 5.1: GPT-3 175B, 1,024 A100, batch 1,536, 140 TFLOP/s per GPU (recompute counted), 300B tokens"


_TTA = "torchtitan docs/performance.md (2024): FSDP2 on 64 A100 80GB; Llama 3 at seq 8192, Llama 2 at 4096"


def _tt(nodes: int, micro: int = 2, seq: int = 8192, recompute: str = "selective", fused: bool = False) -> Plan:
    """A torchtitan FSDP run: eager PyTorch unless the row used torch.compile (its train configs: compile = false)."""
    return Plan(tp=1, dp_strategy="fsdp", micro_batch=micro, global_batch=micro * 8 * nodes, seq_len=seq, recompute=recompute,
                grad_bytes=2, fused=fused)


_CAL_H100 = "torchtitan 8B, 8 H100: tokens/s/GPU"
_CAL_L3 = "Llama 3 405B, 8,192 H100: TFLOP/s per GPU"
_CAL_A100 = "torchtitan Llama 3 8B, 64 A100: tokens/s/GPU"
_CAL_GPT3 = "GPT-3 175B, 1,024 A100: TFLOP/s per GPU"
_CAL_MEM = "torchtitan 8B, 8 H100: memory (max reserved)"
DP128 = "Llama 3 405B, 16,384 H100, DP 128: TFLOP/s per GPU"


_L3_PLAN = Plan(tp=8, pp=16, vp=8, schedule="interleaved_1f1b", dp_strategy="zero1", micro_batch=1, global_batch=2048, seq_len=8192,
                recompute="selective", grad_bytes=4, attention_kernel="fa3", order="dp-pp-cp-tp")   # the paper's [TP, CP, PP, DP]
CP131K = "Llama 3 405B, 16,384 H100, CP 16 at 131k: TFLOP/s per GPU"
_NR_PLAN = Plan(tp=8, pp=16, dp_strategy="ddp", micro_batch=1, global_batch=1536, seq_len=2048, recompute="full", grad_bytes=4)

ROWS = [
    Row(_CAL_H100, "calibration", "llama-3-8b", "H100 SXM 96GB", 1, _tt(1), "tokens_per_s_per_gpu", 5762, 0.10, _TT),
    Row(_CAL_MEM, "calibration", "llama-3-8b", "H100 SXM 96GB", 1, _tt(1), "reserved_gib", 82.4, 0.05, _TT),
    Row(_CAL_L3, "calibration", "llama-3.1-405b", "H100 SXM 80GB", 1024, _L3_PLAN, "model_tflops_per_gpu", 430, 0.10, _L3),
    Row(DP128, "validation", "llama-3.1-405b", "H100 SXM 80GB", 2048,
        dataclasses.replace(_L3_PLAN, global_batch=2048), "model_tflops_per_gpu", 400, 0.10, _L3_16K),
    Row(CP131K, "validation", "llama-3.1-405b", "H100 SXM 80GB", 2048,
        dataclasses.replace(_L3_PLAN, cp=16, cp_comm="allgather", seq_len=131072, global_batch=128), "model_tflops_per_gpu", 380, 0.10, _L3_16K),
    Row("torchtitan 8B, 128 H100: tokens/s/GPU", "validation", "llama-3-8b", "H100 SXM 96GB", 16, _tt(16), "tokens_per_s_per_gpu", 5605, 0.10, _TT),
    Row("torchtitan 8B, 8 H100, torch.compile: tokens/s/GPU", "validation", "llama-3-8b", "H100 SXM 96GB", 1, _tt(1, fused=True),
        "tokens_per_s_per_gpu", 6667, 0.10, _TT + "; FSDP + torch.compile (Table 1)"),
    Row("torchtitan 8B, 128 H100, torch.compile: tokens/s/GPU", "validation", "llama-3-8b", "H100 SXM 96GB", 16, _tt(16, fused=True),
        "tokens_per_s_per_gpu", 6514, 0.10, _TT + "; FSDP + torch.compile (Table 3)"),
    Row("torchtitan 8B, 128 H100: memory (max reserved)", "validation", "llama-3-8b", "H100 SXM 96GB", 16, _tt(16), "reserved_gib", 67.0, 0.05, _TT),
    Row("Llama 3 405B, 8,192 H100: BF16 MFU", "calibration", "llama-3.1-405b", "H100 SXM 80GB", 1024, _L3_PLAN, "mfu", 0.43, 0.10, _L3),
    Row(_CAL_GPT3, "calibration", "gpt-3-175b", "A100 80GB SXM", 128, _NR_PLAN, "hardware_tflops_per_gpu", 140, 0.10, _NR),
    Row("GPT-3 175B, 1,024 A100: days for 300B tokens", "calibration", "gpt-3-175b", "A100 80GB SXM", 128, _NR_PLAN, "train_days", 34, 0.10, _NR, 300e9),
    Row(_CAL_A100, "calibration", "llama-3-8b", "A100 80GB SXM", 8, _tt(8, 1), "tokens_per_s_per_gpu", 2973, 0.10, _TTA + "; bs 1, selective op AC"),
    Row("torchtitan Llama 3 70B, 64 A100: tokens/s/GPU", "validation", "llama-3-70b", "A100 80GB SXM", 8, _tt(8, 1, 8192, "full"),
        "tokens_per_s_per_gpu", 331, 0.10, _TTA + "; bs 1, full AC"),
    Row("torchtitan Llama 2 13B, 64 A100: tokens/s/GPU", "validation", "llama-2-13b", "A100 80GB SXM", 8, _tt(8, 2, 4096, "none"),
        "tokens_per_s_per_gpu", 2162, 0.10, _TTA + "; bs 2, no AC"),
    Row("torchtitan Llama 2 70B, 64 A100: tokens/s/GPU", "validation", "llama-2-70b", "A100 80GB SXM", 8, _tt(8, 2, 4096, "full"),
        "tokens_per_s_per_gpu", 353, 0.10, _TTA + "; bs 2, full AC"),
]


H100_NVL_BF16 = 835.5e12
H100_NVL_SOURCE = ("H100 NVL datasheet: 1,671 TFLOP/s bf16 with sparsity = 835.5 dense; torchtitan's benchmark docs: the 500 W "
                   "H100 96GB's peak lies between the NVL's and the SXM's (989), its exact value unknown. Modelled apart: the "
                   "card's HBM2e at 2.4 TB/s (eager elementwise passes, the optimizer), attention at FlashAttention-2's "
                   "published H100 speed (torchtitan's SDPA backend; 0.56 -> 0.65 of the 700 W constant when it came in). "
                   "Not modelled, no source found: the clock a dense GEMM sustains under the 500 W cap (the NVL bound is a "
                   "boost-clock peak), and the 700 W constant being Meta's production stack on TP-8 405B GEMMs")
HBM3_SXM = 3.35e12      # H100 SXM 80GB's HBM3 (datasheet), against the 96GB card's HBM2e at 2.4 TB/s


def hopper_500w_account(eff: Efficiency) -> dict:
    """The fitted 500 W constant over the 700 W one, the most the power cap can take by torchtitan's own bound (the
    card's peak at least the NVL's), and the factor neither explains; beside it what the HBM2e's bandwidth, which is
    modelled, costs the 8-GPU calibration row (its predicted throughput at 2.4 over at 3.35 TB/s)."""
    ratio = eff.hopper_500w / eff.hopper
    floor = H100_NVL_BF16 / GPUS["H100 SXM 80GB"].bf16_flops
    row = next(r for r in ROWS if r.name == _CAL_H100)
    hbm3 = dataclasses.replace(GPUS[row.gpu], hbm_bw=HBM3_SXM)
    at = {bw: evaluate(M.load(row.model), Cluster(gpu, row.nodes), row.plan, eff)[row.quantity]
          for bw, gpu in (("hbm2e", GPUS[row.gpu]), ("hbm3", hbm3))}
    return {"fitted 500 W ÷ 700 W": ratio, "power cap at most (NVL ÷ SXM peak)": floor, "unexplained factor": ratio / floor,
            "HBM2e cost (modelled: throughput at 2.4 ÷ at 3.35 TB/s)": at["hbm2e"] / at["hbm3"], "source": H100_NVL_SOURCE}


def dp128_by_virtual_stages(eff: Efficiency, stages=(8, 4, 2)) -> list[dict]:
    """The DP-128 row as the 8,192-GPU calibration row's published 430 × the model's ratio of the two rows, at each
    count of virtual stages: the fitted Hopper constant cancels in the ratio; what is left is the bubble (16 instead
    of 32 micro-batches) and data parallel's exposed time, and v, which the paper does not print."""
    rows = {r.name: r for r in ROWS}
    cal, val = rows[_CAL_L3], rows[DP128]
    out = []
    for v in stages:
        c, d = (dataclasses.replace(r, plan=dataclasses.replace(r.plan, vp=v)) for r in (cal, val))
        got = cal.published * predict_row(d, eff) / predict_row(c, eff)
        out.append({"virtual stages": v, "predicted": got, "published": val.published, "error": got / val.published - 1})
    return out


def cp131k_by_attention_kernel(kernels=("fa2", "cudnn", "fa3")) -> list[dict]:
    """The 131k context-parallel row with every Llama 3 row (the calibration row included, so Hopper's GEMM constant
    refits) on each published H100 attention kernel: what the paper leaves unstated moves this row most."""
    out = []
    for k in kernels:
        rows = [dataclasses.replace(r, plan=dataclasses.replace(r.plan, attention_kernel=k)) if r.model == "llama-3.1-405b" else r
                for r in ROWS]
        eff = _fit(tuple(rows))
        row = next(r for r in rows if r.name == CP131K)
        got = predict_row(row, eff)
        out.append({"attention kernel": k, "hopper matmul (refitted)": eff.hopper, "predicted": got, "published": row.published,
                    "error": got / row.published - 1, "within": abs(got / row.published - 1) <= row.tolerance})
    return out


def predict_row(row: Row, eff: Efficiency) -> float:
    r = evaluate(M.load(row.model), Cluster(GPUS[row.gpu], row.nodes), row.plan, eff, row.tokens)
    return reserved_bytes(r["memory"]) / GiB if row.quantity == "reserved_gib" else r[row.quantity]


def _bisect(f, lo: float, hi: float, steps: int = 40) -> float:
    """The root of a function increasing on [lo, hi] (clamped to the ends)."""
    if f(lo) >= 0:
        return lo
    if f(hi) <= 0:
        return hi
    for _ in range(steps):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if f(mid) < 0 else (lo, mid)
    return (lo + hi) / 2


def fit() -> Efficiency:
    """The constants from the calibration rows of ROWS (_fit)."""
    return _fit(tuple(ROWS))


@functools.lru_cache(maxsize=8)
def _fit(rows: tuple) -> Efficiency:
    """The constants from the calibration rows only, each row made exact in turn (throughput rises with every
    efficiency, so each is a one-dimensional root): for an attention ratio, Ampere's matmul efficiency from the GPT-3
    row (little attention at s = 2,048); the ratio from the A100 torchtitan row (much attention at s = 8,192); then
    Hopper's (700 W) from the Llama 3 405B row at 8,192 GPUs, and the 500 W H100's from torchtitan's 8-GPU row;
    the allocator's fragmentation as the fraction the 8-GPU memory row's reserved bytes exceed the modelled
    allocated peak (reserved = allocated × (1 + f))."""
    cal = {r.name: r for r in rows if r.role == "calibration"}
    gpt3, a100, h100 = cal[_CAL_GPT3], cal[_CAL_A100], cal[_CAL_H100]

    def ampere_for(ratio: float) -> float:
        return _bisect(lambda x: predict_row(gpt3, Efficiency(ampere=x, attention_ratio=ratio)) / gpt3.published - 1, 0.05, 1.0, 30)

    ratio = _bisect(lambda r: predict_row(a100, Efficiency(ampere=ampere_for(r), attention_ratio=r)) / a100.published - 1, 0.05, 3.0, 25)
    ampere = ampere_for(ratio)
    hopper = _bisect(lambda x: predict_row(cal[_CAL_L3], Efficiency(ampere, x, ratio)) / cal[_CAL_L3].published - 1, 0.05, 1.0, 30)
    h500 = _bisect(lambda x: predict_row(h100, Efficiency(ampere, hopper, ratio, hopper_500w=x)) / h100.published - 1, 0.05, 1.0, 30)
    eff = Efficiency(ampere, hopper, ratio, hopper_500w=h500)
    mem = cal[_CAL_MEM]
    return dataclasses.replace(eff, fragmentation=max(0.0, mem.published / predict_row(mem, eff) - 1))


fit.cache_clear = _fit.cache_clear   # the tests refit after breaking a rule


def errors(eff: Efficiency | None = None) -> list[dict]:
    """Every published row beside its prediction, with its relative error and whether it is within tolerance."""
    eff = eff or fit()
    out = []
    for r in ROWS:
        got = predict_row(r, eff)
        err = got / r.published - 1
        out.append({"row": r.name, "role": r.role, "quantity": r.quantity, "published": r.published, "predicted": got,
                    "error": err, "tolerance": r.tolerance, "within": abs(err) <= r.tolerance, "source": r.source})
    return out
