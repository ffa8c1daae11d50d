"""Floating-point formats as stored bits: sign, exponent, mantissa; range; rounding; swamping; summation.

A binary float with E exponent bits and M mantissa bits stores (-1)^s · 2^(e - bias) · (1 + m / 2^M), bias
2^(E-1) - 1; exponent field 0 means subnormal, (-1)^s · 2^(1 - bias) · m / 2^M. IEEE formats spend the
all-ones exponent on inf/NaN; float8 e4m3fn ("finite, no inf") keeps it for numbers and has one NaN
(all ones), so its largest value is 2^8 · 1.75 = 448.

Two independent paths meet here: torch rounds and decodes (casts, bit views, the next value by
incrementing the stored integer), and `round_exact` / `value_from_fields` / `gap_formula` do the same
from the formulas with exact rational arithmetic (fractions.Fraction), never calling torch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

import torch


@dataclass(frozen=True)
class Format:
    name: str
    exponent_bits: int
    mantissa_bits: int
    dtype: torch.dtype | None  # None: no torch dtype (TF32 lives inside fp32 registers)
    ieee_special: bool = True  # all-ones exponent is inf/NaN (False for e4m3fn)

    @property
    def bias(self) -> int:
        return 2 ** (self.exponent_bits - 1) - 1

    @property
    def bits(self) -> int:
        return 1 + self.exponent_bits + self.mantissa_bits


FORMATS = {f.name: f for f in (
    Format("fp32", 8, 23, torch.float32),
    Format("tf32", 8, 10, None),
    Format("bf16", 8, 7, torch.bfloat16),
    Format("fp16", 5, 10, torch.float16),
    Format("fp8_e4m3", 4, 3, torch.float8_e4m3fn, ieee_special=False),
    Format("fp8_e5m2", 5, 2, torch.float8_e5m2),
)}

# torch stores each dtype in a same-width integer; view() reads the bits without converting.
_INT_VIEW = {32: torch.int32, 16: torch.int16, 8: torch.uint8}


def _container_bits(f: Format) -> int:
    return 32 if f.dtype is None else f.dtype.itemsize * 8


# --- the formulas (exact arithmetic, no torch) ------------------------------------------------------
def largest(f: Format) -> Fraction:
    top_exponent = 2 ** f.exponent_bits - (2 if f.ieee_special else 1)
    top_mantissa = 2 ** f.mantissa_bits - (1 if f.ieee_special else 2)  # e4m3fn: mantissa 111 at the top is NaN
    return Fraction(2) ** (top_exponent - f.bias) * (1 + Fraction(top_mantissa, 2 ** f.mantissa_bits))


def range_formula(f: Format) -> dict:
    """max, smallest normal, smallest subnormal and epsilon (gap above 1) from E, M and the bias."""
    return {"max": float(largest(f)), "smallest_normal": 2.0 ** (1 - f.bias),
            "smallest_subnormal": 2.0 ** (1 - f.bias - f.mantissa_bits), "eps": 2.0 ** -f.mantissa_bits}


def round_exact(x: float, f: Format) -> float:
    """x rounded to the nearest value of format f, ties to even, computed with rationals.
    Overflow: IEEE formats go to ±inf; e4m3fn saturates to ±448 as torch's cast does (it has no inf)."""
    if math.isnan(x):
        return x
    if math.isinf(x):
        return x if f.ieee_special else math.copysign(float(largest(f)), x)
    if x == 0:
        return x
    a = Fraction(abs(x))
    exponent = max(math.frexp(abs(x))[1] - 1, 1 - f.bias)  # subnormals share the smallest normal's quantum
    quantum = Fraction(2) ** (exponent - f.mantissa_bits)
    rounded = round(a / quantum) * quantum  # Fraction rounding is half-to-even
    if rounded > largest(f):
        return math.copysign(math.inf if f.ieee_special else float(largest(f)), x)
    return math.copysign(float(rounded), x)


def value_from_fields(sign: int, exponent: int, mantissa: int, f: Format) -> float:
    """The value a (sign, exponent field, mantissa field) triple stores."""
    top = 2 ** f.exponent_bits - 1
    if f.ieee_special and exponent == top:
        return math.nan if mantissa else math.copysign(math.inf, -sign)
    if not f.ieee_special and exponent == top and mantissa == 2 ** f.mantissa_bits - 1:
        return math.nan
    frac = Fraction(mantissa, 2 ** f.mantissa_bits)
    magnitude = Fraction(2) ** (1 - f.bias) * frac if exponent == 0 else Fraction(2) ** (exponent - f.bias) * (1 + frac)
    return float(-magnitude if sign else magnitude)


def gap_formula(exponent: int, f: Format) -> float:
    """Distance from a value with this exponent field to the next larger magnitude: one unit in the last place."""
    return 2.0 ** (max(exponent, 1) - f.bias - f.mantissa_bits)


# --- torch's side -----------------------------------------------------------------------------------
def to_format(x: torch.Tensor, f: Format) -> torch.Tensor:
    """Round float64 values to f with torch; TF32 by rounding fp32 bits to 10 mantissa bits (nearest, ties to even)."""
    if f.dtype is not None:
        return x.to(f.dtype)
    bits = x.to(torch.float32).view(torch.int32)
    drop = 23 - f.mantissa_bits
    keep_lsb = (bits >> drop) & 1
    rounded = ((bits + (1 << (drop - 1)) - 1 + keep_lsb) >> drop) << drop
    finite = torch.isfinite(x.to(torch.float32))
    return torch.where(finite, rounded, bits).view(torch.float32)


def stored_fields(stored: torch.Tensor, f: Format) -> tuple[int, int, int]:
    """(sign, exponent field, mantissa field) of one stored value, read from its bits."""
    container = _container_bits(f)
    raw = int(stored.view(_INT_VIEW[container]).item()) & ((1 << container) - 1)
    if f.dtype is None:
        raw >>= 23 - f.mantissa_bits  # TF32: the top 19 bits of the fp32 word
    mantissa = raw & ((1 << f.mantissa_bits) - 1)
    exponent = (raw >> f.mantissa_bits) & ((1 << f.exponent_bits) - 1)
    return raw >> (f.bits - 1), exponent, mantissa


def next_up(stored: torch.Tensor, f: Format) -> float:
    """The next representable magnitude, by adding one to the stored integer and letting torch decode it."""
    container = _container_bits(f)
    step = 1 << (23 - f.mantissa_bits) if f.dtype is None else 1
    ints = stored.view(_INT_VIEW[container])
    return float((ints + step).view(stored.dtype).to(torch.float64))


def describe(x: float, f: Format) -> dict:
    """One typed value in format f: its stored bits, the value it rounds to, the gap to the next value."""
    stored = to_format(torch.tensor([x], dtype=torch.float64), f)
    sign, exponent, mantissa = stored_fields(stored, f)
    value = float(stored.to(torch.float64))
    finite = math.isfinite(value)
    has_next = finite and abs(value) < largest(f)  # above the largest value lies inf or NaN, no number
    neighbour = next_up(stored, f) if has_next else math.nan
    return {
        "format": f.name, "input": x, "sign_bit": str(sign),
        "exponent_bits": format(exponent, f"0{f.exponent_bits}b"), "mantissa_bits": format(mantissa, f"0{f.mantissa_bits}b"),
        "exponent_field": exponent, "unbiased_exponent": max(exponent, 1) - f.bias,
        "kind": "zero" if value == 0 else "subnormal" if exponent == 0 else "normal" if finite else "inf/nan",
        "stored_value": value, "reference_value": round_exact(x, f),
        "value_from_bits": value_from_fields(sign, exponent, mantissa, f),
        "relative_error": abs(value - x) / abs(x) if math.isfinite(x) and x != 0 else 0.0,
        "gap_to_next": abs(neighbour) - abs(value) if has_next else math.nan,
        "gap_formula": gap_formula(exponent, f) if has_next else math.nan,
    }


def torch_range(f: Format) -> dict:
    """What torch.finfo says about f; finfo has no smallest subnormal, so that one is torch decoding the stored
    integer 1. TF32 has no dtype: empty."""
    if f.dtype is None:
        return {}
    fi = torch.finfo(f.dtype)
    one = torch.ones(1, dtype=_INT_VIEW[_container_bits(f)]).view(f.dtype)
    return {"max": fi.max, "smallest_normal": fi.smallest_normal, "smallest_subnormal": float(one.to(torch.float64)),
            "eps": fi.eps}


# --- arithmetic in a format -------------------------------------------------------------------------
def add_in(a: float, b: float, f: Format) -> float:
    """a + b with both operands and the result stored in f (torch arithmetic)."""
    x, y = (torch.tensor([v], dtype=torch.float64).to(f.dtype) for v in (a, b))
    return float((x + y).to(torch.float64))


def running_sums(values: list[float], dtype: torch.dtype, kahan: bool) -> list[float]:
    """Left-to-right sum with the accumulator stored in dtype; Kahan carries the lost low part in a compensation term."""
    total = torch.zeros((), dtype=dtype)
    compensation = torch.zeros((), dtype=dtype)
    xs = torch.tensor(values, dtype=torch.float64).to(dtype)
    out = []
    for x in xs:
        if kahan:
            y = x - compensation
            t = total + y
            compensation = (t - total) - y  # what the rounding of total + y threw away
            total = t
        else:
            total = total + x
        out.append(float(total))
    return out


def stall_prediction(value: float, f: Format) -> float:
    """Adding a constant v > 0 to a growing fp accumulator stops changing it at the first power of two 2^k whose
    half-gap 2^(k - M - 1) is at least v (ties to even keep 2^k): in [2^(k-1), 2^k) the gap is under 2v, so
    each add still moves the sum up a step, and a sum just below 2^k plus v rounds to 2^k exactly."""
    k = math.ceil(math.log2(value)) + f.mantissa_bits + 1
    return 2.0 ** k
