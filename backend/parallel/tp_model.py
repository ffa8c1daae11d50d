"""What tensor and sequence parallel should do, predicted without running them: the seed's 2x2 worked
examples, every collective of one training step with its bytes, and seed 004's 2MK against MK.

The reference for all of it is the single-process TinyDecoder (backend/models/llama.py) in float64.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from backend.comm.p2p import Transfer
from backend.models.llama import ModelShape, TinyDecoder
from backend.parallel.tp import sum_norm_grads
from backend.parallel.wire import WrittenBytes, gloo_bytes, ring_bytes


def reference_model(config) -> TinyDecoder:
    torch.manual_seed(config.seed)
    shape = ModelShape(vocab=config.vocab, d_model=config.d_model, n_layers=config.layers, n_heads=config.n_heads,
                       n_kv_heads=config.n_kv_heads, d_head=config.d_head, d_ff=config.d_ff, variant="gqa",
                       n_experts=getattr(config, "experts", 0), top_k=getattr(config, "top_k", 2))
    return TinyDecoder(shape).double()


def tokens(config) -> torch.Tensor:
    g = torch.Generator().manual_seed(config.seed * 7919)
    return torch.randint(0, config.vocab, (config.batch, config.seq + 1), generator=g)


def expected_collectives(config, n: int, sp: bool, *, batch: int | None = None, seq: int | None = None,
                         layers: int | None = None, first: bool = True, last: bool = True, index: int = 0,
                         dense_ffn: bool = True, item: int = 8, loss_item: int | None = None) -> list[dict]:
    """Every collective of one forward and backward on rank `index` of n: (phase, op, name, numel, sent_bytes), in
    the order run. By default the whole model on config's batch; a pipeline stage gives its `layers`, whether it is
    the `first` (embedding) and `last` (head, loss), and its micro-batch's `batch` and (context-parallel) `seq`.
    Without `dense_ffn` (MoE blocks: run alike on every tp rank, or under SP each on its sequence shard) the MLP's
    collectives are absent; the norm-gradient rows count the norms only (an MoE layer's gradients are summed too).
    `item`: bytes per element of the activations (8: float64; the mesh's compute dtype); `loss_item`: of the cross
    entropy's (at least fp32: models.llama.at_least_fp32), item if not given."""
    b, s, L = batch or config.batch, seq or config.seq, config.layers if layers is None else layers
    nh, tokens_, h = b * s * config.d_model, b * s, config.d_model
    rows = []

    def add(phase, op, name, numel):
        rows.append({"phase": phase, "op": op, "name": name, "numel": numel})
    if sp:
        if first:
            add("forward", "reduce_scatter", "embedding", nh)
        for _ in range(L):
            for name in ("attention", "mlp") if dense_ffn else ("attention",):
                add("forward", "all_gather", name, nh // n)
                add("forward", "reduce_scatter", name, nh)
        if last:
            add("forward", "all_gather", "head", nh // n)
    else:
        if first:
            add("forward", "all_reduce", "embedding", nh)
        for _ in range(L):
            add("forward", "all_reduce", "attention", nh)
            if dense_ffn:
                add("forward", "all_reduce", "mlp", nh)
    if last:
        add("forward", "all_gather", "cross entropy: max", tokens_)
        add("forward", "all_reduce", "cross entropy: target logit", tokens_)
        add("forward", "all_reduce", "cross entropy: sum of exp", tokens_)
    for name in ["head"] * last + (["mlp", "attention"] if dense_ffn else ["attention"]) * L:
        if sp:
            if name != "head":
                add("backward", "all_gather", name, nh // n)  # g' backward
            add("backward", "all_gather", f"{name} (re-gather)", nh // n)
            add("backward", "reduce_scatter", name, nh)
        else:
            add("backward", "all_reduce", name, nh)
    if sp:
        if first:
            add("backward", "all_gather", "embedding", nh // n)
        for _ in range(2 * L + last):
            add("backward", "all_reduce", "norm weight gradients", h)
    for r in rows:
        size = (loss_item or item) if r["name"].startswith("cross entropy") else item
        r["sent_bytes"] = ring_bytes(r["op"], r["numel"], n, size, index)
    return rows


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


def worked_examples(wire) -> list[dict]:
    """Seed 000's two 2x2 examples on 2 ranks, every step recorded: Y = XW split by columns of W (each rank
    computes its column of Y, then the columns are gathered) and by rows of W with X by columns (each rank
    computes a whole 2x2 partial product, then they are summed). Also seed 002's point: tanh applies to a
    column shard before communication, but not to a row shard's partial sum."""
    X = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=torch.float64)
    W = torch.tensor([[5.0, 6.0], [7.0, 8.0]], dtype=torch.float64)
    r = wire.index
    steps = []

    def log(example, step, **tensors):
        steps.append({"example": example, "rank": r, "step": step, **{k: v.tolist() for k, v in tensors.items()}})
    W_r = W[:, r:r + 1]
    Y_r = X @ W_r
    log("column", "hold X and W's column r", X=X, W_r=W_r)
    log("column", "Y_r = X W_r (no communication)", Y_r=Y_r)
    Y = wire.all_gather(Y_r, 1, "forward", "worked example: column").clone()
    log("column", "all-gather: Y = [Y_0 Y_1]", Y=Y)
    act_col = wire.all_gather(torch.tanh(Y_r), 1, "forward", "worked example: column tanh")
    X_r, W_row = X[:, r:r + 1], W[r:r + 1, :]
    Y_part = X_r @ W_row
    log("row", "hold X's column r and W's row r", X_r=X_r, W_r=W_row)
    log("row", "Y_r = X_r W_r, a 2x2 partial product (outer product)", Y_r=Y_part)
    Y_row = wire.all_reduce(Y_part, "forward", "worked example: row")
    log("row", "all-reduce: Y = Y_0 + Y_1", Y=Y_row)
    act_row = wire.all_reduce(torch.tanh(Y_part), "forward", "worked example: row tanh")
    exact = X @ W
    return steps, {"column_error": (Y - exact).abs().max().item(), "row_error": (Y_row - exact).abs().max().item(),
                   "column_activation_error": (act_col - torch.tanh(exact)).abs().max().item(),
                   "row_activation_error": (act_row - torch.tanh(exact)).abs().max().item()}


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
