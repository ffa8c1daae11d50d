"""A Markov-chain corpus over a small vocabulary: text whose best possible next-token loss is known.

The transition matrix P is random (seeded); the entropy rate H = -Σ_i π_i Σ_j P_ij ln P_ij, with π the
stationary distribution, is the lowest next-token loss any model can reach on fresh samples: an
independent floor for every experiment that trains the tiny LLaMA on it.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F


class MarkovCorpus:
    def __init__(self, vocab: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.P = torch.softmax(2.5 * torch.randn(vocab, vocab, generator=g, dtype=torch.float64), dim=1)
        pi = torch.full((vocab,), 1.0 / vocab, dtype=torch.float64)
        for _ in range(500):
            pi = pi @ self.P
        self.pi = pi
        self.entropy_rate = float(-(pi[:, None] * self.P * self.P.log()).sum())

    def sample(self, n: int, length: int, g: torch.Generator) -> torch.Tensor:
        seqs = torch.empty(n, length, dtype=torch.long)
        seqs[:, 0] = torch.multinomial(self.pi, n, replacement=True, generator=g)
        for t in range(1, length):
            seqs[:, t] = torch.multinomial(self.P[seqs[:, t - 1]], 1, generator=g)[:, 0]
        return seqs


def held_out_loss(model, seqs: torch.Tensor) -> tuple[float, float, torch.Tensor]:
    """A model's mean next-token loss over held-out sequences (nats per token), its standard error over the tokens, and
    the logits: the figure every experiment training on this corpus holds against the entropy rate."""
    with torch.no_grad():
        logits = torch.stack([model(s[:-1]) for s in seqs])
        nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), seqs[:, 1:].reshape(-1), reduction="none")
    return float(nll.mean()), float(nll.std() / math.sqrt(nll.numel())), logits
