"""numerics.formats: the bits of typed values in FP32, TF32, BF16, FP16 and FP8 (e4m3, e5m2); each format's range
against torch.finfo; seed 002's swamping example (2^-3 + 2^-14 stays 2^-3 in FP16); summing many small values
in FP16 and FP32, plainly and with Kahan's compensation.

torch does the rounding, decoding and arithmetic; the checks redo each from the formulas with exact rationals
(backend/numerics/formats.py) and math.fsum (the exact sum).
"""
from __future__ import annotations

import dataclasses
import itertools
import math

import torch

from backend.config import Config, setting
from backend.limits import cost
from backend.experiments import define
from backend.numerics.formats import (FORMATS, add_in, describe, range_formula, round_exact, running_sums,
                                      stall_prediction, torch_range)
from backend.result import Check, Result, Schema

MAX_VALUES = 8
SUM_FORMATS = ("fp16", "fp32")


@dataclasses.dataclass
class FormatsConfig(Config):
    values: tuple[float, ...] = setting([0.1, -3.14159, 1e-5, 300.0, 70000.0], length=(1, MAX_VALUES),
                                        help="numbers to store in every format (inf allowed)")
    small_value: float = setting(0.01, min=1e-4, max=1.0, help="the value summed (its mean, for uniform)")
    n_terms: int = setting(10000, min=10, max=30000, help="how many values are summed")
    sum_values: str = setting("constant", choices=("constant", "uniform"), help="all equal, or uniform in [0, 2·small_value]")
    seed: int = setting(0, min=0, max=2**31 - 1, help="the uniform values")

    cost_drivers = ("n_terms",)

    def estimate(self):
        """Each term is rounded with rationals twice and added one scalar torch op at a time in four running sums
        (~60 us of CPU a term: 1.2 s at 10,000 terms, 2.3 s at 30,000 measured); the chart keeps every term's float."""
        return cost(data_bytes=self.n_terms * 1000, ops=self.n_terms * 3 + 1000)


def summands(config: FormatsConfig) -> list[float]:
    if config.sum_values == "constant":
        return [config.small_value] * config.n_terms
    g = torch.Generator().manual_seed(config.seed)
    return (torch.rand(config.n_terms, generator=g, dtype=torch.float64) * 2 * config.small_value).tolist()


def run(config: FormatsConfig, ctx) -> Result:
    """The typed values' bits, each format's range, seed 002's swamping and the summations, each checked."""
    torch.set_num_threads(1)
    bits = [describe(x, f) for x in config.values for f in FORMATS.values()]
    ranges = format_ranges()
    swamp = swamping()
    ctx.progress(0.2, "summing")
    sums, finals = summations(config, ctx)
    stall = stall_prediction(round_exact(config.small_value, FORMATS["fp16"]), FORMATS["fp16"])
    reaches = config.sum_values == "constant" and finals["fp16 plain"]["exact"] >= 2 * stall
    return Result(
        metrics={"swamping_fp16_result": swamp[2]["result"], "fp16_plain_sum": finals["fp16 plain"]["computed"],
                 "fp16_kahan_sum": finals["fp16 Kahan"]["computed"], "exact_sum_fp16_values": finals["fp16 plain"]["exact"],
                 "fp16_stall_prediction": stall if reaches else None,
                 **{f"relative_error.{k}": v["relative_error"] for k, v in finals.items()}},
        tables={"bits": bits, "ranges": ranges, "swamping": swamp, "sum_errors": list(finals.values()), "sums": sums},
        checks=format_checks(bits, ranges, swamp) + sum_checks(config, finals, stall if reaches else None),
        notes=["TF32 has no torch dtype (it is a tensor-core input mode): its values here are fp32 bits rounded to "
               "10 mantissa bits, to nearest with ties to even.",
               "torch casts values beyond ±448 to float8 e4m3fn as ±448 (saturation; the format has no inf)."])


def format_ranges() -> list[dict]:
    """Each float format's range from its E and M bits beside torch.finfo's, then INT8 (seed 002's inference format:
    two's complement, -2^7 .. 2^7 - 1 in steps of 1) beside torch.iinfo."""
    ranges = []
    for f in FORMATS.values():
        formula, measured = range_formula(f), torch_range(f)
        ranges.append({"format": f.name, "bits": f.bits, "exponent_bits": f.exponent_bits, "mantissa_bits": f.mantissa_bits,
                       "bias": f.bias, **formula, **{f"finfo_{k}": v for k, v in measured.items()},
                       "decimal_digits": f.mantissa_bits * math.log10(2)})
    ranges.append({"format": "int8", "bits": 8, "max": 2.0 ** 7 - 1, "min": -2.0 ** 7, "eps": 1.0,
                   "iinfo_max": float(torch.iinfo(torch.int8).max), "iinfo_min": float(torch.iinfo(torch.int8).min)})
    return ranges


SWAMP_WEIGHT, SWAMP_GRADIENT = 2.0 ** -3, 2.0 ** -14


def swamping() -> list[dict]:
    """Seed 002: weight 2^-3 plus gradient 2^-14. FP16's gap at 2^-3 is 2^-13, so 2^-14 is exactly half a gap: a
    tie, and ties go to the even neighbour, 2^-3 itself. Rows: fp32, bf16, fp16."""
    w, g = SWAMP_WEIGHT, SWAMP_GRADIENT
    swamp = [{"format": name, "weight": w, "gradient": g, "result": add_in(w, g, FORMATS[name]), "exact": w + g,
              "rounded_exact": round_exact(w + g, FORMATS[name]), "gap_at_weight": describe(w, FORMATS[name])["gap_to_next"]}
             for name in ("fp32", "bf16", "fp16")]
    for row in swamp:
        row["gradient_lost"] = row["result"] == w
    return swamp


def summations(config: FormatsConfig, ctx) -> tuple[list[dict], dict[str, dict]]:
    """The summands added in FP16 and FP32, plainly and with Kahan's compensation: every `every`-th running sum of
    each (and of float64, whose rounding is far below what the chart can show) and each method's final error against
    math.fsum of the values as that format stores them (the exact sum)."""
    values = summands(config)
    sums, finals = [], {}
    every = max(1, config.n_terms // 200)
    for i, name in enumerate(SUM_FORMATS):
        f = FORMATS[name]
        stored = [round_exact(v, f) for v in values]
        exact = math.fsum(stored)
        for kahan in (False, True):
            method = f"{name} {'Kahan' if kahan else 'plain'}"
            curve = running_sums(values, f.dtype, kahan)
            finals[method] = {"method": method, "computed": curve[-1], "exact": exact, "abs_error": abs(curve[-1] - exact),
                              "relative_error": abs(curve[-1] - exact) / exact, "sum_abs": math.fsum(abs(v) for v in stored),
                              "unit_roundoff": 2.0 ** -(f.mantissa_bits + 1)}
            sums += [{"method": method, "terms": k + 1, "running_sum": curve[k]} for k in range(every - 1, len(curve), every)]
        ctx.progress(0.2 + 0.4 * (i + 1), f"summed in {name}")
    exact = list(itertools.accumulate(values))
    sums += [{"method": "exact (float64)", "terms": k + 1, "running_sum": exact[k]} for k in range(every - 1, len(exact), every)]
    return sums, finals


def _same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def format_checks(bits: list[dict], ranges: list[dict], swamp: list[dict]) -> list[Check]:
    """torch's rounding, decoding and ranges against the formulas in exact rationals; seed 002's swamping."""
    floats, int8 = ranges[:-1], ranges[-1]
    range_error = max(abs(r[k] - r[f"finfo_{k}"]) / r[k] for r in floats
                      for k in ("max", "smallest_normal", "smallest_subnormal", "eps") if f"finfo_{k}" in r)
    int8_error = abs(int8["max"] - int8["iinfo_max"]) + abs(int8["min"] - int8["iinfo_min"])
    w, g = SWAMP_WEIGHT, SWAMP_GRADIENT
    return [
        Check("torch's rounding equals round-to-nearest-even (exact rationals)",
              sum(not _same(r["stored_value"], r["reference_value"]) for r in bits), 0,
              reference="fractions.Fraction rounding, ties to even; e4m3fn saturates at 448 like torch",
              detail=f"mismatches among {len(bits)} values × formats"),
        Check("stored bits decode to the stored value by (-1)^s·2^(e-bias)·(1+m/2^M)",
              sum(not _same(r["stored_value"], r["value_from_bits"]) for r in bits if r["kind"] != "inf/nan"), 0,
              reference="the formula on the sign, exponent and mantissa fields", detail="mismatches"),
        Check("gap to the next value (torch decodes stored integer + 1) equals 2^(e-bias-M)",
              sum(not _same(r["gap_to_next"], r["gap_formula"]) for r in bits), 0,
              reference="one unit in the last place from the exponent field", detail="mismatches"),
        Check("max, smallest normal, smallest subnormal, eps from E and M equal torch.finfo", range_error, 0.0,
              reference="torch.finfo (smallest subnormal: torch decoding the stored integer 1)", detail="largest relative difference"),
        Check("INT8 range -2^7 .. 2^7 - 1 equals torch.iinfo", int8_error, 0.0, reference="torch.iinfo(torch.int8)"),
        Check("seed 002: 2^-3 + 2^-14 in FP16 stays 2^-3", abs(swamp[2]["result"] - w), 0.0,
              reference="the exact sum rounded to FP16 (a tie, to even) is 2^-3", detail=f"FP16 gives {swamp[2]['result']!r}"),
        Check("the same sum in FP32 keeps the gradient", abs(swamp[0]["result"] - (w + g)), 0.0,
              reference="2^-3 + 2^-14 = 0.12506103515625 exactly"),
    ]


def sum_checks(config: FormatsConfig, finals: dict[str, dict], stall: float | None) -> list[Check]:
    """The FP32 sums within Higham's worst-case bounds; an FP16 constant sum's stall where it is predicted to
    (`stall`, None when the sum does not reach twice it)."""
    fp32_plain, fp32_kahan = finals["fp32 plain"], finals["fp32 Kahan"]
    n, u = config.n_terms, fp32_plain["unit_roundoff"]
    higham = (n - 1) * u / (1 - (n - 1) * u) * fp32_plain["sum_abs"]
    kahan_bound = (2 * u + n * u * u) * fp32_kahan["sum_abs"]
    checks = [
        Check("FP32 plain sum within the worst-case bound γ_(n-1)·Σ|x|", fp32_plain["abs_error"] / higham, 1.0,
              reference="math.fsum (exact); Higham, Accuracy and Stability, eq. 4.4", detail="error / bound"),
        Check("FP32 Kahan sum within (2u + nu²)·Σ|x|", fp32_kahan["abs_error"] / kahan_bound, 1.0,
              reference="math.fsum (exact); Kahan's bound (Higham eq. 4.8, its O(nu²) term taken as nu²; for FP32 it is ~1e-7 of the total)",
              detail="error / bound"),
    ]
    if stall is not None:
        checks.append(Check("FP16 plain sum of a constant stops at the predicted power of two",
                            abs(finals["fp16 plain"]["computed"] - stall), 0.0,
                            reference="first 2^k whose half-gap 2^(k-11) ≥ the value", detail=f"predicted {stall:g}"))
    return checks


RESULT = Schema(
    metrics=(
        "swamping_fp16_result", "fp16_plain_sum", "fp16_kahan_sum", "exact_sum_fp16_values", "fp16_stall_prediction",
        "relative_error.fp16 plain", "relative_error.fp16 Kahan", "relative_error.fp32 plain",
        "relative_error.fp32 Kahan",
    ),
    tables={
        "bits": ("exponent_bits", "exponent_field", "format", "gap_formula", "gap_to_next", "input", "kind",
                 "mantissa_bits", "reference_value", "relative_error", "sign_bit", "stored_value",
                 "unbiased_exponent", "value_from_bits"),
        "ranges": ("bias", "bits", "decimal_digits", "eps", "exponent_bits", "finfo_eps", "finfo_max",
                   "finfo_smallest_normal", "finfo_smallest_subnormal", "format", "iinfo_max", "iinfo_min",
                   "mantissa_bits", "max", "min", "smallest_normal", "smallest_subnormal"),
        "swamping": ("exact", "format", "gap_at_weight", "gradient", "gradient_lost", "result", "rounded_exact",
                     "weight"),
        "sum_errors": ("abs_error", "computed", "exact", "method", "relative_error", "sum_abs", "unit_roundoff"),
        "sums": ("method", "running_sum", "terms"),
    },
)

EXPERIMENT = define(__name__, FormatsConfig,
                    "bits, ranges and rounding of FP32/TF32/BF16/FP16/FP8; FP16 swamping; plain vs Kahan summation",
                    run_fn=run, schema=RESULT)
