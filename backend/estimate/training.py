"""Back-of-envelope training estimates (seeds 002 and 004) and the small measurements that check their formulas.

Seed 002's training-time equation: time = data × compute per datum ÷ (one device's rate × devices × parallel
efficiency). With C = 6·N·D FLOPs for N parameters and D tokens (2 per parameter per token forward, 4 backward):
    time = 6·N·D / (peak FLOP/s · MFU · devices · parallel efficiency).
For a decoder the matmul FLOPs are exactly 6·N_linear·D + 12·L·T·d_attn·D (attention scores and weighted sum,
T the sequence length, full T×T as non-flash attention computes it); torch's FlopCounterMode counts these.
Memory of mixed-precision Adam (seed 000): (2 + 2 + 12)·ψ bytes for ψ parameters: fp16 weights and gradients,
fp32 master, m and v; ZeRO-1/2/3 divide the optimizer states / and gradients / and weights by the ranks.
"""
from __future__ import annotations

import copy

import torch
from torch.utils.flop_counter import FlopCounterMode

from backend.hardware.devices import DEVICES, dram

SECONDS_PER_DAY = 86400.0
# Peak dense fp16/bf16 tensor FLOP/s and memory per device: the presets of backend/hardware/devices.py, and the
# V100 that seed 004's table was measured on (datasheet: 125 TFLOP/s fp16 tensor, 32 GB).
ACCELERATORS = {"V100 (32 GB)": (125e12, 32e9),
                **{name: (spec["peak_flops"]["fp16/bf16 tensor"], dram(name)[1]) for name, spec in DEVICES.items()}}
BYTES = {"weights": 2, "gradients": 2, "optimizer states": 12}  # fp16 weights and grads; fp32 master, m, v


def training_flops(params: float, tokens: float) -> float:
    return 6.0 * params * tokens


def training_seconds(flops: float, peak: float, mfu: float, devices: int, parallel_efficiency: float) -> float:
    """Seed 002's equation: work ÷ (per-device rate × devices × parallel efficiency)."""
    return flops / (peak * mfu * devices * parallel_efficiency)


def decoder_flops(model: torch.nn.Module, batch: int, seq_len: int) -> dict[str, float]:
    """Matmul FLOPs of one training step of the tiny LLaMA, by formula."""
    s = model.shape
    linear = sum(p.numel() for name, p in model.named_parameters() if p.dim() == 2 and not name.startswith("embed"))
    tokens = batch * seq_len
    attention = 12 * s.n_layers * seq_len * s.n_heads * s.d_head * tokens
    return {"tokens": tokens, "linear_params": linear, "all_params": sum(p.numel() for p in model.parameters()),
            "six_n_linear": 6.0 * linear * tokens, "attention": float(attention), "exact": 6.0 * linear * tokens + attention}


def counted_flops(model: torch.nn.Module, batch: torch.Tensor) -> float:
    """FLOPs torch's FlopCounterMode counts in one forward and backward of model.loss on batch."""
    counter = FlopCounterMode(display=False)
    with counter:
        model.loss(batch).backward()
    model.zero_grad()
    return float(counter.get_total_flops())


def memory_per_rank(params: float, ranks: int, stage: int) -> dict[str, float]:
    """Bytes one data-parallel rank holds for weights, gradients and optimizer states: (2 + 2 + 12)ψ, with ZeRO
    stage 1 sharding the optimizer states, 2 also the gradients, 3 also the weights (stage 0: plain DDP)."""
    sharded = {0: (), 1: ("optimizer states",), 2: ("optimizer states", "gradients"), 3: tuple(BYTES)}[stage]
    return {k: b * params / (ranks if k in sharded else 1) for k, b in BYTES.items()}


def measured_mixed_adam_bytes(model: torch.nn.Module, batch: torch.Tensor) -> dict[str, int]:
    """Bytes of the tensors a mixed-precision Adam step really holds: an fp16 copy with its gradients, and the
    fp32 master weights with AdamW's two states, read off the tensors after one step."""
    master = copy.deepcopy(model)
    half = copy.deepcopy(model).half()
    half.loss(batch).backward()
    for p, h in zip(master.parameters(), half.parameters()):
        p.grad = h.grad.float()
    opt = torch.optim.AdamW(master.parameters())
    opt.step()
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    states = [v for st in opt.state.values() for k, v in st.items() if k in ("exp_avg", "exp_avg_sq")]
    return {"weights": nbytes(half.parameters()), "gradients": nbytes(h.grad for h in half.parameters()),
            "optimizer states": nbytes(master.parameters()) + nbytes(states)}


def seed_175b(card_bytes: float) -> list[dict]:
    """Seed 002's 175B arithmetic beside the formulas."""
    n = 175e9
    training = 8 * 4 * n  # "7~8 times" the fp32 weights
    mixed = sum(BYTES.values()) * n
    return [
        {"quantity": "fp16 weights", "seed": "320 GB", "formula": "2 bytes × 175e9", "bytes": 2 * n},
        {"quantity": "fp32 weights (in memory)", "seed": "700 GB", "formula": "4 bytes × 175e9", "bytes": 4 * n},
        {"quantity": "training, 8× the fp32 weights", "seed": "~5600 GB", "formula": "8 × 4 × 175e9", "bytes": training},
        {"quantity": f"cards of {card_bytes / 1e9:g} GB for that", "seed": "87", "formula": "5600 GB ÷ card", "bytes": None,
         "cards": training / card_bytes},
        {"quantity": "mixed-precision Adam states only", "seed": "(seed 000: (2+2+12)ψ)", "formula": "16 bytes × 175e9", "bytes": mixed,
         "cards": mixed / card_bytes},
    ]


# Seed 004, table 3-1: training time on one NVIDIA V100. Tokens: dataset bytes ÷ bytes per token for one pass,
# except GPT-3, whose 300B training tokens seed 002 gives.
SEED_004_TABLE = [("GPT", 110e6, 4e9, None, 3 * SECONDS_PER_DAY), ("BERT", 340e6, 16e9, None, 50 * SECONDS_PER_DAY),
                  ("GPT-2", 1.5e9, 40e9, None, 200 * SECONDS_PER_DAY), ("GPT-3", 175e9, 560e9, 300e9, 90 * 365.25 * SECONDS_PER_DAY)]


def seed_004_rows(bytes_per_token: float, mfu: float) -> list[dict]:
    peak = ACCELERATORS["V100 (32 GB)"][0]
    rows = []
    for name, params, data_bytes, tokens, seconds in SEED_004_TABLE:
        tokens = tokens or data_bytes / bytes_per_token
        flops = training_flops(params, tokens)
        rows.append({"model": name, "parameters": params, "dataset_bytes": data_bytes, "tokens": tokens, "flops_6nd": flops,
                     "seed_days": seconds / SECONDS_PER_DAY, "implied_tflops": flops / seconds / 1e12,
                     "implied_mfu": flops / seconds / peak,
                     "predicted_days": training_seconds(flops, peak, mfu, 1, 1.0) / SECONDS_PER_DAY})
    return rows


