"""The one request-trace model, as arrays (so a million requests is cheap): arrival time, prompt length,
output length, and an optional shared prefix (one of a few system or few-shot prompts). Arrivals are in
seconds for the serving experiments, in scheduler steps for the allocator simulation (kvcache.serve).

Token ids are a deterministic function of (request, position), or of (prefix, position) inside a
shared prefix, so requests with the same prefix really share their first tokens and prefix caching
finds them, with no token list stored per request.
- `sharegpt_like`: ShareGPT-like shape (log-normal prompt and output lengths, sigma 0.8 and 0.9;
  Poisson arrivals), medians scaled to the tiny model.
- `shared_prefix`: few-shot prompts: every request opens with one of `n_prefixes` long prefixes and
  adds a short question, the workload where prefix caching matters.
- `sharegpt_system_prompts`: the same ShareGPT-like shape at full length (medians ~150), a share of the
  requests opening with one of four system prompts; arrivals in whole scheduler steps.
- `read_csv`: a trace from CSV text (what backend/uploads.py checks and stores).
"""
from __future__ import annotations

import csv
import dataclasses
import io
import random
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Trace:
    arrival: np.ndarray      # seconds, non-decreasing
    prompt_len: np.ndarray
    output_len: np.ndarray
    prefix_id: np.ndarray    # -1: no shared prefix
    prefix_len: np.ndarray
    vocab: int

    def __len__(self) -> int:
        return len(self.arrival)

    @property
    def total(self) -> np.ndarray:
        """Each request's prompt plus output tokens."""
        return self.prompt_len + self.output_len

    def with_arrival_unit(self, seconds: float) -> "Trace":
        """The same trace with its arrivals multiplied by `seconds` (a CSV's milliseconds, for instance)."""
        return dataclasses.replace(self, arrival=self.arrival * seconds)

    def token(self, rid: int, i: int) -> int:
        key = (-1 - int(self.prefix_id[rid])) if i < self.prefix_len[rid] else rid
        return ((key * 1_000_003 + i) * 2_654_435_761 >> 11) % self.vocab

    def prompt(self, rid: int) -> list[int]:
        return [self.token(rid, i) for i in range(int(self.prompt_len[rid]))]

    def head(self, n: int) -> "Trace":
        return Trace(self.arrival[:n], self.prompt_len[:n], self.output_len[:n], self.prefix_id[:n], self.prefix_len[:n], self.vocab)


def read_csv(text: str, vocab: int = 256) -> Trace:
    """Columns arrival, prompt_len, output_len (integers; arrival >= 0, lengths >= 1), optional prefix_id, prefix_len
    (0 <= prefix_len <= prompt_len), in the file's units; sorted by arrival (ties keep the file's order)."""
    rows = list(csv.DictReader(io.StringIO(text)))
    if not rows:
        raise ValueError("trace: the CSV has no rows (columns: arrival, prompt_len, output_len[, prefix_id, prefix_len])")
    out = []
    for i, row in enumerate(rows, start=2):
        try:
            arrival, prompt, output = (int(row[k]) for k in ("arrival", "prompt_len", "output_len"))
            prefix_id, prefix_len = int(row.get("prefix_id") or -1), int(row.get("prefix_len") or 0)
        except (KeyError, ValueError, TypeError):
            raise ValueError(f"trace: line {i} needs integer arrival, prompt_len, output_len") from None
        if arrival < 0 or prompt < 1 or output < 1 or not 0 <= prefix_len <= prompt:
            raise ValueError(f"trace: line {i} has a negative time or a length below 1 (allowed: arrival >= 0, lengths >= 1, "
                             f"0 <= prefix_len <= prompt_len)")
        out.append((arrival, prompt, output, prefix_id, prefix_len))
    columns = np.array(out, np.int64)
    columns = columns[np.argsort(columns[:, 0], kind="stable")]
    return Trace(columns[:, 0].astype(np.float64), *columns[:, 1:].T, vocab)


def _check_size(n: int, rate: float) -> None:
    if n < 1 or rate <= 0:
        raise ValueError(f"a trace needs n >= 1 requests and rate > 0 (got n={n}, rate={rate})")


def _lognormal(rng, median: float, sigma: float, n: int, lo: int, hi: int) -> np.ndarray:
    return np.clip(rng.lognormal(np.log(median), sigma, n).astype(np.int64), lo, hi)


def sharegpt_like(n: int, rate: float, seed: int = 0, prompt_median: float = 48, output_median: float = 24,
                  max_len: int = 256, vocab: int = 256) -> Trace:
    """Poisson arrivals at `rate` requests/s; prompt + output <= max_len."""
    _check_size(n, rate)
    rng = np.random.default_rng(seed)
    arrival = np.cumsum(rng.exponential(1 / rate, n))
    prompt = _lognormal(rng, prompt_median, 0.8, n, 4, max_len // 2)
    output = np.minimum(_lognormal(rng, output_median, 0.9, n, 1, max_len), max_len - prompt)
    none = np.full(n, -1)
    return Trace(arrival, prompt, output, none, np.zeros(n, np.int64), vocab)


def shared_prefix(n: int, rate: float, seed: int = 0, n_prefixes: int = 4, prefix_len: int = 96,
                  question_median: float = 16, output_median: float = 24, max_len: int = 256, vocab: int = 256) -> Trace:
    _check_size(n, rate)
    rng = np.random.default_rng(seed)
    arrival = np.cumsum(rng.exponential(1 / rate, n))
    question = _lognormal(rng, question_median, 0.6, n, 1, max_len // 4)
    prompt = np.minimum(prefix_len + question, max_len // 2)
    output = np.minimum(_lognormal(rng, output_median, 0.9, n, 1, max_len), max_len - prompt)
    return Trace(arrival, prompt, output, rng.integers(0, n_prefixes, n), np.full(n, min(prefix_len, max_len // 2)), vocab)


def sharegpt_system_prompts(n: int, rate: float = 1.0, seed: int = 0, max_len: int = 2048, shared_fraction: float = 0.3,
                            prefix_len: int = 64, vocab: int = 256) -> Trace:
    """ShareGPT-like at full length: log-normal prompt (median ~150, at most max_len / 2) and output (median ~150)
    lengths, Poisson arrivals (`rate` per step, floored to whole steps), and `shared_fraction` of the requests (those
    with a longer prompt) opening with one of four system prompts of `prefix_len` tokens. Drawn with Python's
    `random`, one request after another, so a seed gives the trace kvcache.serve has always drawn."""
    _check_size(n, rate)
    rng, t, rows = random.Random(seed), 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        prompt = min(max(4, int(rng.lognormvariate(5.0, 0.8))), max_len // 2)
        output = min(max(1, int(rng.lognormvariate(5.0, 0.9))), max_len - prompt)
        shared = rng.random() < shared_fraction and prompt > prefix_len
        rows.append((int(t), prompt, output, rng.randrange(4) if shared else -1, prefix_len if shared else 0))
    columns = np.array(rows, np.int64)
    return Trace(columns[:, 0].astype(np.float64), *columns[:, 1:].T, vocab)


WORKLOADS = {"sharegpt": sharegpt_like, "shared_prefix": shared_prefix}
