"""One layer's compute time from its shapes: each GEMM on the GPU's SMs, and the memory-bound elementwise ops.

GEMMs   a bf16 GEMM (M×K)·(K×N) runs as output tiles, one per SM at a time, in waves: a GEMM whose tiles leave the
        last wave part-empty, or whose edges pad a tile, runs at the useful share q = M·N / (waves · SMs · tile) of
        a full wave. A tile streams its operands from L2: (tm + tn)·2 bytes per 2·tm·tn FLOPs, so a small tile is
        fed slower than the tensor cores run (the tile's roof: min(peak × efficiency, L2 bandwidth × tm·tn/(tm+tn)),
        the roofline one level up). The library picks, among CUTLASS's SM80 bf16 tiles (256×128 down to 64×64),
        the tile whose q × roof is highest: a large tile where the waves fill, a smaller one where they would not. Its time is its FLOPs over the roofline
        (backend/hardware/roofline): min(peak × efficiency × q, HBM bandwidth × arithmetic intensity), so a small or
        skinny GEMM is memory-bound. The efficiency (the share of peak a full wave sustains) is the fitted constant
        per GPU family; q varies with d_model, the MLP width, TP and the tokens per micro-batch, so a 70B's GEMMs
        run nearer the peak than an 8B's, and Megatron's TP-8 GPT-3 GEMMs farther from it.
        Every forward GEMM (M, N, K) has two in the backward: the input gradient (M, K, N) and the weight
        gradient (K, N, M).
Elementwise  the norms, residual adds, rotary embedding, GQA's K/V repeat and the MLP's activation read and write
        HBM and do next to no arithmetic: bytes per token over HBM bandwidth. Eager PyTorch (torchtitan without
        torch.compile) runs each op as its own kernel, in fp32 where the code upcasts; fused (torch.compile, or
        Megatron's fused kernels) reads each input once and writes each output once. The backward of each op reads
        its output gradient and saved input and writes the input gradient: twice the forward's bytes (the test
        counts torch's own dispatched ops: 2.1×).
"""
from __future__ import annotations

import functools
import math

from backend.hardware.roofline import attainable, gemm_intensity
from backend.plan import models as M

TILES = ((256, 128), (128, 256), (256, 64), (64, 256), (128, 128), (128, 64), (64, 128), (64, 64))  # CUTLASS SM80 bf16 tiles
ELEM = 2            # bf16 operands
BACKWARD_FACTOR = 2.0   # an elementwise op's backward bytes ÷ its forward's


def wave_share(M_: int, N: int, sms: int, tm: int, tn: int) -> float:
    """Useful share of one tiling's waves: M·N over waves × SMs × one tm×tn tile."""
    tiles = math.ceil(M_ / tm) * math.ceil(N / tn)
    return M_ * N / (math.ceil(tiles / sms) * sms * tm * tn)


def tile_rate(M_: int, N: int, sms: int, peak_eff: float, l2_bw: float) -> float:
    """FLOP/s of the best tiling: wave share × the tile's roof (its L2 feed, or the fitted share of peak). L2
    bandwidth unknown (0): the largest tiles only, at the fitted share."""
    best = 0.0
    for tm, tn in TILES:
        if l2_bw:
            roof = attainable(peak_eff, l2_bw, 2 * tm * tn / (ELEM * (tm + tn)))
        else:
            roof = peak_eff if tm * tn == TILES[0][0] * TILES[0][1] else 0.0
        best = max(best, wave_share(M_, N, sms, tm, tn) * roof)
    return best


@functools.lru_cache(maxsize=65536)
def gemm_seconds(M_: int, N: int, K: int, sms: int, peak: float, hbm_bw: float, eff: float, l2_bw: float = 0.0) -> float:
    """Seconds of one (M×K)·(K×N) GEMM: its FLOPs over the roofline, the compute roof the best tiling's rate."""
    if min(M_, N, K) <= 0:
        return 0.0
    roof = attainable(tile_rate(M_, N, sms, peak * eff, l2_bw), hbm_bw, gemm_intensity(M_, N, K, ELEM))
    return 2.0 * M_ * N * K / roof


def layer_gemms(model: M.ModelSpec, tokens: int, t: int, ep: int, moe: bool) -> list[tuple[int, int, int, int]]:
    """(M, N, K, how many) of one layer's forward GEMMs on one GPU: `tokens` rows, weights split over t (columns of
    the first projections, rows of the last), routed experts over ep (each local expert gets tokens·top_k·ep/E rows,
    balanced). Projections run as the architecture writes them: Megatron's fused QKV for GPT, separate q, k, v and
    gate/up for Llama-style models (torchtitan, Hugging Face)."""
    h, a, d = model.hidden, model.heads, model.head_dim
    kv_local = math.ceil(model.kv_heads / t)            # a rank holds whole KV heads (replicated when t > kv)
    out = []
    if model.mla:
        hq = a * model.qk_dim // t
        out += [(tokens, model.q_lora, h, 1), (tokens, hq, model.q_lora, 1)] if model.q_lora else [(tokens, hq, h, 1)]
        out += [(tokens, model.kv_lora + model.qk_rope, h, 1), (tokens, a * (model.qk_nope + model.v_head) // t, model.kv_lora, 1),
                (tokens, h, a * model.v_head // t, 1)]
    elif model.gpt:
        out += [(tokens, (a + 2 * model.kv_heads) * d // t, h, 1), (tokens, h, a * d // t, 1)]
    else:
        out += [(tokens, a * d // t, h, 1), (tokens, kv_local * d, h, 2), (tokens, h, a * d // t, 1)]
    if moe:
        rows = max(1, round(tokens * model.top_k * ep / model.experts))
        f = model.moe_ffn // t
        out += [(tokens, model.experts, h, 1), (rows, f, h, 2 * model.experts // ep), (rows, h, f, model.experts // ep)]
        if model.shared_experts:
            fs = model.shared_experts * model.moe_ffn // t
            out += [(tokens, fs, h, 2), (tokens, h, fs, 1)]
    elif model.gpt:
        out += [(tokens, model.ffn // t, h, 1), (tokens, h, model.ffn // t, 1)]
    else:
        out += [(tokens, model.ffn // t, h, 2), (tokens, h, model.ffn // t, 1)]
    return out


def linear_seconds(model: M.ModelSpec, tokens: int, t: int, ep: int, gpu, peak: float, eff: float) -> tuple[float, float]:
    """(forward, backward) seconds of one layer's GEMMs, dense and MoE layers averaged by their share of the layers."""
    def one(moe: bool) -> tuple[float, float]:
        f = b = 0.0
        for m_, n, k, count in layer_gemms(model, tokens, t, ep, moe):
            f += count * gemm_seconds(m_, n, k, gpu.sms, peak, gpu.hbm_bw, eff, gpu.l2_bw)
            b += count * (gemm_seconds(m_, k, n, gpu.sms, peak, gpu.hbm_bw, eff, gpu.l2_bw)
                          + gemm_seconds(k, n, m_, gpu.sms, peak, gpu.hbm_bw, eff, gpu.l2_bw))
        return f, b
    share = model.moe_layers / model.layers
    dense, moe = one(False), (one(True) if share else (0.0, 0.0))
    return tuple((1 - share) * x + share * y for x, y in zip(dense, moe))


def head_seconds(model: M.ModelSpec, tokens: int, t: int, gpu, peak: float, eff: float) -> float:
    """Forward seconds of the output head's GEMM (vocabulary split over t)."""
    return gemm_seconds(tokens, model.vocab // t, model.hidden, gpu.sms, peak, gpu.hbm_bw, eff, gpu.l2_bw)


def elementwise_bytes(model: M.ModelSpec, t: int, sp: bool, fused: bool) -> float:
    """HBM bytes per token of one layer's forward elementwise ops on one GPU (h-wide ops split over t under sequence
    parallel). Per element, eager (the ops as torchtitan's Llama writes them; Megatron's GPT without its fusions):
      RMSNorm      x.float() 6, pow 8, mean 4, x·rsqrt 8, type_as 6, ·weight 4: 36 bytes, twice a layer
      residual add reads two bf16, writes one: 6, twice
      RoPE         .float() 6, complex multiply 8, type_as 6: 20 per q and k element
      K/V repeat   GQA's expand+reshape copies K and V to every query head: reads kv, writes q-width, 2 bytes each
      SwiGLU       silu reads and writes 4, the product reads 4 and writes 2: 10 per MLP element
      GPT          LayerNorm 4, bias add 4, dropout 5 (its 1-byte mask), residual add 6, twice; bias and GeLU 8 per MLP element
    fused (torch.compile; Megatron's fused LayerNorm, bias-dropout-add and bias-GeLU): one read of each input and one
    write of each output: add+norm 8 twice, RoPE 4, SwiGLU 6 per MLP element; GPT LayerNorm 4 and bias-dropout-add 7
    twice, bias-GeLU 4; the K/V repeat stays a copy."""
    hs = model.hidden / t if sp and t > 1 else model.hidden
    if model.experts:
        share = model.moe_layers / model.layers
        f = ((1 - share) * model.ffn + share * (model.top_k + model.shared_experts) * model.moe_ffn) / t
    else:
        f = model.ffn / t
    if model.gpt:
        return (2 * (4 + 7) * hs + 4 * f) if fused else (2 * (4 + 4 + 5 + 6) * hs + 8 * f)
    q = model.heads * model.qk_dim / t
    k = (model.heads if model.mla else math.ceil(model.kv_heads / t) * t) * model.qk_dim / t
    repeat = 0.0 if model.mla or model.kv_heads >= model.heads else 2 * (2 * k + 2 * q)
    if fused:
        return 2 * 8 * hs + 4 * (q + k) + repeat + 6 * f
    return 2 * 36 * hs + 2 * 6 * hs + 20 * (q + k) + repeat + 10 * f


# Attention kernels on Hopper, bf16, head dim 128, at 16k tokens (FlashAttention-3 paper, Shah et al. 2024, Fig. 5
# forward and Fig. 6 backward, H100 80GB SXM5): TFLOP/s as the papers count them, the backward at 2.5× the forward's
# FLOPs (five matmuls to its two: it recomputes the scores). Long causal sequences run near these (masked blocks skipped).
H100_SXM_PEAK = 989.0
ATTENTION_KERNELS = {"fa2": (370.0, 322.0), "cudnn": (595.0, 516.0), "fa3": (648.0, 561.0)}
ATTENTION_KERNELS_SOURCE = ("Shah et al. 2024, FlashAttention-3, Fig. 5 (forward) and Fig. 6 (backward): H100 80GB SXM5, bf16, "
                            "head dim 128, seq 16k, TFLOP/s (forward, backward): FlashAttention-2 370, 322; cuDNN 595, 516; "
                            "FlashAttention-3 648, 561")
FA_BACKWARD_FLOPS = 2.5   # FlashAttention's backward FLOPs ÷ its forward's (FlashAttention-2 paper's count)


def attention_kernel_seconds(forward_flops: float, kernel: str, peak: float) -> tuple[float, float]:
    """(forward, backward) seconds of attention whose forward does `forward_flops` on a Hopper-class GPU of bf16 `peak`
    FLOP/s, at the published kernel's share of the H100 SXM's peak: the forward at its forward rate, the backward's 2.5×
    FLOPs at its backward rate."""
    fwd, bwd = ATTENTION_KERNELS[kernel]
    scale = peak / (H100_SXM_PEAK * 1e12)
    return forward_flops / (fwd * 1e12 * scale), FA_BACKWARD_FLOPS * forward_flops / (bwd * 1e12 * scale)
