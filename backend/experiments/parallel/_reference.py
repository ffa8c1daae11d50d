"""The mesh's reference: one process trains the tiny LLaMA on the whole batch with torch.optim.Adam. The parallel
pages' checks (mesh, checkpoint, the data-parallel ones, the parameter server) hold their ranks' losses and weights
against it."""
from __future__ import annotations

import torch

from backend.parallel.precision import FP64, Precision
from backend.parallel.tp_model import reference_model, tokens


def reference_training(config, precision: Precision = FP64, skip: tuple = ()) -> dict:
    """One process, the whole batch, the same Adam: losses per step and the final (master) weights. Every step sees
    the same batch (random tokens have nothing else to learn), so the loss must fall as the model memorises it.
    `precision`: the model runs in its compute dtype on a copy of master weights in its master dtype, which
    torch.optim.Adam updates from the gradients cast to the master dtype (the mixed-precision recipe; fp64: one model).
    fp16 runs under torch.amp.GradScaler; `skip`: steps not applied (those an fp16 run's loss scale skipped)."""
    master = reference_model(config).to(precision.master)
    initial = {k: v.detach().double().clone() for k, v in master.state_dict().items()}
    model = master if not precision.mixed else reference_model(config).to(precision.compute)
    opt = torch.optim.Adam(master.parameters(), lr=config.lr)
    losses, routing, scales, skipped, peaks = [], [], [], [], []
    # (GradScaler's defaults; the ranks' numerics.mixed_precision.DynamicLossScaler writes the same rule out)
    scaler = (torch.amp.GradScaler("cpu", init_scale=float(config.init_loss_scale))
              if precision.compute == torch.float16 else None)
    for step in range(config.steps):
        if config.experts:
            for b in model.blocks:
                b.ffn.routing_log = []  # this step's choices, one entry per sequence
        opt.zero_grad()
        if precision.mixed:
            model.load_state_dict(master.state_dict())  # the compute copy: the master cast (copy_ casts)
            model.zero_grad(set_to_none=True)
        loss = model.loss(tokens(config))
        (scaler.scale(loss) if scaler else loss).backward()
        if precision.mixed:
            for p_, q in zip(master.parameters(), model.parameters()):
                p_.grad = q.grad.to(precision.master)  # (still scaled: GradScaler unscales, checks and skips itself)
        if scaler:  # (each step's largest fp16 gradient, inf on overflow: how near the step came to fp16's max)
            peaks.append(max(q.grad.float().abs().max().item() for q in model.parameters()))
            scales.append(scaler.get_scale())
            scaler.step(opt)
            scaler.update()
            skipped.append(scaler.get_scale() < scales[-1])
        elif step not in skip:
            opt.step()
        losses.append(loss.item())
        if config.experts:  # (layer, sequence, position, choice): each token's experts at this step
            routing.append(torch.stack([torch.stack(b.ffn.routing_log) for b in model.blocks]))
    return {"losses": losses, "state": {k: v.detach().double() for k, v in master.state_dict().items()},
            "routing": routing, "initial": initial, "scales": scales, "skipped": skipped, "peaks": peaks}
