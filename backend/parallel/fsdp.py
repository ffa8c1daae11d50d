"""PyTorch's FSDP2 (fully_shard) as the mesh's fsdp2: `FullyShardedStages` shards each pipeline stage's blocks over the
dp group (optionally with torch's CPUOffloadPolicy), its all-gathers and reduce-scatters run as our rings on the dp
Wire so every byte is counted; torch.optim.Adam (foreach=False) is precision.Adam's formula."""
from __future__ import annotations

import torch

from backend.parallel.offload import FSDPTransfers
from backend.parallel.precision import Adam, named_weights


def dp_device_mesh(group, rank: int):
    """torch's DeviceMesh over the dp group (from_group: ranks outside it need not join); a dp of one gets a group of
    this rank alone (local synchronisation: only it calls)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    if group is None:
        group = dist.new_group([rank], use_local_synchronization=True)
    return DeviceMesh.from_group(group, "cpu")


class WireAllGather:
    """FSDP2's all-gather (set_custom_all_gather) as our ring on the dp Wire, of the one flat buffer FSDP2 hands:
    every parameter's dim-0 shard, padded."""

    def __init__(self, wire):
        self.wire = wire

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        output_tensor.copy_(self.wire.all_gather(input_tensor, 0, "forward", "fsdp2 parameters"))


class WireReduceScatter(WireAllGather):
    """FSDP2's reduce-scatter of the flat padded gradients on the dp Wire: a sum (divide factor 1, since each
    micro-batch's loss is already its share of the global mean)."""

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        import torch.distributed as dist

        if op != dist.ReduceOp.SUM:
            raise ValueError(f"FSDP2 asked for a {op} reduce-scatter; the mesh sums (gradient divide factor 1)")
        output_tensor.copy_(self.wire.reduce_scatter(input_tensor, 0, "backward", "fsdp2 gradients"))


class StageEntry(torch.nn.Module):
    """A stage's chunk as the module FSDP2 wraps: its forward runs the stage's (`fn`), so fully_shard's hooks, which
    fire on a module call, see every forward and backward of the stage."""

    def __init__(self, chunk: torch.nn.Module):
        super().__init__()
        self.chunk = chunk

    def forward(self, fn, x, mb):
        return fn(x, mb)


def reduce_gradients(entry) -> None:
    """After a pipeline's last backward: FSDP2's post_backward with gradient sync on (reduce-scatter, reshard), as
    torch.distributed.pipelining's perform_reduce_grad does (no public call: the pipeline's backwards do not run
    through FSDP2's last autograd hook); sync off again after."""
    from torch.distributed.fsdp import fully_shard

    entry.set_is_last_backward(True)
    entry.set_reshard_after_backward(True)
    entry.set_requires_gradient_sync(True)
    state = fully_shard.state(entry)
    for s in state._state_ctx.all_states:
        for group in s._fsdp_param_groups:
            group.post_backward()
    state._root_post_backward_final_callback()
    entry.set_reshard_after_backward(False)
    entry.set_requires_gradient_sync(False)


class FullyShardedStages:
    """dp_strategy fsdp2: fully_shard on each stage chunk over the dp group, torchtitan's shape under a pipeline.
    Parameters are DTensors sharded on dim 0 between steps; each step's start unshards every chunk once
    (reshard_after_forward False), the backwards accumulate unsharded gradients with sync off, and after the last one
    FSDP2's own post_backward reduce-scatters and reshards. Adam (elementwise) updates each local shard. Parameters
    lose their Python attributes (source, sequence_parallel) when FSDP2 swaps them: kept and restored. `offload`:
    CPUOffloadPolicy (no pinning: no accelerator), FSDP2's own copies counted by offload.FSDPTransfers."""

    strategy = "fsdp2"
    overlap = None  # (no DDP overlap here)

    def __init__(self, model: torch.nn.ModuleDict, group, rank: int, dp, tracer, lr: float, offload: bool = False):
        from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

        self.model, self.tracer, self.offload = model, tracer, offload
        policy = CPUOffloadPolicy(pin_memory=False) if offload else OffloadPolicy()
        self.attrs = {n: {a: getattr(p, a) for a in ("source", "sequence_parallel") if hasattr(p, a)}
                      for n, p in model.named_parameters()}
        mesh = dp_device_mesh(group, rank)
        self.entries = []
        for chunk in model.values():
            entry = StageEntry(chunk)
            fully_shard(entry, mesh=mesh, reshard_after_forward=False, offload_policy=policy)
            entry.set_custom_all_gather(WireAllGather(dp))
            entry.set_custom_reduce_scatter(WireReduceScatter(dp))
            entry.set_gradient_divide_factor(1.0)
            entry.set_reshard_after_backward(False)
            entry.set_requires_gradient_sync(False)
            self.entries.append(entry)
        self.entry_of = {id(c): e for c, e in zip(model.values(), self.entries)}
        self.shards = list(model.parameters())  # DTensors
        self.adams = [(Adam(lr), torch.zeros_like(p.to_local()), torch.zeros_like(p.to_local())) for p in self.shards]
        self.grads_kept = 0
        # every copy FSDP2 makes from here to final_named (forward and backward hooks included)
        self.transfers = FSDPTransfers().start() if offload else None

    def weights_for_step(self, step) -> None:
        """Every chunk unsharded once (None: the modules hold the weights, nothing to load)."""
        with self.tracer.span("collective", f"all-gather weights {step}", kind="collective"):
            for e in self.entries:
                e.unshard()
        for n, p in self.model.named_parameters():  # FSDP2's unsharded parameters are new objects
            for a, v in self.attrs[n].items():
                setattr(p, a, v)

    def update(self, grads: torch.Tensor, step: int, skip: bool = False) -> None:
        """`grads` (flat, unsharded, summed over cp and ep) onto FSDP2's unsharded parameters, its reduce-scatter and
        reshard, Adam on the local shards. None: the modules hold the shards."""
        params = list(self.model.parameters())
        for p, g in zip(params, grads.split([p.numel() for p in params])):
            p.grad.copy_(g.view_as(p))
        with self.tracer.span("collective", f"reduce-scatter gradients {step}", kind="collective"):
            for e in self.entries:
                reduce_gradients(e)
        grads = [p.grad.to_local() for p in self.shards]
        self.grads_kept = sum(g.numel() for g in grads)
        with self.tracer.span("compute", f"adam {step}", kind="optimizer"), torch.no_grad():
            for p, g, (adam, m, v) in zip(self.shards, grads, self.adams):
                adam.update(p.to_local(), g, m, v)

    def final_named(self, model) -> dict:
        """The trained weights by name (float64): one more all-gather (as ZeRO-3's report); from here on the stages run
        as plain modules (recompute's price, after training, calls no FSDP2 hook)."""
        if self.transfers:
            self.transfers.stop()
        self.weights_for_step("final")
        self.entry_of = {}
        return named_weights(model)

    def gradients(self) -> None:  # the loop reads the unsharded parameters' own
        return None

    def _held(self) -> dict[str, int]:
        """Bytes of the DTensors' local shards (FSDP2's padding apart), their gradients and Adam's m, v."""
        return {"parameters": sum(p.to_local().numel() for p in self.shards) * 8, "gradients": self.grads_kept * 8,
                "optimizer states": sum(m.numel() + v.numel() for _, m, v in self.adams) * 8}

    def memory(self) -> dict[str, int]:
        return {k: 0 for k in self._held()} if self.offload else self._held()

    def host_memory(self) -> dict[str, int]:
        if not self.offload:
            return {}
        assert all(p.to_local().device.type == "cpu" for p in self.shards)
        names = {"parameters": "parameters (shard)", "gradients": "gradients (shard)"}
        return {names.get(k, k): n for k, n in self._held().items()}

    def moved(self) -> dict[str, int]:
        return dict(self.transfers.moved) if self.transfers else {}

    def close(self) -> None:
        pass

    def entry(self, chunk):
        """The fully_shard-ed module stage `chunk`'s forward is called through (its hooks fire on a module call)."""
        return self.entry_of.get(id(chunk))
