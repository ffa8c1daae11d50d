"""Request traces in seconds, as arrays (so a million requests is cheap): arrival time, prompt length,
output length, and an optional shared prefix (one of a few system or few-shot prompts).

Token ids are a deterministic function of (request, position), or of (prefix, position) inside a
shared prefix, so requests with the same prefix really share their first tokens and prefix caching
finds them, with no token list stored per request.
- `sharegpt_like`: the ShareGPT-like shape of kvcache.serving's generator (log-normal prompt and
  output lengths, sigma 0.8 and 0.9; Poisson arrivals), medians scaled to the tiny model.
- `shared_prefix`: few-shot prompts: every request opens with one of `n_prefixes` long prefixes and
  adds a short question, the workload where prefix caching matters.
"""
from __future__ import annotations

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

    def token(self, rid: int, i: int) -> int:
        key = (-1 - int(self.prefix_id[rid])) if i < self.prefix_len[rid] else rid
        return ((key * 1_000_003 + i) * 2_654_435_761 >> 11) % self.vocab

    def prompt(self, rid: int) -> list[int]:
        return [self.token(rid, i) for i in range(int(self.prompt_len[rid]))]

    def head(self, n: int) -> "Trace":
        return Trace(self.arrival[:n], self.prompt_len[:n], self.output_len[:n], self.prefix_id[:n], self.prefix_len[:n], self.vocab)


def from_requests(requests, arrival_unit_s: float, vocab: int = 256) -> Trace:
    """A Trace from parsed CSV rows (backend.kvcache.serving.Request), in arrival order; arrivals times the unit."""
    rows = sorted(requests, key=lambda r: r.arrival)
    column = lambda name, dtype: np.array([getattr(r, name) for r in rows], dtype)  # noqa: E731
    return Trace(column("arrival", np.float64) * arrival_unit_s, column("prompt_len", np.int64), column("output_len", np.int64),
                 column("prefix_id", np.int64), column("prefix_len", np.int64), vocab)


def _lognormal(rng, median: float, sigma: float, n: int, lo: int, hi: int) -> np.ndarray:
    return np.clip(rng.lognormal(np.log(median), sigma, n).astype(np.int64), lo, hi)


def sharegpt_like(n: int, rate: float, seed: int = 0, prompt_median: float = 48, output_median: float = 24,
                  max_len: int = 256, vocab: int = 256) -> Trace:
    """Poisson arrivals at `rate` requests/s; prompt + output <= max_len."""
    if n < 1 or rate <= 0:
        raise ValueError(f"a trace needs n >= 1 requests and rate > 0 (got n={n}, rate={rate})")
    rng = np.random.default_rng(seed)
    arrival = np.cumsum(rng.exponential(1 / rate, n))
    prompt = _lognormal(rng, prompt_median, 0.8, n, 4, max_len // 2)
    output = np.minimum(_lognormal(rng, output_median, 0.9, n, 1, max_len), max_len - prompt)
    none = np.full(n, -1)
    return Trace(arrival, prompt, output, none, np.zeros(n, np.int64), vocab)


def shared_prefix(n: int, rate: float, seed: int = 0, n_prefixes: int = 4, prefix_len: int = 96,
                  question_median: float = 16, output_median: float = 24, max_len: int = 256, vocab: int = 256) -> Trace:
    if n < 1 or rate <= 0:
        raise ValueError(f"a trace needs n >= 1 requests and rate > 0 (got n={n}, rate={rate})")
    rng = np.random.default_rng(seed)
    arrival = np.cumsum(rng.exponential(1 / rate, n))
    question = _lognormal(rng, question_median, 0.6, n, 1, max_len // 4)
    prompt = np.minimum(prefix_len + question, max_len // 2)
    output = np.minimum(_lognormal(rng, output_median, 0.9, n, 1, max_len), max_len - prompt)
    return Trace(arrival, prompt, output, rng.integers(0, n_prefixes, n), np.full(n, min(prefix_len, max_len // 2)), vocab)


WORKLOADS = {"sharegpt": sharegpt_like, "shared_prefix": shared_prefix}
