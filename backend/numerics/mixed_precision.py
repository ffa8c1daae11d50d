"""FP16 mixed-precision training with loss scaling (seed 000; Micikevicius et al. 2018).

Each step: the fp32 master weights are rounded to an fp16 copy; forward and backward run in fp16; the loss is
computed in fp32 from the fp16 logits and multiplied by the loss scale S before backward, so gradients that would
fall below FP16's smallest subnormal (2^-24; anything under 2^-25 rounds to 0) are lifted into range; the fp16
gradients are cast to fp32, divided by S and applied to the master weights. A step whose gradients hold inf/NaN
(S too large) is skipped.

Dynamic scaling as torch.amp.GradScaler does it: on overflow halve S (backoff) and reset the counter; after
growth_interval clean steps in a row double S.

Gradient size: a large model's loss is the mean over a global batch of millions of tokens, so each element of
its gradient is tiny. Here the loss of a small batch is weighted by batch tokens / global-batch tokens, as the
global mean would weigh it; Adam's update does not depend on that factor (up to its eps), so fp32 training is
unchanged, but FP16 now sees gradients of a large run's size.

Underflow is counted against an fp32 backward of the same master weights, batch and scale: an element
underflowed if its fp16 gradient is exactly 0 while the fp32 one is nonzero and below FP16's smallest subnormal
(a zero from cancellation is not underflow). Counted at the logits (the first activation gradient of the
backward, (softmax - onehot) / tokens) and on every parameter.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.func import vmap

MODES = ("fp32", "fp16 no scaling", "fp16 static scaling", "fp16 dynamic scaling", "fp16 GradScaler")


@dataclass
class DynamicLossScaler:
    """GradScaler's update rule, written out."""
    scale: float
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    clean_steps: int = 0

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.scale *= self.backoff_factor
            self.clean_steps = 0
        else:
            self.clean_steps += 1
            if self.clean_steps == self.growth_interval:
                self.scale *= self.growth_factor
                self.clean_steps = 0


def lm_loss(model, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean next-token cross-entropy in fp32, the logits in the model's dtype with their grad retained)."""
    logits = vmap(model)(batch[:, :-1])
    logits.retain_grad()
    loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
    return loss, logits


FP16_TINIEST = 2.0 ** -24  # smallest subnormal


def underflow(fp16: torch.Tensor, fp32: torch.Tensor) -> tuple[int, int]:
    """(elements FP16 flushed to zero, elements nonzero in fp32)."""
    nonzero = fp32 != 0
    lost = (fp16 == 0) & nonzero & (fp32.abs() < FP16_TINIEST)
    return int(lost.sum()), int(nonzero.sum())


@dataclass
class Settings:
    steps: int
    lr: float
    loss_weight: float  # batch tokens / global-batch tokens
    static_scale: float
    init_scale: float
    growth_interval: int
    count_every: int


def train(model: torch.nn.Module, batches: list[torch.Tensor], mode: str, s: Settings) -> tuple[list[dict], torch.nn.Module]:
    """Train a copy of model (the fp32 master) for s.steps; one row per step: loss, scale, skipped, underflow counts."""
    master = copy.deepcopy(model)
    opt = torch.optim.AdamW(master.parameters(), lr=s.lr)
    half = copy.deepcopy(model).half()
    ours = DynamicLossScaler(s.init_scale, growth_interval=s.growth_interval)
    peer = torch.amp.GradScaler("cpu", init_scale=s.init_scale, growth_interval=s.growth_interval) if mode == "fp16 GradScaler" else None
    rows = []
    for step in range(s.steps):
        batch = batches[step % len(batches)]
        opt.zero_grad()
        if mode == "fp32":
            loss, _ = lm_loss(master, batch)
            (loss * s.loss_weight).backward()
            opt.step()
            rows.append({"mode": mode, "step": step, "loss": loss.item(), "scale": 1.0, "skipped": False})
            continue
        scale = {"fp16 no scaling": 1.0, "fp16 static scaling": s.static_scale, "fp16 dynamic scaling": ours.scale,
                 "fp16 GradScaler": peer.get_scale() if peer else 0.0}[mode]
        half.load_state_dict(master.state_dict())  # round the master weights to fp16
        for p in half.parameters():
            p.grad = None
        loss, logits16 = lm_loss(half, batch)
        (peer.scale(loss * s.loss_weight) if peer else loss * s.loss_weight * scale).backward()
        grads = [p.grad.float() for p in half.parameters()]
        found_inf = not all(torch.isfinite(g).all() for g in grads)
        row = {"mode": mode, "step": step, "loss": loss.item(), "scale": scale, "skipped": found_inf}
        if step % s.count_every == 0 and mode != "fp16 GradScaler":
            row.update(count_underflow(master, batch, logits16.grad, grads, s.loss_weight * scale))
        if peer:
            for p, g in zip(master.parameters(), grads):
                p.grad = g  # still scaled: GradScaler unscales, checks for inf and skips the step itself
            peer.step(opt)
            peer.update()
        else:
            if not found_inf:
                for p, g in zip(master.parameters(), grads):
                    p.grad = g / scale
                opt.step()
            if mode == "fp16 dynamic scaling":
                ours.update(found_inf)
        rows.append(row)
    return rows, master


def count_underflow(master, batch, logits_grad16, grads16, multiplier: float) -> dict:
    """Underflowed elements of this step's fp16 gradients against an fp32 backward of the same weights."""
    reference = copy.deepcopy(master)
    loss, logits = lm_loss(reference, batch)
    (loss * multiplier).backward()  # the same loss weight and scale, so only the number format differs
    act = underflow(logits_grad16.float(), logits.grad)
    ref = [p.grad for p in reference.parameters()]
    par = [underflow(g16, g32) for g16, g32 in zip(grads16, ref)]
    flat16, flat32 = torch.cat([g.flatten() for g in grads16]), torch.cat([g.flatten() for g in ref])
    return {"activation_underflow": act[0], "activation_nonzero": act[1],
            "param_underflow": sum(u for u, _ in par), "param_nonzero": sum(n for _, n in par),
            "grad_relative_error": float((flat16 - flat32).norm() / flat32.norm())}


def gradient_magnitudes(model, batch, loss_weight: float) -> dict[str, torch.Tensor]:
    """|gradient| of the parameters and of the logits in an fp32 backward: where they sit against FP16's range."""
    reference = copy.deepcopy(model)
    loss, logits = lm_loss(reference, batch)
    (loss * loss_weight).backward()
    return {"parameters": torch.cat([p.grad.flatten() for p in reference.parameters()]).abs(),
            "logits (activation)": logits.grad.flatten().abs()}
