"""PyTorch's FSDP2 (fully_shard) on the same workload: the production peer of our ZeRO-3.
Each Linear is its own FSDP unit, as our ZeRO-3 shards per layer. FSDP2 averages gradients, so the local
loss is scaled by n; torch.optim.Adam (foreach=False) is the same formula as the workload's Adam.
With `offload`, fully_shard gets PyTorch's CPUOffloadPolicy (no pinning: there is no accelerator): the sharded
parameters, their gradients and Adam's states are the host's, and FSDP2's copies between host and device are
counted by backend/parallel/offload.FSDPTransfers."""
from __future__ import annotations

import torch

from backend.parallel.loop import Strategy
from backend.parallel.offload import FSDPTransfers


class FSDP2(Strategy):
    def __init__(self, *args, offload: bool = False, **kw):
        super().__init__(*args, **kw)
        self.offload = offload
        self.name = "fsdp-offload" if offload else "fsdp"
        self.transfers = FSDPTransfers()

    @property
    def loss_multiplier(self):
        return self.world

    def setup(self, model):
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

        super().setup(model)
        mesh = DeviceMesh("cpu", self.mesh.ranks("dp"))
        policy = CPUOffloadPolicy(pin_memory=False) if self.offload else OffloadPolicy()
        for mod in self.model:
            if isinstance(mod, torch.nn.Linear):
                fully_shard(mod, mesh=mesh, offload_policy=policy)
        fully_shard(self.model, mesh=mesh, offload_policy=policy)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=self.workload.lr, foreach=False)

    def forward_backward(self, xs, ys, step):
        with self.transfers:  # FSDP2's host <-> device copies happen in its forward and backward hooks
            return super().forward_backward(xs, ys, step)

    def optimizer_step(self, step):
        self.opt.step()

    def _held(self) -> dict[str, int]:
        local = [p.to_local() for p in self.model.parameters()]
        item, owned = local[0].element_size(), sum(t.numel() for t in local)
        grads = sum(p.grad.to_local().numel() for p in self.model.parameters() if p.grad is not None)
        states = sum(s.to_local().numel() for st in self.opt.state.values() for k, s in st.items() if k in ("exp_avg", "exp_avg_sq"))
        return {"parameters": owned * item, "gradients": grads * item, "optimizer states": states * item}

    def memory(self):
        """On the device, what FSDP2 keeps there: everything sharded, or (offloaded) nothing between steps."""
        return {k: 0 for k in self._held()} if self.offload else self._held()

    def host_memory(self):
        if not self.offload:
            return {}
        held = self._held()
        assert all(p.to_local().device.type == "cpu" for p in self.model.parameters())
        return {"parameters (shard)": held["parameters"], "gradients (shard)": held["gradients"],
                "optimizer states": held["optimizer states"]}

    def extra(self):
        return {"moved": dict(self.transfers.moved), "copies": dict(self.transfers.calls)} if self.offload else {}

    def final_params(self):
        return torch.cat([p.full_tensor().detach().reshape(-1) for p in self.model.parameters()])

    def checkpoint_state(self):
        """DCP's own view of FSDP2's model and optimizer: DTensors sharded on dim 0 (torch.chunk's rows)."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model, optim = get_state_dict(self.model, self.opt)
        return {"model": model, "optim": optim}

    def load_checkpoint_state(self, state):
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(self.model, self.opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
