"""hardware.decode: decoding is memory-bound, measured here and placed on GPU presets' rooflines.

Measured on this CPU: a batched decode step of a tiny LLaMA made wide enough that its weights (about 100 MB at the
defaults) dwarf the last-level cache, timed at each batch size, beside the prediction: the roofline's
max(bytes ÷ measured copy bandwidth, FLOPs ÷ measured matmul rate) plus the step's fixed cost (the same step at width
64, measured), with its error. Model: the bytes and FLOPs of one
decode step of Llama 2 7B / 70B and Llama 3 8B (published configs) at each batch size, and of a prefill, placed on a
GPU preset's roofline (fp16 weights and cache, datasheet peak and bandwidth). Checks: the FLOP count against torch's
FlopCounterMode on the real step; the byte count against the parameter and cache tensors' own sizes; the parameter
formula against the published totals; the batched step's logits against the model's own cached forward.
"""
from __future__ import annotations

import dataclasses
import os
import time

import torch

from backend.config import Config, setting
from backend.limits import DYNAMO_IMPORT_S, cost
from backend.experiments import define
from backend.hardware.decode import (MODELS, BatchedDecoder, decode_bytes, decode_flops, prefill_cache_check, prefill_cost,
                                   roofline_time, tiny_shape)
from backend.hardware.devices import DEVICES, dram
from backend.hardware.roofline import last_level_cache_bytes, probe_bandwidth, probe_matmul, roof_lines
from backend.models.llama import ModelShape, TinyDecoder
from backend.result import Check, Result, Schema

GPU_BATCHES = (1, 8, 64, 256)
# The intensities (FLOP/byte) each roof's line is tabled at: 10^-0.5 to 10^4, 80 points evenly spaced on a log axis.
LINE_INTENSITIES = tuple(10 ** (-0.5 + 4.5 * i / 79) for i in range(80))
FP16 = 2


@dataclasses.dataclass
class DecodeConfig(Config):
    d_model: int = setting(768, choices=(256, 512, 768, 1024), help="width of the tiny LLaMA timed here (heads of 64)")
    n_layers: int = setting(4, min=1, max=8, help="its layers")
    context: int = setting(64, min=1, max=512, help="tokens already in each sequence's KV cache")
    batch_sizes: tuple[int, ...] = setting([1, 8, 64, 256], item_range=(1, 256), length=(1, 6),
                                            help="batch sizes to time here")
    gpu: str = setting("H100 (SXM)", choices=tuple(DEVICES), help="GPU preset for the real models' roofline")
    gpu_context: int = setting(2048, min=1, max=32768, help="tokens in each cache for the real models")
    prompt: int = setting(512, min=1, max=32768, help="prompt length of the prefill placed beside the decode steps")

    cost_drivers = ("d_model", "n_layers", "context")

    def batches(self) -> list[int]:
        return list(self.batch_sizes)

    def shape(self):
        d = self.d_model
        return tiny_shape(d, self.n_layers, vocab=256, n_heads=d // 64, n_kv_heads=max(1, d // 256), d_ff=8 * d // 3 // 64 * 64)

    def estimate(self):
        """Weights in fp32, each batch's cache, 1 + 3 timed steps per batch size: the weights' batched products
        run at ~5x FLOPS a CPU second, attention over the cache (small batched products) at ~FLOPS / 4 (4.8 s of CPU at
        the defaults, 8.9 s at d_model 256, 8 layers, context 512) (4.8 s of CPU at the defaults measured); the probes (a 256 MiB
        copy, ~0.5 s); FlopCounterMode imports torch._dynamo."""
        s, batches = self.shape(), self.batches()
        kv = sum(decode_bytes(s, b, self.context + 1, 4)["kv_read"] for b in batches)
        counted = [decode_flops(s, b, self.context) for b in batches]
        flops = sum(4 * (f["matmul"] / 5 + f["attention"] * 4) for f in counted)
        return cost(data_bytes=2 * s.params() * 4 + 2 * max(decode_bytes(s, b, self.context + 1, 4)["kv_read"] for b in batches) + (512 << 20),
                    flops=flops, moved_bytes=4 * len(batches) * s.params() * 4 + kv, seconds=0.5 + DYNAMO_IMPORT_S)


def _time_step(dec: BatchedDecoder, tokens: torch.Tensor, context: int, repeats: int = 4) -> tuple[float, float]:
    """(CPU seconds, wall seconds) of one decode step from the same cache length, best of `repeats` (a first step,
    untimed, warms up). The step runs on one thread, so its thread CPU time leaves out the time other processes on a
    shared machine take the core, and still counts the time it stalls on memory."""
    cpu = wall = float("inf")
    for i in range(repeats + 1):
        dec.length = context
        start, start_cpu = time.perf_counter(), time.thread_time()
        dec.step(tokens)
        if i:
            cpu, wall = min(cpu, time.thread_time() - start_cpu), min(wall, time.perf_counter() - start)
    return cpu, wall


def verify_cost(model, context: int, ks=(1, 2, 4, 8), repeats: int = 4) -> list[dict]:
    """The target's call in speculative sampling: one sequence with `context` cached tokens scoring k new tokens in one
    forward of the model's own cached path; thread CPU seconds, best of `repeats`, against scoring one."""
    caches = model.new_caches(context + max(ks))
    g = torch.Generator().manual_seed(2)
    for c in caches:
        for t in c.tensors.values():
            t.normal_(generator=g)
    rows = []
    with torch.no_grad():
        for k in ks:
            tokens = torch.randint(0, model.shape.vocab, (k,), generator=g)
            best = float("inf")
            for i in range(repeats + 1):
                start = time.thread_time()
                model(tokens, context, caches)
                if i:
                    best = min(best, time.thread_time() - start)
            rows.append({"tokens_scored": k, "measured_s": best, "cost_vs_one": best / rows[0]["measured_s"] if rows else 1.0})
    return rows


def count_flops(dec: BatchedDecoder, tokens: torch.Tensor) -> int:
    """FLOPs torch's FlopCounterMode counts in one decode step."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        dec.step(tokens)
    return counter.get_total_flops()


def tensor_bytes(model, dec: BatchedDecoder, batch: int, positions: int) -> int:
    """The independent byte count: every parameter tensor's bytes, except the embedding table, of which only the
    `batch` gathered rows are read, plus the cache tensors' bytes up to `positions`."""
    params = sum(p.numel() * p.element_size() for p in model.parameters()) - model.embed.weight.nbytes
    rows = batch * model.embed.weight[0].nbytes
    return params + rows + dec.cache_bytes(positions)


def build(s) -> TinyDecoder:
    torch.manual_seed(0)
    return TinyDecoder(ModelShape(vocab=s.vocab, d_model=s.d_model, n_layers=s.n_layers, n_heads=s.n_heads,
                                  n_kv_heads=s.n_kv_heads, d_head=s.d_head, d_ff=s.d_ff, variant="gqa")).eval()


def timed_decoder(model, batch: int, context: int, g: torch.Generator) -> tuple[BatchedDecoder, torch.Tensor, float, float]:
    """A BatchedDecoder of `batch` sequences with `context` cached tokens (random: the cost of a step does not depend
    on what the cache holds), one token each, and its step's (CPU, wall) seconds."""
    dec = BatchedDecoder(model, batch, context + 1)
    dec.k.normal_(generator=g)
    dec.v.normal_(generator=g)
    tokens = torch.randint(0, model.shape.vocab, (batch,), generator=g)
    return (dec, tokens, *_time_step(dec, tokens, context))


def measure(config: DecodeConfig, ctx) -> tuple[dict, list[dict], list[Check], list[str], list[dict]]:
    """Time the tiny LLaMA's decode step at each batch size; count its FLOPs and bytes independently. The fixed cost of
    a step (PyTorch's dispatch of its ~30 operators per layer, which no roofline term holds) is measured as the same
    step of the same depth at width 64, whose bytes and FLOPs are negligible, and added to the prediction."""
    s = config.shape()
    model = build(s)
    skeleton = build(tiny_shape(64, s.n_layers, vocab=s.vocab, n_heads=1, n_kv_heads=1, d_ff=64))
    ctx.progress(0.05, "probing memory bandwidth and matmul")
    bw, peak = probe_bandwidth(clock=time.thread_time), probe_matmul(clock=time.thread_time)  # CPU time, as the steps
    checks = [prefill_cache_check(model, context=min(config.context, 12))]
    rows, g = [], torch.Generator().manual_seed(1)
    for i, b in enumerate(config.batches()):
        ctx.progress(0.1 + 0.8 * i / len(config.batches()), f"batch {b}")
        overhead = timed_decoder(skeleton, b, config.context, g)[2]
        dec, tokens, seconds, wall = timed_decoder(model, b, config.context, g)
        nbytes, flops = decode_bytes(s, b, config.context, 4), decode_flops(s, b, config.context)
        pred = roofline_time(flops["total"], nbytes["total"], peak, bw)
        predicted = overhead + pred["seconds"]
        rows.append({"batch": b, "measured_s": seconds, "wall_s": wall, "predicted_s": predicted, "roofline_s": pred["seconds"],
                     "overhead_s": overhead, "memory_s": pred["memory_s"],
                     "compute_s": pred["compute_s"], "bound": pred["bound"], "error_pct": 100 * (seconds / predicted - 1),
                     "bytes": nbytes["total"], "weight_bytes": nbytes["weights"], "kv_bytes": nbytes["kv_read"] + nbytes["kv_write"],
                     "flops": flops["total"], "intensity": flops["total"] / nbytes["total"],
                     "tokens_per_s": b / seconds, "achieved_flops_per_s": flops["total"] / seconds,
                     "achieved_bytes_per_s": nbytes["total"] / seconds})
        if i == 0:
            dec.length = config.context
            counted = count_flops(dec, tokens)
            checks.append(Check(f"decode step FLOPs (batch {b}) = FlopCounterMode's count", abs(counted - flops["total"]) / counted, 0.0,
                                reference="torch.utils.flop_counter.FlopCounterMode on the real step",
                                detail=f"counted {counted:,}, formula {flops['total']:,.0f} (element-wise ops counted by neither)"))
            real = tensor_bytes(model, dec, b, config.context + 1)
            checks.append(Check(f"decode step bytes (batch {b}) = parameter and cache tensors' sizes",
                                abs(real - nbytes["total"]) / real, 0.0,
                                reference="Σ parameter tensors' nbytes (B embedding rows) + the cache tensors' nbytes to c + 1",
                                detail=f"tensors {real:,} B, formula {nbytes['total']:,.0f} B"))
    llc = last_level_cache_bytes()
    streamed = [r for r in rows if r["weight_bytes"] > llc]
    checks.append(Check("no step whose weights outgrow the last-level cache beats the roofline's time (÷1.5 for probe noise)",
                        max([0.0] + [r["roofline_s"] / r["measured_s"] - 1.5 for r in streamed]), 0.0,
                        reference="max(bytes ÷ copy bandwidth, FLOPs ÷ matmul rate) from the probes",
                        detail=f"{len(streamed)} of {len(rows)} steps; weights {rows[0]['weight_bytes'] / 2**20:.0f} MiB, "
                               f"last-level cache {llc / 2**20:.0f} MiB"))
    notes = [] if streamed else [
        f"The weights ({rows[0]['weight_bytes'] / 2**20:.0f} MiB) fit in this CPU's last-level cache ({llc / 2**20:.0f} MiB), so "
        "a step reads them from the cache, faster than the DRAM bandwidth the prediction assumes; widen the model to see DRAM."]
    load = os.getloadavg()[0]
    if load > (os.cpu_count() or 1):
        notes.append(f"Timed on a machine with a load average of {load:.1f} on {os.cpu_count()} cores: other processes share its "
                     "caches and memory bandwidth, which slows the steps beyond what the probes' best moments predict.")
    metrics = {"load_average": round(load, 1), "cpu_bandwidth_GBps": round(bw / 1e9, 2), "cpu_matmul_GFLOPs": round(peak / 1e9, 2),
               "ridge_point_flops_per_byte": round(peak / bw, 2), "weight_MB": round(rows[0]["weight_bytes"] / 1e6, 1),
               "params": s.params(), **{f"error_pct.batch_{r['batch']}": round(r["error_pct"], 1) for r in rows}}
    ctx.progress(0.9, "one sequence scoring k tokens at once")
    return metrics, rows, checks, notes, verify_cost(model, config.context)


def gpu_placement(config: DecodeConfig) -> list[dict]:
    """The tiny LLaMA's and each published model's decode step at GPU_BATCHES and one prefill on the chosen preset's fp16
    roofline."""
    mem_name, capacity, bw = dram(config.gpu)
    peak = DEVICES[config.gpu]["peak_flops"]["fp16/bf16 tensor"]
    rows = []
    for s in (config.shape(), *MODELS.values()):
        for b in GPU_BATCHES:
            nbytes, flops = decode_bytes(s, b, config.gpu_context, FP16), decode_flops(s, b, config.gpu_context)
            t = roofline_time(flops["total"], nbytes["total"], peak, bw)
            resident = s.params() * FP16 + b * (config.gpu_context + 1) * s.kv_elements_per_token() * FP16
            rows.append({"model": s.name, "phase": "decode", "batch": b, "flops": flops["total"], "bytes": nbytes["total"],
                         "weight_bytes": nbytes["weights"], "kv_bytes": nbytes["kv_read"] + nbytes["kv_write"],
                         "kv_share": (nbytes["kv_read"] + nbytes["kv_write"]) / nbytes["total"],
                         "intensity": flops["total"] / nbytes["total"],
                         "attainable_flops_per_s": flops["total"] / t["seconds"], "step_ms": 1e3 * t["seconds"],
                         "tokens_per_s": b / t["seconds"], "bound": t["bound"], "resident_GB": resident / 1e9,
                         "fits": resident <= capacity})
        pre = prefill_cost(s, 1, config.prompt, FP16)
        t = roofline_time(pre["flops"], pre["bytes"], peak, bw)
        rows.append({"model": s.name, "phase": f"prefill {config.prompt} tokens", "batch": 1, "flops": pre["flops"],
                     "bytes": pre["bytes"], "weight_bytes": s.matmul_params() * FP16, "kv_bytes": None, "kv_share": None,
                     "intensity": pre["flops"] / pre["bytes"], "attainable_flops_per_s": pre["flops"] / t["seconds"],
                     "step_ms": 1e3 * t["seconds"], "tokens_per_s": config.prompt / t["seconds"], "bound": t["bound"],
                     "resident_GB": s.params() * FP16 / 1e9, "fits": s.params() * FP16 <= capacity})
    return rows


def run(config: DecodeConfig, ctx) -> Result:
    torch.set_num_threads(1)
    metrics, rows, checks, notes, verify = measure(config, ctx)
    for s in MODELS.values():
        checks.append(Check(f"{s.name}: parameters from the config = the published total", abs(s.params() - s.published_params) / s.published_params,
                            0.0, reference=f"{s.source}; total from the release's safetensors metadata",
                            detail=f"{s.params():,} vs {s.published_params:,}"))
    placement = gpu_placement(config)
    peak = DEVICES[config.gpu]["peak_flops"]["fp16/bf16 tensor"]
    _, _, bw = dram(config.gpu)
    at_1 = {r["model"]: r for r in placement if r["phase"] == "decode" and r["batch"] == 1}
    metrics.update({"gpu_ridge_flops_per_byte": round(peak / bw, 1),
                    **{f"gpu_tokens_per_s_batch1.{name}": round(r["tokens_per_s"], 1) for name, r in at_1.items()}})
    metrics["verify_8_tokens_vs_1"] = round(verify[-1]["cost_vs_one"], 2)
    roofs = [{"device": config.gpu, "peak_flops": peak, "bandwidth": bw},
             {"device": "this CPU (measured)", "peak_flops": metrics["cpu_matmul_GFLOPs"] * 1e9,
              "bandwidth": metrics["cpu_bandwidth_GBps"] * 1e9}]
    return Result(metrics=metrics,
                  tables={"cpu_steps": rows, "gpu_placement": placement, "verify_cost": verify,
                          "roof": roofs, "roof_lines": roof_lines(roofs, LINE_INTENSITIES)},
                  checks=checks, notes=notes)


def _v1_kv_share(rows: list[dict]) -> None:
    """Version 1 -> 2: the KV cache's share of a decode step's bytes (the page divided them before)."""
    for r in rows:
        r["kv_share"] = r["kv_bytes"] / r["bytes"] if r["kv_bytes"] is not None else None


def _v2_to_v3(result: dict) -> None:
    """Version 2 -> 3: the roofs' lines (the page computed min(peak, bandwidth × intensity) before)."""
    result["tables"]["roof_lines"] = roof_lines(result["tables"]["roof"], LINE_INTENSITIES)


RESULT = Schema(
    metrics=(
        "load_average", "cpu_bandwidth_GBps", "cpu_matmul_GFLOPs", "ridge_point_flops_per_byte", "weight_MB",
        "params", "gpu_ridge_flops_per_byte", "verify_8_tokens_vs_1",
        "error_pct.*",                  # one per batch size timed
        "gpu_tokens_per_s_batch1.*",    # one per model placed on the GPU preset
    ),
    tables={
        "cpu_steps": ("achieved_bytes_per_s", "achieved_flops_per_s", "batch", "bound", "bytes", "compute_s",
                      "error_pct", "flops", "intensity", "kv_bytes", "measured_s", "memory_s", "overhead_s",
                      "predicted_s", "roofline_s", "tokens_per_s", "wall_s", "weight_bytes"),
        "gpu_placement": ("attainable_flops_per_s", "batch", "bound", "bytes", "fits", "flops", "intensity",
                          "kv_bytes", "kv_share", "model", "phase", "resident_GB", "step_ms", "tokens_per_s", "weight_bytes"),
        "verify_cost": ("cost_vs_one", "measured_s", "tokens_scored"),
        "roof": ("bandwidth", "device", "peak_flops"),
        "roof_lines": ("attainable_flops_per_s", "bandwidth", "device", "intensity", "peak_flops"),
    },
    version=3, upgrades={1: lambda result: _v1_kv_share(result["tables"]["gpu_placement"]), 2: _v2_to_v3},
)

EXPERIMENT = define(__name__, DecodeConfig,
                    "decoding is memory-bound: a decode step timed here by batch size against weight bytes ÷ bandwidth; "
                    "Llama 2/3 decode and prefill on GPU rooflines",
                    run_fn=run, schema=RESULT)
