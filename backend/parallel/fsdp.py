"""PyTorch's FSDP2 (fully_shard) on the same workload: the production peer of our ZeRO-3.
Each Linear is its own FSDP unit, as our ZeRO-3 shards per layer. FSDP2 averages gradients, so the local
loss is scaled by n; torch.optim.Adam (foreach=False) is the same formula as the workload's Adam."""
from __future__ import annotations

import torch
import torch.distributed as dist

from backend.parallel.workload import activation_bytes, batch, local_slice, loss_fn, make_model
from backend.trace import Tracer


def run_rank(rank: int, world: int, config, ctx) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    tracer = Tracer(rank)
    tracer.align(dist.barrier)
    mesh = init_device_mesh("cpu", (world,))
    model = make_model(config.hidden, config.layers, config.seed)
    for mod in model:
        if isinstance(mod, torch.nn.Linear):
            fully_shard(mod, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=config.lr, foreach=False)
    losses, memory = [], {}
    for step in range(config.steps):
        x, y = batch(config, step)
        xs, ys = local_slice(config, rank, world, x), local_slice(config, rank, world, y)
        opt.zero_grad(set_to_none=True)
        with tracer.span("compute", f"forward {step}"):
            out, act = activation_bytes(lambda: model(xs))
            loss = loss_fn(config, out, ys)
        with tracer.span("compute", f"backward {step}"):
            (loss * world).backward()
        with tracer.span("compute", f"adam {step}"):
            opt.step()
        total = torch.tensor([loss.item()], dtype=torch.float64)
        dist.all_reduce(total)
        losses.append(total.item())
        if step == 0:
            local = [p.to_local() for p in model.parameters()]
            item = local[0].element_size()
            owned = sum(t.numel() for t in local)
            memory = {"parameters": owned * item, "gradients": owned * item,
                      "optimizer states": sum(s.to_local().numel() * item for st in opt.state.values() for k, s in st.items() if k in ("exp_avg", "exp_avg_sq")),
                      "activations": act}
        if rank == 0:
            ctx.progress((step + 1) / config.steps, f"step {step + 1}")
    full = torch.cat([p.full_tensor().detach().reshape(-1) for p in model.parameters()])
    return {"rank": rank, "losses": losses, "params": full.numpy().copy(), "memory": memory, "sent": None,
            "psi_bytes": full.numel() * full.element_size(), "trace": tracer.payload()}
