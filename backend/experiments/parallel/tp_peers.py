"""The tensor-parallel experiment's peers: PyTorch's own DTensor tensor parallel on the same layer (its collectives
recorded below DTensor, their gloo bytes modelled), the bytes each side really wrote to its sockets, and seed 004's
pipeline cut after layer 0 (MK sent and read off the socket).
Measurements of the experiment, not parts of the transform (backend/parallel/tp.py)."""
from __future__ import annotations

import threading

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from backend.comm.p2p import Transfer
from backend.models.llama import TinyDecoder
from backend.parallel.tp import sum_norm_grads
from backend.parallel.wire import ring_bytes


GLOO_PREAMBLE = 48  # bytes gloo's TCP transport writes ahead of every message (Op::Preamble: six 8-byte fields)


def gloo_bytes(op: str, numel: int, n: int, item: int) -> int:
    """What one rank sends in gloo's own collectives, as measured by WrittenBytes (tests/test_tensor_parallel.py):
    a ring all-reduce and all-gather, the same volumes as ours; but no reduce-scatter of its own: ProcessGroupGloo
    all-reduces the whole input and keeps its slice, so a reduce-scatter costs an all-reduce."""
    return ring_bytes("all_reduce" if op == "reduce_scatter" else op, numel, n, item)


class WrittenBytes:
    """Bytes this process handed to write system calls inside a `with` block, and how many calls (Linux's
    /proc/self/io wchar and syscw), less what its other Python threads wrote meanwhile (a run leader's heartbeat
    to the store, a result queue's feeder: /proc/self/task/TID/io). What remains is this thread's and gloo's own
    C++ threads': on a rank that writes no file meanwhile, what gloo put on its sockets, every message's payload
    and its GLOO_PREAMBLE, so `payload` = bytes - calls x GLOO_PREAMBLE. None where there is no /proc (then
    nothing is measured, and nothing claimed)."""

    def __init__(self):
        self.bytes = self.calls = self.payload = None

    @staticmethod
    def _io(path: str) -> tuple[int, int]:
        fields = dict(line.split(": ") for line in open(path).read().splitlines())
        return int(fields["wchar"]), int(fields["syscw"])

    @classmethod
    def _read(cls):
        try:
            written, calls = cls._io("/proc/self/io")
            for t in threading.enumerate():
                if t is not threading.current_thread() and t.native_id is not None:
                    try:
                        other = cls._io(f"/proc/self/task/{t.native_id}/io")
                    except OSError:  # the thread ended between the listing and the read
                        continue
                    written, calls = written - other[0], calls - other[1]
        except OSError:
            return None
        return written, calls

    def __enter__(self):
        self._start = self._read()
        return self

    def __exit__(self, *exc):
        end = self._read()
        if self._start and end:
            self.bytes, self.calls = end[0] - self._start[0], end[1] - self._start[1]
            self.payload = self.bytes - self.calls * GLOO_PREAMBLE


class DTensorCollectives(TorchDispatchMode):
    """A dispatch mode that sees the functional collectives DTensor lowers its redistributions to (below DTensor,
    on plain tensors), recording each one's op and input size and what gloo sends for it on one of n ranks."""

    OPS = {"all_reduce": "all_reduce", "all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter"}

    def __init__(self, n: int):
        super().__init__()
        self.n, self.rows = n, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor  # imported by then: the caller built DTensors

        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor lower itself first, then see what it issues
        name = func._overloadpacket.__name__
        if func.namespace in ("_c10d_functional", "c10d_functional") and name in self.OPS:
            t, op = args[0], self.OPS[name]
            self.rows.append({"op": op, "numel": t.numel(), "model_bytes": gloo_bytes(op, t.numel(), self.n, t.element_size())})
        return func(*args, **(kwargs or {}))

    def counts(self) -> dict[str, int]:
        """Calls per op under torch's names, as CommDebugMode.get_comm_counts reports them."""
        torch_name = {v: k for k, v in self.OPS.items()}
        out: dict[str, int] = {}
        for r in self.rows:
            out[torch_name[r["op"]]] = out.get(torch_name[r["op"]], 0) + 1
        return out


def dtensor_peer(reference: TinyDecoder, ours_tp, ours_sp, tp_wire, sp_wire, x: torch.Tensor, n: int, rank: int) -> dict:
    """PyTorch's own tensor parallel on layer 0 of the same reference, compared output for output and gradient for
    gradient with our parallelized blocks (`ours_tp`, `ours_sp`: block 0 of parallelize's model): parallelize_module with ColwiseParallel and RowwiseParallel
    on the MLP and on the attention, and on the whole block with SequenceParallel norms (Megatron-SP's layout).
    Bytes: DTensorCollectives records every collective DTensor issues with its size (CommDebugMode, torch's own
    counter, must agree on the counts), gloo_bytes models what gloo sends for them, and WrittenBytes measures what
    each side really wrote to its sockets, DTensor's through gloo's collectives and ours through gloo's send/recv."""
    import copy

    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel,
                                                   parallelize_module)

    mesh = DeviceMesh("cpu", list(range(n)))
    layer = reference.blocks[0]
    qkv = {"attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(), "attn.wv": ColwiseParallel()}
    mlp = {"ffn.gate": ColwiseParallel(), "ffn.up": ColwiseParallel()}
    sp_plan = {"attn_norm": SequenceParallel(sequence_dim=0), "ffn_norm": SequenceParallel(sequence_dim=0),  # unbatched (t, d)
               "attn": PrepareModuleInput(input_layouts=(Shard(0), None, None), desired_input_layouts=(Replicate(), None, None)),
               "ffn": PrepareModuleInput(input_layouts=(Shard(0),), desired_input_layouts=(Replicate(),)),
               **qkv, "attn.wo": RowwiseParallel(output_layouts=Shard(0)), **mlp, "ffn.down": RowwiseParallel(output_layouts=Shard(0))}
    t = x.shape[1]
    rows_sp = slice(rank * t // n, (rank + 1) * t // n)
    cases = {  # name: (peer module, plan, peer call, our call, peer parameters in our parameters' order)
        "MLP: Colwise, Rowwise": (layer.ffn, {k[4:]: v for k, v in mlp.items()} | {"down": RowwiseParallel()},
                                  lambda m, v: m(v), lambda v: ours_tp.ffn(v), ["gate", "up", "down"]),
        "attention: Colwise, Rowwise": (layer.attn, {k[5:]: v for k, v in qkv.items()} | {"wo": RowwiseParallel()},
                                        lambda m, v: m(v[0], 0)[None], lambda v: ours_tp.attn.batched(v[:1]), ["wq", "wk", "wv", "wo"]),
        "block: SequenceParallel norms, Colwise, Rowwise": (
            layer, sp_plan, lambda m, v: m(v[0, rows_sp], 0, None), lambda v: ours_sp.batched(v[:1, rows_sp])[0],
            ["attn_norm", "attn.wq", "attn.wk", "attn.wv", "attn.wo", "ffn_norm", "ffn.gate", "ffn.up", "ffn.down"]),
    }
    rows = {}
    for name, (module, plan, call_peer, call_mine, order) in cases.items():
        peer = copy.deepcopy(module)
        parallelize_module(peer, mesh, plan)
        attn = peer.attn if hasattr(peer, "attn") else peer if hasattr(peer, "n_kv_heads") else None
        if attn is not None:
            attn.n_heads, attn.n_kv_heads = attn.n_heads // n, attn.n_kv_heads // n  # each rank's module sees its heads only
        mine, wire = (ours_sp, sp_wire) if "Sequence" in name else (ours_tp, tp_wire)

        def peer_step(xp):
            out = call_peer(peer, xp)
            out.sum().backward()
            # DTensor leaves a replicated norm weight's gradient Partial (a pending sum over the sequence shards)
            return out, {k: (g.grad.redistribute(placements=[Replicate()]) if isinstance(g.grad.placements[0], Partial) else g.grad).to_local()
                         for k, g in peer.named_parameters()}
        peer_step(x.clone().requires_grad_())  # once unmeasured: a collective's first use sets up more than its message
        peer.zero_grad(set_to_none=True)
        xp, xo = x.clone().requires_grad_(), x.clone().requires_grad_()
        with CommDebugMode() as comm, DTensorCollectives(n) as issued, WrittenBytes() as peer_wire:
            out_peer, local = peer_step(xp)
        logged = len(wire.log)
        with WrittenBytes() as our_wire:
            out_mine = call_mine(xo)
            out_mine.sum().backward()
            if mine is ours_sp:
                sum_norm_grads(mine, sp_wire)
        peer_flat = torch.cat([local[k + ".weight"].reshape(-1) for k in order])
        mine_flat = torch.cat([p.grad.reshape(-1) for p in mine.parameters() if p.grad is not None])
        counted = {str(k).split(".")[-1]: v for k, v in comm.get_comm_counts().items() if v}
        rows[name] = {"output_error": (out_peer - out_mine).abs().max().item(),
                      "input_grad_error": (xp.grad - xo.grad).abs().max().item(),
                      "weight_grad_error": (peer_flat - mine_flat).abs().max().item(),
                      "dtensor_collectives": counted,
                      "dtensor_issued": issued.rows, "recorder_agrees": issued.counts() == counted,
                      "dtensor_model_bytes": sum(r["model_bytes"] for r in issued.rows),
                      "dtensor_written_bytes": peer_wire.bytes, "dtensor_written_payload": peer_wire.payload,
                      "ours_model_bytes": sum(r["sent_bytes"] for r in wire.log[logged:]),
                      "ours_written_bytes": our_wire.bytes, "ours_written_payload": our_wire.payload}
        mine.zero_grad(set_to_none=True)
    return rows


def pipeline_boundary(reference: TinyDecoder, batch: torch.Tensor, wire) -> dict:
    """Seed 004's other side, run for real: the model cut into two pipeline stages after layer 0, the layer whose
    output tensor parallel all-reduces. Stage 0 (wire rank 0) embeds the batch and runs layer 0; what that layer
    outputs, the (b, s, h) activation, goes to stage 1 (wire rank 1) by our p2p send, the bytes its process wrote
    to the sockets measured (WrittenBytes); stage 1 runs the other layers and the loss on what arrived, so the
    loss equals one process's only if the right activation crossed. Other ranks take no part."""
    inputs, targets = batch[:, :-1], batch[:, 1:]
    tracer = wire.tracer
    out = {"stage": wire.index, "written_payload": None, "loss": None, "shape": list(inputs.shape) + [reference.shape.d_model]}
    with torch.no_grad():
        if wire.index == 0:
            with tracer.span("compute", "PP stage 0: embedding, layer 0", kind="forward"):
                act = torch.stack([reference.blocks[0](reference.embed(seq), 0, None) for seq in inputs])
            with WrittenBytes() as written:
                wire.p2p.exchange(0, "pipeline send", sends=[Transfer(act, 1, [0])])
            out["written_payload"] = written.payload
        elif wire.index == 1:
            act = torch.empty(*out["shape"], dtype=torch.float64)
            wire.p2p.exchange(0, "pipeline send", recvs=[Transfer(act, 0, [0])])
            with tracer.span("compute", "PP stage 1: layers 1.., loss", kind="forward"):
                x = act
                for block in reference.blocks[1:]:
                    x = torch.stack([block(row, 0, None) for row in x])
                logits = reference.head(reference.norm(x))
                out["loss"] = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)).item()
    out["logged_bytes"] = wire.p2p.bytes_sent
    return out
