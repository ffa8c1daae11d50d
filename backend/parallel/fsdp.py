"""PyTorch's FSDP2 (fully_shard) on the same workload: the production peer of our ZeRO-3.
Each Linear is its own FSDP unit, as our ZeRO-3 shards per layer. FSDP2 averages gradients, so the local
loss is scaled by n; torch.optim.Adam (foreach=False) is the same formula as the workload's Adam."""
from __future__ import annotations

import torch

from backend.parallel.loop import Strategy


class FSDP2(Strategy):
    name = "fsdp"

    @property
    def loss_multiplier(self):
        return self.world

    def setup(self, model):
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard

        super().setup(model)
        mesh = DeviceMesh("cpu", self.mesh.ranks("dp"))
        for mod in self.model:
            if isinstance(mod, torch.nn.Linear):
                fully_shard(mod, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=self.workload.lr, foreach=False)

    def optimizer_step(self, step):
        self.opt.step()

    def memory(self):
        local = [p.to_local() for p in self.model.parameters()]
        item, owned = local[0].element_size(), sum(t.numel() for t in local)
        states = sum(s.to_local().numel() for st in self.opt.state.values() for k, s in st.items() if k in ("exp_avg", "exp_avg_sq"))
        return {"parameters": owned * item, "gradients": owned * item, "optimizer states": states * item}

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
