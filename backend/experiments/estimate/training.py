"""estimate.training: the seeds' back-of-envelope training estimates as a calculator (seed 002's training-time
equation and 175B memory; seed 004's table of training times on a V100), with the formulas checked against
small runs measured here: FLOPs of the tiny LLaMA counted by torch's FlopCounterMode against 6·N·D plus the
attention term; the bytes a mixed-precision Adam step holds against (2 + 2 + 12)ψ; optionally, the memory per
rank of a real ZeRO-1 run (parallel.zero on the tiny LLaMA, 2 gloo ranks, bf16 mixed) against the per-rank formula,
with the gradient bytes that run holds (fp32 sums, where the seed counts 16-bit gradients).
"""
from __future__ import annotations

import dataclasses
import time

import torch

from backend import experiments
from backend.config import Config, setting
from backend.limits import DYNAMO_IMPORT_S, PROCESS_BYTES, Estimate, cost
from backend.estimate.training import (ACCELERATORS, BYTES, SECONDS_PER_DAY, counted_flops, decoder_flops,
                                       measured_mixed_adam_bytes, memory_per_rank, seed_004_rows, seed_175b,
                                       training_flops, training_seconds)
from backend.experiments import define
from backend.models.llama import ModelShape, TinyDecoder
from backend.result import Check, Result, Schema

SHAPE = ModelShape(vocab=64, d_model=64, n_layers=2, n_heads=4, n_kv_heads=4, d_head=16, d_ff=128)
ZERO_RUN = dict(stage=1, precision="bf16_mixed", world_size=2, steps=1, hidden=32, layers=2, batch=2)  # the tiny LLaMA
# The mesh's bf16_mixed keeps the gradients it sums as fp32 (FSDP's MixedPrecision(reduce_dtype=fp32), Megatron's fp32
# main grads), where the seed's (2 + 2 + 12)ψ counts 16-bit gradients: the run is compared with 4 bytes a gradient.
HELD_GRADIENT_BYTES = torch.finfo(torch.float32).bits // 8


@dataclasses.dataclass
class TrainingEstimateConfig(Config):
    params_b: float = setting(175.0, min=0.001, max=10000.0, help="model parameters N, billions")
    tokens_b: float = setting(300.0, min=0.001, max=100000.0, help="training tokens D, billions")
    device: str = setting("A100 (80 GB SXM)", choices=tuple(ACCELERATORS), help="accelerator (peak dense fp16/bf16)")
    devices: int = setting(1024, min=1, max=1_000_000, help="accelerators")
    mfu: float = setting(0.4, min=0.01, max=1.0, help="model FLOPs utilisation of one device")
    parallel_efficiency: float = setting(0.9, min=0.01, max=1.0, help="seed 002's multi-device efficiency")
    dp_ranks: int = setting(64, min=1, max=1_000_000, help="data-parallel ranks for the memory per rank")
    card_gb: float = setting(64.0, min=1.0, max=1024.0, help="memory per card, GB (seed 002: a 64 GB NPU)")
    bytes_per_token: float = setting(4.0, min=1.0, max=16.0, help="dataset bytes per token, for seed 004's table")
    measure_batch: int = setting(4, min=1, max=32, help="sequences in the measured tiny-LLaMA step")
    measure_seq_len: int = setting(32, min=4, max=256, help="tokens per measured sequence")
    zero_run: bool = setting(False, help="also run parallel.zero (ZeRO-1 on the tiny LLaMA, bf16 mixed, 2 ranks) and check its "
                             "memory per rank (~20 s)")
    seed: int = setting(0, min=0, max=2**31 - 1, help="tiny model weights and tokens")

    cost_drivers = ("measure_seq_len", "measure_batch", "zero_run")

    def estimate(self):
        """Twelve forward-backward steps of the tiny LLaMA (counted, fp16 mixed Adam, warm-up, 3 timed, 3 timed at twice
        the batch), their attention scores' elementwise work dominating at long sequences, after first calls that take
        seconds (FlopCounterMode imports torch._dynamo, fp16 kernels load); then parallel.zero's own estimate when it runs
        (its leader is this process)."""
        tokens, T, L = self.measure_batch * self.measure_seq_len, self.measure_seq_len, SHAPE.n_layers
        weights = L * (4 * SHAPE.d_model ** 2 + 3 * SHAPE.d_model * SHAPE.d_ff) + SHAPE.vocab * SHAPE.d_model
        elements = tokens * SHAPE.vocab + L * self.measure_batch * SHAPE.n_heads * T * T
        # the counted work runs ~6x faster than FLOPS and BYTES_PER_S: 9.2 s of CPU at 32 x 256 tokens measured
        own = cost(data_bytes=2 * elements * 40, flops=12 * 2 * tokens * (6 * weights + 12 * L * T * SHAPE.d_model) / 6,
                   moved_bytes=12 * 2 * elements * 25 / 6, ops=12 * 300 + 10_000, seconds=DYNAMO_IMPORT_S)
        if not self.zero_run:
            return own
        zero = experiments.get("parallel.zero").config_cls(**ZERO_RUN).estimate()
        return Estimate(own.memory_bytes + zero.memory_bytes - PROCESS_BYTES, own.seconds + zero.seconds)


def timed_step(model, batch) -> float:
    start = time.perf_counter()
    model.loss(batch).backward()
    model.zero_grad()
    return time.perf_counter() - start


def measure(c: TrainingEstimateConfig) -> tuple[dict, list[Check], list[dict]]:
    torch.manual_seed(c.seed)
    model = TinyDecoder(SHAPE)
    batch = torch.randint(0, SHAPE.vocab, (c.measure_batch, c.measure_seq_len + 1))
    formula = decoder_flops(model, c.measure_batch, c.measure_seq_len)
    counted = counted_flops(model, batch)
    held = measured_mixed_adam_bytes(model, batch)
    psi = formula["all_params"]
    checks = [
        Check("FLOPs of a training step equal 6·N_linear·D + 12·L·T·d·D", abs(counted - formula["exact"]) / counted, 0.0,
              reference="torch.utils.flop_counter.FlopCounterMode", detail=f"counted {counted:,.0f}, formula {formula['exact']:,.0f}"),
        Check("bytes held by a mixed-precision Adam step equal (2 + 2 + 12)ψ",
              max(abs(held[k] - b * psi) for k, b in BYTES.items()), 0,
              reference="nbytes of the fp16 weights and gradients, fp32 master and AdamW's exp_avg, exp_avg_sq"),
    ]
    # Time: the step's FLOP rate at this batch predicts the step at twice the batch (same code, more tokens).
    double = torch.cat([batch, batch])
    timed_step(model, batch)  # warm-up
    t1 = min(timed_step(model, batch) for _ in range(3))
    t2 = min(timed_step(model, double) for _ in range(3))
    rate = counted / t1
    memory_rows = [{"category": k, "measured_bytes": held[k], "formula_bytes": b * psi} for k, b in BYTES.items()]
    return ({**formula, "counted": counted, "six_n_all": 6.0 * psi * formula["tokens"], "cpu_flops_per_s": rate,
             "step_s": t1, "double_step_s": t2, "double_step_predicted_s": 2 * counted / rate}, checks, memory_rows)


def zero_memory(c: TrainingEstimateConfig) -> tuple[list[dict], Check]:
    """A real ZeRO-1 bf16 run's memory per rank against the per-rank formula for its ψ, counted on the model itself
    (its parameters' numel); the formula's gradients at the bytes the run holds (fp32), the seed's 2ψ beside them."""
    from backend.experiments.parallel import dp_model
    from backend.parallel.tp_model import reference_model

    config = experiments.get("parallel.zero").config_cls(**ZERO_RUN)
    psi = sum(p.numel() for p in reference_model(dp_model.mesh_plan(config, "zero1")).parameters())
    result = experiments.run("parallel.zero", **ZERO_RUN)
    seed = memory_per_rank(psi, config.world_size, 1)
    want = {**seed, "gradients": seed["gradients"] * HELD_GRADIENT_BYTES / BYTES["gradients"]}
    names = {"parameters": "weights", "gradients": "gradients", "optimizer states": "optimizer states",
             "master weights": "optimizer states"}  # the fp32 master is the seed's 4 of the 12 optimizer bytes
    held: dict[tuple[int, str], int] = {}
    for r in result.tables["memory"]:
        if r["category"] in names:
            key = (r["rank"], names[r["category"]])
            held[key] = held.get(key, 0) + r["measured_bytes"]
    rows = [{"rank": rank, "category": cat, "measured_bytes": got, "formula_bytes": want[cat], "seed_formula_bytes": seed[cat]}
            for (rank, cat), got in sorted(held.items())]
    return rows, Check(f"ZeRO-1 run: memory per rank equals 2ψ + {HELD_GRADIENT_BYTES}ψ + 12ψ/n (the run's gradients fp32)",
                       max(abs(r["measured_bytes"] - r["formula_bytes"]) for r in rows), 0,
                       reference="parallel.zero (the tiny LLaMA, 2 gloo ranks, bf16 mixed precision), tensors' bytes per rank",
                       detail=f"ψ = {psi:,} parameters counted on the model; the seed's (2 + 2 + 12)ψ counts 16-bit gradients, "
                              f"the run sums and keeps them in fp32 ({HELD_GRADIENT_BYTES} bytes), so its gradients are "
                              f"{HELD_GRADIENT_BYTES * psi:,} B where the seed says {2 * psi:,} B")


# Published figures the run's formulas must reproduce: seed 002's 175B example ("参数放内存占用700GB", "~5600GB",
# "NPU 64G显存需要87张卡"), and GPT-3's training compute, 3.14e23 FLOPs (Brown et al. 2020, "Language Models are
# Few-Shot Learners", table D.1), for the 175B x 300B tokens of seed 004's last row.
SEED_002_175B = {"fp32_bytes": 700e9, "training_bytes": 5600e9, "card_bytes": 64e9, "cards": 87}
GPT3_PAPER_FLOPS = 3.14e23


def seed_checks(c: TrainingEstimateConfig) -> list[Check]:
    """Seed 002's 175B memory example and seed 004's table, as the run computes them, against the printed figures."""
    rows = {r["quantity"]: r for r in seed_175b(SEED_002_175B["card_bytes"])}
    fp32, training = rows["fp32 weights (in memory)"]["bytes"], rows["training, 8× the fp32 weights"]["bytes"]
    cards = next(r["cards"] for r in rows.values() if r["quantity"].startswith("cards of"))
    table = {r["model"]: r for r in seed_004_rows(c.bytes_per_token, c.mfu)}
    gpt3 = table["GPT-3"]
    fastest = max(table.values(), key=lambda r: r["implied_mfu"])
    return [
        Check("seed 002: 175B parameters in fp32 take 700 GB", abs(fp32 - SEED_002_175B["fp32_bytes"]) / 1e9, 0,
              reference="seed 002's printed 700 GB", detail=f"{fp32 / 1e9:,.0f} GB"),
        Check("seed 002: training at 8x that is ~5,600 GB, 87 cards of 64 GB", abs(training - SEED_002_175B["training_bytes"]) / 1e9
              + abs(int(cards) - SEED_002_175B["cards"]), 0, reference="seed 002's printed ~5600 GB and 87 cards",
              detail=f"{training / 1e9:,.0f} GB ÷ 64 GB = {cards:.1f} cards (the seed counts whole cards: 87)"),
        Check("seed 004's GPT-3 row: 6·N·D for 175B parameters and 300B tokens", abs(gpt3["flops_6nd"] - GPT3_PAPER_FLOPS) / GPT3_PAPER_FLOPS,
              0.01, reference="GPT-3 paper (Brown et al. 2020), table D.1: 3.14e23 FLOPs",
              detail=f"{gpt3['flops_6nd']:.3g} FLOPs (relative error)"),
        Check("seed 004's table: no training time is shorter than 6·N·D at the V100's peak", max(0.0, fastest["implied_mfu"] - 1), 0,
              reference="seed 004's table 3-1 (3 days, 50 days, 200 days, 90 years on one V100)",
              detail="implied utilisation " + ", ".join(f"{r['model']} {100 * r['implied_mfu']:.1f}%" for r in table.values())),
    ]


def run(config: TrainingEstimateConfig, ctx) -> Result:
    torch.set_num_threads(1)
    c = config
    ctx.progress(0.1, "measuring the tiny LLaMA")
    measured, checks, memory_rows = measure(c)
    checks += seed_checks(c)
    zero_rows = []
    if c.zero_run:
        ctx.progress(0.4, "ZeRO-1 run on 2 ranks")
        zero_rows, check = zero_memory(c)
        checks.append(check)

    n, d = c.params_b * 1e9, c.tokens_b * 1e9
    flops = training_flops(n, d)
    peak, card_bytes = ACCELERATORS[c.device]
    seconds = training_seconds(flops, peak, c.mfu, c.devices, c.parallel_efficiency)
    scaling = [{"device": name, "devices": k, "days": training_seconds(flops, p, c.mfu, k, c.parallel_efficiency) / SECONDS_PER_DAY}
               for name, (p, _) in ACCELERATORS.items() for k in (2 ** e for e in range(0, 17, 2))]
    per_rank = [{"stage": f"ZeRO-{s}" if s else "DDP", "category": k, "bytes": v}
                for s in range(4) for k, v in memory_per_rank(n, c.dp_ranks, s).items()]
    return Result(
        metrics={"training_flops": flops, "training_days": seconds / SECONDS_PER_DAY,
                 "memory_per_rank_gb.DDP": sum(memory_per_rank(n, c.dp_ranks, 0).values()) / 1e9,
                 "memory_per_rank_gb.ZeRO-3": sum(memory_per_rank(n, c.dp_ranks, 3).values()) / 1e9,
                 "tiny_counted_flops": measured["counted"], "tiny_six_n_error": measured["six_n_all"] / measured["counted"] - 1,
                 "cpu_tflops": measured["cpu_flops_per_s"] / 1e12},
        tables={"measured": [measured], "memory_measured": memory_rows, "zero_memory": zero_rows,
                "seed_002_175b": seed_175b(c.card_gb * 1e9), "seed_004": seed_004_rows(c.bytes_per_token, c.mfu),
                "scaling": scaling, "memory_per_rank": per_rank},
        checks=checks,
        notes=[f"Device peaks are datasheet dense fp16/bf16 tensor figures; {c.device}: {peak / 1e12:g} TFLOP/s.",
               "6·N·D counts 2 FLOPs per parameter per token forward and 4 backward; it leaves out attention's T×T work "
               "(12·L·T·d per token) and counts embedding parameters that do no matmul.",
               "Seed 004's table lists each model's dataset size; its tokens here are one pass at bytes_per_token, except "
               "GPT-3's 300B training tokens (seed 002)."])


RESULT = Schema(
    metrics=(
        "training_flops", "training_days", "memory_per_rank_gb.DDP", "memory_per_rank_gb.ZeRO-3",
        "tiny_counted_flops", "tiny_six_n_error", "cpu_tflops",
    ),
    tables={
        "measured": ("all_params", "attention", "counted", "cpu_flops_per_s", "double_step_predicted_s",
                     "double_step_s", "exact", "linear_params", "six_n_all", "six_n_linear", "step_s", "tokens"),
        "memory_measured": ("category", "formula_bytes", "measured_bytes"),
        "zero_memory": ("category", "formula_bytes", "measured_bytes", "rank", "seed_formula_bytes"),  # empty unless zero_run
        "seed_002_175b": ("bytes", "cards", "formula", "quantity", "seed"),
        "seed_004": ("dataset_bytes", "flops_6nd", "implied_mfu", "implied_tflops", "model", "parameters",
                     "predicted_days", "seed_days", "tokens"),
        "scaling": ("days", "device", "devices"),
        "memory_per_rank": ("bytes", "category", "stage"),
    },
)

EXPERIMENT = define(__name__, TrainingEstimateConfig,
                    "training time and memory estimates (seeds 002, 004), formulas checked by FlopCounterMode and real tensors",
                    run_fn=run, schema=RESULT)
