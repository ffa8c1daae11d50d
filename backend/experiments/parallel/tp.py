"""parallel.tp: tensor parallel and sequence parallel on the tiny LLaMA, against one process and DTensor."""
from __future__ import annotations

import dataclasses
import math
from collections import Counter

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from backend.comm.p2p import Transfer
from backend.comm.sockets import WrittenBytes, gloo_bytes
from backend.config import Config, ConfigError, setting
from backend.limits import cost
from backend.experiments import define
from backend.models.llama import TinyDecoder
from backend.parallel.mesh import start_rank
from backend.parallel.pp.recompute import saved_activations
from backend.parallel.sp import activation_elements, korthikanti_bytes
from backend.parallel.parallelize import expected, parallelize
from backend.parallel.tp import part, sum_norm_grads
from backend.parallel.tp_model import expected_collectives, reference_model, tokens
from backend.comm.collectives import ring_bytes
from backend.parallel.wire import Wire
from backend.result import Check, Result, Schema
from backend.trace import Tracer

TOL = 1e-10
OURS_COLLECTIVES = {  # per layer, fused column-parallel weights; SP's backward re-gathers each gathered input
    "MLP: Colwise, Rowwise": "all_reduce: 1 forward (g), 1 backward (f)",
    "attention: Colwise, Rowwise": "all_reduce: 1 forward (g), 1 backward (f)",
    "block: SequenceParallel norms, Colwise, Rowwise": "forward all_gather 2, reduce_scatter 2; backward all_gather 4 "
                                                      "(2 re-gathers), reduce_scatter 2; norm gradients all_reduce 2"}  # float64: sums regrouped over ranks differ from one process in the last bits only


@dataclasses.dataclass
class TPConfig(Config):
    world_size: int = setting(2, min=2, max=8, help="tensor-parallel ranks t")
    batch: int = setting(2, min=1, max=16, help="sequences b")
    seq: int = setting(16, min=2, max=256, help="tokens per sequence s")
    d_model: int = setting(32, min=4, max=512, help="hidden size h")
    n_heads: int = setting(8, min=1, max=64, help="query heads a")
    n_kv_heads: int = setting(4, min=1, max=64, help="KV heads (GQA: each serves n_heads / n_kv_heads query heads)")
    d_head: int = setting(8, min=2, max=128, help="head dimension (even, for RoPE)")
    d_ff: int = setting(64, min=2, max=2048, help="SwiGLU hidden size")
    vocab: int = setting(64, min=2, max=4096, help="vocabulary (split over the ranks)")
    layers: int = setting(2, min=1, max=8, help="decoder blocks")
    seed: int = setting(0, min=0, max=2**31 - 1, help="weights and tokens")

    cost_drivers = ("d_model", "seq", "batch", "layers", "d_ff", "vocab", "world_size")

    def estimate(self):
        """Every rank runs the whole model besides its shards: the reference (forward, backward and a forward per
        sequence), TP, TP + SP, the model alone, and DTensor's block: about five passes of the whole model each; each
        rank's first DTensor imports torch.distributed.tensor (~2 s of CPU a rank)."""
        return decoder_cost(self, self.world_size, passes=5, seconds=2.0 * self.world_size)  # 5.6 s of CPU at the defaults measured

    @property
    def tp_degree(self) -> tuple[str, int]:
        return "world_size", self.world_size

    # the sizes split over the tensor-parallel ranks (heads, SwiGLU columns, vocabulary; the sequence under SP)
    tp_divided = ("n_heads", "n_kv_heads", "d_ff", "vocab", "d_model", "seq")

    def check(self) -> None:
        name, t = self.tp_degree
        for field in self.tp_divided:
            if getattr(self, field) % t:
                raise ConfigError(field, f"{getattr(self, field)} does not divide by {name}={t}, the tensor-parallel "
                                         f"degree (allowed: a multiple of {t})")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError("n_kv_heads", f"{self.n_kv_heads} does not divide n_heads={self.n_heads} (allowed: a divisor)")
        if self.d_head % 2:
            raise ConfigError("d_head", f"{self.d_head} is odd (allowed: even, RoPE rotates pairs)")


def decoder_cost(c: TPConfig, processes: int, passes: int, seconds: float = 0.0):
    """`processes` processes (the ranks, or the ranks and the leader) each holding the float64 tiny LLaMA of c's shape
    with its gradients and copies, and running `passes` forward-backward passes of it on the whole batch. MoE blocks
    (c.experts > 0) hold experts + 1 feed-forwards, of which each token runs top_k + 1, one Python loop step each."""
    h, L, tokens = c.d_model, c.layers, c.batch * c.seq
    experts = getattr(c, "experts", 0)
    held, active = (experts + 1, c.top_k + 1) if experts else (1, 1)
    attention = h * (c.n_heads + 2 * c.n_kv_heads) * c.d_head + c.n_heads * c.d_head * h
    params = L * (attention + 3 * h * c.d_ff * held + h * experts) + 2 * c.vocab * h
    computed = L * (attention + 3 * h * c.d_ff * active) + 2 * c.vocab * h
    activations = tokens * L * (6 * h + 4 * c.n_heads * c.d_head + 3 * c.d_ff * active) + c.batch * c.n_heads * c.seq ** 2 * L * 3 + tokens * c.vocab * 3
    return cost(data_bytes=processes * (6 * params + 2 * activations) * 8,
                flops=processes * passes * tokens * (6 * computed + 12 * L * c.seq * c.n_heads * c.d_head),
                moved_bytes=processes * passes * activations * 8 * 4, ops=processes * passes * L * (400 + 60 * experts),
                ranks=c.world_size, seconds=seconds)


def _step(reference, config, wire, sp):
    """One forward and backward of rank `wire.index`'s shard; the measurements the checks read."""
    model = parallelize(reference, wire, sp)
    mode, batch = "TP + SP" if sp else "TP", tokens(config)
    with wire.tracer.span("compute", f"{mode} forward", kind="forward"):
        x = model.embed(batch[:, :-1])
        with saved_activations(model.parameters()) as memory:  # the blocks only: the layers the formula counts
            x = model.run_blocks(x)
        loss, logits = model.head_loss(x, batch[:, 1:])
    with wire.tracer.span("compute", f"{mode} backward", kind="backward"):
        loss.backward()
        if sp:
            sum_norm_grads(model, wire)
    grads = {k: p.grad for k, p in model.named_parameters()}
    return model, loss, logits, grads, memory.live


def run_rank(rank, world, config: TPConfig, ctx):
    mesh, tracer = start_rank(rank, world, tp=world)
    reference = reference_model(config)
    batch = tokens(config)
    ref_loss = reference.loss(batch)
    ref_loss.backward()
    ref_grads = {k: p.grad for k, p in reference.named_parameters()}
    with torch.no_grad():
        ref_logits = torch.stack([reference(seq[:-1]) for seq in batch])
    out = {"rank": rank, "modes": {}}
    for i, (mode, sp) in enumerate((("TP", False), ("TP + SP", True))):
        ctx.progress(0.1 + 0.35 * i, f"{mode}: forward and backward")
        wire = Wire.along(mesh, "tp", tracer)
        model, loss, logits, grads, act = _step(reference, config, wire, sp)
        want = expected(model, ref_grads)
        vocab = part(config.vocab, wire.index, wire.n)
        out["modes"][mode] = {
            "loss_error": abs(loss.item() - ref_loss.item()),
            "logits_error": (logits - ref_logits[..., vocab]).abs().max().item(),
            "grad_errors": {k: (g - want[k]).abs().max().item() for k, g in grads.items()},
            "wrong_shard_error": (grads["blocks.0.ffn.down.weight"] - _neighbour_shard(ref_grads, config, wire)).abs().max().item(),
            "log": wire.log, "activation_bytes": act,
            "shards": {k: list(p.shape) for k, p in model.named_parameters()}}
    ctx.progress(0.75, "the pipeline's stage boundary after layer 0")
    out["pp"] = pipeline_boundary(reference, batch, Wire.along(mesh, "tp", tracer))  # on the timeline right after the TP steps
    out["pp"]["loss_error"] = abs(out["pp"]["loss"] - ref_loss.item()) if out["pp"]["loss"] is not None else None
    alone = Wire.alone(rank, Tracer(rank))
    out["activation_bytes_one_rank"] = _step(reference, config, alone, False)[4]
    if world == 2:
        out["worked"], out["worked_errors"] = worked_examples(Wire.along(mesh, "tp", Tracer(rank)))
    ctx.progress(0.8, "DTensor peer")
    peer_tp, peer_sp = Wire.along(mesh, "tp", Tracer(rank)), Wire.along(mesh, "tp", Tracer(rank))
    x = torch.randn(config.batch, config.seq, config.d_model, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    out["dtensor"] = dtensor_peer(reference, parallelize(reference, peer_tp).blocks[0], parallelize(reference, peer_sp, sp=True).blocks[0],
                                  peer_tp, peer_sp, x, world, rank)
    out["trace"] = tracer.payload()
    return out


def _neighbour_shard(ref_grads, config, wire):
    """A deliberately wrong shard: the next rank's columns of the down projection's gradient."""
    return ref_grads["blocks.0.ffn.down.weight"][:, part(config.d_ff, (wire.index + 1) % wire.n, wire.n)]


def numeric_checks(mode: str, ranks: list[dict]) -> list[Check]:
    """One layout's loss, logits and gradient shards against the single-process float64 reference."""
    return [Check(f"{mode}: loss equals one process", max(r["loss_error"] for r in ranks), TOL,
                  reference="the TinyDecoder (backend/models/llama.py), float64, one process"),
            Check(f"{mode}: each rank's logits equal its vocabulary slice of the reference's",
                  max(r["logits_error"] for r in ranks), TOL, reference="single-process logits"),
            Check(f"{mode}: every parameter shard's gradient equals the reference's gradient cut the same way",
                  max(max(r["grad_errors"].values()) for r in ranks), TOL, reference="single-process autograd")]


def bytes_against_model(mode: str, payloads: list[dict], model: list[dict]) -> tuple[list[dict], list[Check]]:
    """Each rank's logged bytes per (phase, op, name) against the ring-volume model; rank 0's rows for the table."""
    key = lambda r: (r["phase"], r["op"], r["name"])  # noqa: E731
    predicted = {}
    for r in model:
        predicted[key(r)] = predicted.get(key(r), 0) + r["sent_bytes"]
    rows, checks = [], []
    for p in payloads:
        got = p["modes"][mode]["log"]
        measured = {}
        for r in got:
            measured[key(r)] = measured.get(key(r), 0) + r["sent_bytes"]
        if p["rank"] == 0:
            rows += [{"mode": mode, "phase": k[0], "op": k[1], "name": k[2], "calls": sum(key(r) == k for r in got),
                      "sent_bytes": v, "model_bytes": predicted.get(k)} for k, v in measured.items()]
        diff = sum(abs(measured.get(k, 0) - predicted.get(k, 0)) for k in set(measured) | set(predicted))
        checks.append(Check(f"{mode}: bytes rank {p['rank']} sent, collective by collective, equal the model", diff, 0,
                            reference="ring volumes: all-reduce 2(t-1)/t, reduce-scatter (t-1)/t of the tensor, "
                                      "all-gather (t-1) x the shard; one all-reduce of b*s*h per layer forward (g), one backward (f)"))
    return rows, checks


def memory_row(config: TPConfig, layout: str, rank: int, measured: int, t: int, sp: bool) -> dict:
    """Measured activation bytes beside Korthikanti's accounting of this block (float64, + RoPE's cos and sin tables,
    shared by the layers) and the paper's GPT-block figure."""
    b, s, h = config.batch, config.seq, config.d_model
    formula = sum(activation_elements(b, s, h, config.n_heads, config.n_heads * config.d_head, config.d_ff, t, sp).values())
    return {"layout": layout, "rank": rank, "measured_bytes": measured, "formula_bytes": config.layers * formula * 8 + s * config.d_head * 8,
            "paper_gpt_block_bytes": config.layers * korthikanti_bytes(b, s, h, config.n_heads, t, sp)}


def mode_metrics(config: TPConfig, mode: str, model: list[dict], ranks: list[dict]) -> dict:
    """One layout's predicted bytes per layer and per step, and the error a wrong shard's gradient would have."""
    per_layer = [r for r in model if r["name"] == "mlp" and r["phase"] == "forward"]
    metrics = {f"{mode} MLP forward bytes per rank per layer": sum(r["sent_bytes"] for r in per_layer) // config.layers}
    for phase in ("forward", "backward"):
        metrics[f"{mode} {phase} bytes per rank per step"] = sum(r["sent_bytes"] for r in model if r["phase"] == phase)
    metrics[f"{mode} wrong-shard gradient error"] = max(r["wrong_shard_error"] for r in ranks)
    return metrics


def measure_mode(config: TPConfig, payloads: list[dict], mode: str, sp: bool) -> tuple[list[Check], dict, list, list]:
    """One layout (TP, or TP + SP): its numeric checks, bytes per collective against the model, activation memory
    against the formula. Returns (checks, metrics, collective rows, memory rows)."""
    n, ranks = config.world_size, [p["modes"][mode] for p in payloads]
    model = expected_collectives(config, n, sp)
    collectives, byte_checks = bytes_against_model(mode, payloads, model)
    memory = [memory_row(config, f"{mode}, t={n}", p["rank"], p["modes"][mode]["activation_bytes"], n, sp) for p in payloads]
    memory_check = Check(f"{mode}: activation memory per rank within 10 % of the formula",
                         max(abs(m["measured_bytes"] / m["formula_bytes"] - 1) for m in memory), 0.10,
                         reference="Korthikanti et al.'s accounting applied to this block (sp.activation_elements)")
    return numeric_checks(mode, ranks) + byte_checks + [memory_check], mode_metrics(config, mode, model, ranks), collectives, memory


def seed_examples(payloads: list[dict]) -> tuple[list[Check], dict, list[str], list[dict]]:
    """Seed 000's and 002's 2x2 examples (run at t = 2): column and row splits give X W; tanh commutes with the column
    split only. Returns (checks, metrics, notes, table rows); nothing at other t."""
    if "worked" not in payloads[0]:
        return [], {}, [], []
    e = payloads[0]["worked_errors"]
    checks = [Check("seed 000 worked examples: column and row splits give X W", max(e["column_error"], e["row_error"]), 0,
                    reference="X W in one process"),
              Check("seed 002: tanh on column shards before the gather equals tanh(X W)", e["column_activation_error"], 0,
                    reference="tanh(X W)")]
    note = (f"Seed 002: a row split cannot apply the activation before the sum: tanh(Y_0) + tanh(Y_1) misses "
            f"tanh(Y_0 + Y_1) by {e['row_activation_error']:.3f} here, so Megatron puts the column split first.")
    return (checks, {ROW_SPLIT: e["row_activation_error"]}, [note],
            [row for p in payloads for row in p["worked"]])


def dtensor_tables(payloads: list[dict]) -> dict:
    """DTensor's parallelize_module beside our layers, per layer (errors, collectives, bytes), and every call it issued."""
    peer = payloads[0]["dtensor"]
    return {"dtensor": [{"layer": k, "output_error": row["output_error"], "input_grad_error": row["input_grad_error"],
                         "weight_grad_error": row["weight_grad_error"],
                         "dtensor_collectives": ", ".join(f"{op} {c}" for op, c in row["dtensor_collectives"].items()),
                         "ours_collectives": OURS_COLLECTIVES[k],
                         "dtensor_bytes_model": row["dtensor_model_bytes"], "dtensor_bytes_written": row["dtensor_written_payload"],
                         "ours_bytes_model": row["ours_model_bytes"], "ours_bytes_written": row["ours_written_payload"]}
                        for k, row in peer.items()],
            "dtensor_collectives": [{"layer": k, "rank": p["rank"], "call": i, **c} for p in payloads
                                    for k, row in p["dtensor"].items() for i, c in enumerate(row["dtensor_issued"])]}


def dtensor_bytes_checks(payloads: list[dict]) -> tuple[list[Check], list[str]]:
    """DTensor's collectives as our recorder saw them against CommDebugMode, and the bytes each rank wrote to its
    sockets (DTensor's and ours) against the volumes logged; a note where /proc/self/io is missing."""
    rows = [row for p in payloads for row in p["dtensor"].values()]
    checks = [Check("DTensor's collectives as our recorder saw them agree with CommDebugMode's counts",
                    sum(not r["recorder_agrees"] for r in rows), 0, reference="torch.distributed.tensor.debug.CommDebugMode")]
    if not all(r["dtensor_written_payload"] is not None and r["ours_written_payload"] is not None for r in rows):
        return checks, ["Bytes written were not measured: this system has no /proc/self/io."]
    checks.append(Check("DTensor: bytes each rank wrote to its sockets equal gloo's volumes for the collectives it issued",
                        max(abs(r["dtensor_written_payload"] - r["dtensor_model_bytes"]) for r in rows), 0,
                        reference="/proc/self/io (write calls x gloo's 48 B preamble taken off); ring all-reduce "
                                  "2(t-1)/t, all-gather (t-1) x input; gloo's reduce-scatter moves an all-reduce's volume"))
    checks.append(Check("ours: bytes each rank wrote to its sockets equal our wire log, layer by layer",
                        max(abs(r["ours_written_payload"] - r["ours_model_bytes"]) for r in rows), 0,
                        reference="/proc/self/io against the bytes our collectives logged"))
    return checks, []


def dtensor_peer_checks(peer: dict) -> list[Check]:
    """DTensor's layers equal ours (outputs and gradients), and issue one all-reduce per column-parallel module."""
    # DTensor all-reduces the input gradient once per ColwiseParallel module (gate, up; wq, wk, wv); ours fuses
    # the column-parallel weights that read one input (as Megatron fuses QKV), so it all-reduces once
    columns = {"MLP: Colwise, Rowwise": 2, "attention: Colwise, Rowwise": 3}
    return [Check("DTensor parallelize_module (Colwise, Rowwise, SequenceParallel) equals our layers: outputs and gradients",
                  max(max(r["output_error"], r["input_grad_error"], r["weight_grad_error"]) for r in peer.values()), TOL,
                  reference="torch.distributed.tensor.parallel on the same weights"),
            Check("DTensor's collectives: one all-reduce forward, one backward per column-parallel module",
                  max(abs(peer[k]["dtensor_collectives"].get("all_reduce", 0) - 1 - c) for k, c in columns.items()), 0,
                  reference="CommDebugMode's counts", detail="ours: one forward, one backward per layer (fused)")]


def dtensor_note(peer: dict, metrics: dict) -> str:
    """Why DTensor's bytes differ from ours: unfused column-parallel all-reduces, gloo's reduce-scatter, kept inputs."""
    sp_block = peer["block: SequenceParallel norms, Colwise, Rowwise"]
    return ("DTensor against ours, bytes: DTensor all-reduces the input gradient of each ColwiseParallel module "
            "separately (gate and up; wq, wk and wv), where ours fuses the column-parallel weights that read one input "
            f"and all-reduces once (MLP {metrics['DTensor / ours bytes, MLP: Colwise, Rowwise']:g}x, attention "
            f"{metrics['DTensor / ours bytes, attention: Colwise, Rowwise']:g}x our bytes). With sequence parallel "
            f"({sp_block['dtensor_model_bytes']:,} B against {sp_block['ours_model_bytes']:,} B) two things pull opposite "
            "ways: gloo has no reduce-scatter of its own (it all-reduces the whole tensor and keeps a slice, twice a "
            "ring reduce-scatter's bytes), while DTensor keeps each gathered input for the weight gradient instead of "
            "gathering it again in backward as ours does (fewer bytes, more memory).")


def tp_against_pp(config: TPConfig, payloads: list[dict]) -> tuple[list[dict], list[Check], str]:
    """Seed 004: TP's all-reduce of a layer's M x K output (2(t-1)MK in all) against the pipeline's one send of MK,
    measured at the stage boundary; the activation that crossed it must carry on to the reference's loss."""
    n, mk = config.world_size, config.batch * config.seq * config.d_model
    tp_ar = ring_bytes("all_reduce", mk, n, 8)
    stage0, stage1 = payloads[0]["pp"], payloads[1]["pp"]
    table = [
        {"strategy": "TP: all-reduce of the layer's M x K output", "bytes per rank": tp_ar, "bytes, all ranks": tp_ar * n,
         "in units of MK": tp_ar * n / (mk * 8), "socket bytes, rank 0": None},
        {"strategy": f"PP: stage 0 sends layer 0's output ({' x '.join(map(str, stage0['shape']))}) to stage 1",
         "bytes per rank": stage0["logged_bytes"], "bytes, all ranks": stage0["logged_bytes"],
         "in units of MK": stage0["logged_bytes"] / (mk * 8), "socket bytes, rank 0": stage0["written_payload"]}]
    checks = [Check("seed 004: the pipeline send of layer 0's output moves MK", abs(stage0["logged_bytes"] - mk * 8), 0,
                    reference="M x K float64 elements (M = b·s, K = h)")]
    if stage0["written_payload"] is not None:
        checks.append(Check("seed 004: the bytes stage 0 wrote to its socket for that send are MK", abs(stage0["written_payload"] - mk * 8), 0,
                            reference="/proc/self/io (write calls x gloo's 48 B preamble taken off)"))
    checks.append(Check("the activation that crossed the stage boundary carries on: stage 1's loss equals one process's",
                        stage1["loss_error"], TOL, reference="the whole TinyDecoder in one process"))
    note = (f"Seed 004's 2MK: a ring all-reduce sends 2(t-1)/t MK per rank, 2(t-1)MK in all: "
            f"{tp_ar * n / (mk * 8):g} MK at t={n}, against MK for the pipeline's send of the same output.")
    return table, checks, note


def closing_notes(metrics: dict) -> list[str]:
    """What sequence parallel costs in backward bytes, and how this block's activation accounting differs from the paper's."""
    return ["Sequence parallel moves the same bytes as tensor parallel in forward (an all-gather plus a reduce-scatter "
            "is an all-reduce). In backward it moves more: "
            f"{metrics['TP + SP backward bytes per rank per step']:,} B against {metrics['TP backward bytes per rank per step']:,} B "
            "per rank here, because each column-parallel linear gathers its input again to form its weight gradient "
            "(it kept only its sequence shard: the memory SP saves), and the replicated norm weights' gradients are summed.",
            "Activation memory: this block saves three tensors per RMSNorm (it is written as elementwise ops, where the "
            "paper assumes a fused LayerNorm saving its input), has no dropout masks, and SwiGLU keeps 4 x d_ff per "
            "token where GPT's GELU MLP keeps 4h + 4h + h; the paper's GPT-block figure (fp16) is shown beside ours."]


def combine(config: TPConfig, payloads) -> Result:
    """measure -> check -> describe: each layout (TP, TP + SP) against one process and the byte and memory models, one
    rank's memory, the seed's worked examples, DTensor as the peer, and TP's all-reduce beside the pipeline's send."""
    checks, metrics, collectives, memory = [], {"world_size": config.world_size}, [], []
    for mode, sp in (("TP", False), ("TP + SP", True)):
        more_checks, more_metrics, more_collectives, more_memory = measure_mode(config, payloads, mode, sp)
        checks, collectives, memory = checks + more_checks, collectives + more_collectives, memory + more_memory
        metrics.update(more_metrics)
    memory.append(memory_row(config, "one rank, t=1", 0, payloads[0]["activation_bytes_one_rank"], 1, False))
    checks.append(Check("one rank: activation memory within 10 % of the formula",
                        abs(memory[-1]["measured_bytes"] / memory[-1]["formula_bytes"] - 1), 0.10, reference="same formula, t = 1"))
    tables = {"collectives": collectives, "memory": memory,
              "shards": [{"rank": p["rank"], "parameter": k, "shape": " x ".join(map(str, v)), "elements": math.prod(v)}
                         for p in payloads for k, v in p["modes"]["TP"]["shards"].items()]}
    worked_checks, worked_metrics, notes, worked_rows = seed_examples(payloads)
    if worked_rows:
        tables["worked_examples"] = worked_rows
    checks += worked_checks
    metrics.update(worked_metrics)
    peer = payloads[0]["dtensor"]
    tables.update(dtensor_tables(payloads))
    byte_checks, byte_notes = dtensor_bytes_checks(payloads)
    checks, notes = checks + byte_checks + dtensor_peer_checks(peer), notes + byte_notes
    metrics.update({f"DTensor / ours bytes, {k}": row["dtensor_model_bytes"] / row["ours_model_bytes"] for k, row in peer.items()})
    tables["tp_vs_pp"], pp_checks, pp_note = tp_against_pp(config, payloads)
    checks += pp_checks
    notes += [dtensor_note(peer, metrics), pp_note] + closing_notes(metrics)
    return Result(metrics=metrics, checks=checks, tables=tables, notes=notes,
                  trace_events=[e for p in payloads for e in p["trace"]["events"]])


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
        return dict(Counter(torch_name[r["op"]] for r in self.rows))


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


def worked_examples(wire) -> tuple[list[dict], dict]:
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


ROW_SPLIT = "row split: error of summing tanh of partial sums"  # the seed's 2 x 2 worked examples: world_size 2 only
RESULT = Schema(
    metrics=("world_size", *(f"{mode} {what}" for mode in ("TP", "TP + SP") for what in (
                 "MLP forward bytes per rank per layer", "forward bytes per rank per step", "backward bytes per rank per step",
                 "wrong-shard gradient error")),
             *(f"DTensor / ours bytes, {k}" for k in ("MLP: Colwise, Rowwise", "attention: Colwise, Rowwise",
                                                     "block: SequenceParallel norms, Colwise, Rowwise")), ROW_SPLIT),
    tables={"collectives": ("mode", "name", "op", "phase", "calls", "model_bytes", "sent_bytes"),
            "memory": ("layout", "rank", "measured_bytes", "formula_bytes", "paper_gpt_block_bytes"),
            "shards": ("rank", "parameter", "shape", "elements"),
            "worked_examples": ("example", "rank", "step", "X", "X_r", "W_r", "Y", "Y_r"),
            "dtensor": ("layer", "output_error", "input_grad_error", "weight_grad_error", "dtensor_collectives", "ours_collectives",
                        "dtensor_bytes_model", "dtensor_bytes_written", "ours_bytes_model", "ours_bytes_written"),
            "dtensor_collectives": ("layer", "rank", "call", "op", "numel", "model_bytes"),
            "tp_vs_pp": ("strategy", "bytes per rank", "bytes, all ranks", "in units of MK", "socket bytes, rank 0")},
    optional=(ROW_SPLIT, "worked_examples"),
)

EXPERIMENT = define(__name__, TPConfig, "tensor and sequence parallel on the tiny LLaMA: shards, f/g collectives with bytes, "
                    "activation memory vs Korthikanti, the seed's 2x2 examples, DTensor as the peer",
                    rank_fn=run_rank, combine=combine, lanes=("compute", "collective", "comm"),
                    preload=("torch.distributed.tensor.parallel",), schema=RESULT)
