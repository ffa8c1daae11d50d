"""Speculative sampling (Leviathan et al. 2023; Chen et al. 2023; seed 004), batched over independent sequences.

One round: the draft model samples gamma tokens x_1..x_gamma autoregressively from q; the target model scores
the prefix plus all of them in ONE forward, giving p at gamma + 1 positions; x_i is accepted with probability
min(1, p(x_i) / q(x_i)), left to right; at the first rejection a token is drawn from norm(max(0, p - q)) and the
round ends; if all gamma are accepted a bonus token is drawn from p at the last position. Each round emits
1..gamma+1 tokens for one target call, and the emitted tokens are distributed exactly as sampling from p.

Sequences of a batch have different lengths after a round; they share one padded buffer, which is safe because
the models are causal: the logits at position t never see tokens after t. Models are called through torch.vmap
on (batch, length) token tensors; no KV cache, so every call recomputes its whole sequence (for draft and target
alike, and for plain decoding).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.func import vmap

RULES = ("correct", "resample_from_p")  # the second is a deliberate error: it resamples from p, not max(0, p - q)


def next_probs(model, buf: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Softmax of the model's logits at `positions` (batch, n) of each row of buf: (batch, n, vocab)."""
    logits = vmap(model)(buf[:, : int(positions.max()) + 1])
    return logits.gather(1, positions[..., None].expand(-1, -1, logits.shape[-1])).softmax(-1)


@dataclass
class Stats:
    rounds: int = 0        # batched rounds
    target_calls: int = 0  # target forwards, counted per sequence
    draft_calls: int = 0
    drafted: int = 0       # draft tokens the target judged (those after a rejection are never judged)
    accepted: int = 0
    emitted: int = 0       # summed over sequences
    per_round: list[int] = field(default_factory=list)


def speculative_round(target, draft, buf, lengths, gamma: int, g: torch.Generator, stats: Stats, rule: str = "correct"):
    """One round on every sequence of the batch; writes tokens into buf and advances lengths in place."""
    rows = torch.arange(buf.shape[0])
    start = lengths.clone()
    qs, xs = [], []
    for i in range(gamma):
        q = next_probs(draft, buf, (start + i - 1)[:, None])[:, 0]
        x = torch.multinomial(q, 1, generator=g)[:, 0]
        buf[rows, start + i] = x
        qs.append(q)
        xs.append(x)
    q, x = torch.stack(qs, 1), torch.stack(xs, 1)                         # (b, gamma, V), (b, gamma)
    p = next_probs(target, buf, start[:, None] - 1 + torch.arange(gamma + 1))  # (b, gamma + 1, V)
    p_x, q_x = p[:, :gamma].gather(2, x[..., None])[..., 0], q.gather(2, x[..., None])[..., 0]
    accept = torch.rand(x.shape, generator=g, dtype=p.dtype) < p_x / q_x    # u < p/q is acceptance with min(1, p/q)
    n = accept.long().cumprod(1).sum(1)                                   # accepted before the first rejection
    p_n = p[rows, n]
    if rule == "correct":
        residual = (p_n - torch.cat([q, torch.zeros_like(q[:, :1])], 1)[rows, n]).clamp(min=0)  # all accepted: q = 0, so p
        residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_n)
    else:
        residual = p_n
    buf[rows, start + n] = torch.multinomial(residual / residual.sum(-1, keepdim=True), 1, generator=g)[:, 0]
    lengths.copy_(start + n + 1)
    stats.rounds += 1
    stats.target_calls += len(rows)  # one target forward per sequence, batched
    stats.draft_calls += gamma * len(rows)
    stats.drafted += int(torch.clamp(n + 1, max=gamma).sum())
    stats.accepted += int(n.sum())
    stats.emitted += int((n + 1).sum())
    stats.per_round += (n + 1).tolist()


def speculative_decode(target, draft, prefix: torch.Tensor, new_tokens: int, gamma: int, g: torch.Generator,
                       rule: str = "correct") -> tuple[torch.Tensor, torch.Tensor, Stats]:
    """Rounds until every sequence of the batch prefix (b, t) has at least new_tokens more; returns buf, lengths, stats."""
    b, t = prefix.shape
    buf = torch.zeros(b, t + new_tokens + gamma + 1, dtype=torch.long)
    buf[:, :t] = prefix
    lengths = torch.full((b,), t)
    stats = Stats()
    while int(lengths.min()) < t + new_tokens:
        active = lengths < t + new_tokens  # finished sequences sit out, so no row outgrows the buffer
        sub_buf, sub_len = buf[active], lengths[active]
        speculative_round(target, draft, sub_buf, sub_len, gamma, g, stats, rule)
        buf[active], lengths[active] = sub_buf, sub_len
    return buf, lengths, stats


def plain_decode(target, prefix: torch.Tensor, new_tokens: int, g: torch.Generator) -> torch.Tensor:
    """Ordinary sampling from p: one target call per token."""
    b, t = prefix.shape
    buf = torch.zeros(b, t + new_tokens, dtype=torch.long)
    buf[:, :t] = prefix
    for i in range(t, t + new_tokens):
        p = next_probs(target, buf, torch.full((b, 1), i - 1))[:, 0]
        buf[:, i] = torch.multinomial(p, 1, generator=g)[:, 0]
    return buf


def expected_tokens_per_call(alpha: float, gamma: int) -> float:
    """E[tokens per round] = (1 - alpha^(gamma+1)) / (1 - alpha) if each draft token is accepted with probability alpha."""
    return gamma + 1.0 if alpha >= 1 else (1 - alpha ** (gamma + 1)) / (1 - alpha)


def predicted_speedup(alpha: float, gamma: int, cost_ratio: float) -> float:
    """Wall-time gain over plain decoding when a draft call costs cost_ratio target calls (Leviathan et al., Thm 3.8)."""
    return expected_tokens_per_call(alpha, gamma) / (gamma * cost_ratio + 1)


def chi_square(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> tuple[float, int, float]:
    """Pearson's chi-square of observed counts against probabilities; cells expected below min_expected are pooled
    into one. Returns (statistic, degrees of freedom, p-value = Q(dof/2, stat/2))."""
    n = counts.sum()
    expected = probs.double() * n
    small = expected < min_expected
    obs = torch.cat([counts[~small].double(), counts[small].double().sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = float(((obs - exp) ** 2 / exp).sum())
    dof = int(keep.sum()) - 1
    return stat, dof, float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)))
