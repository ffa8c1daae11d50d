"""Sequence parallel beside context parallel and beside MoE on the mesh (issue #27), and the one token split (#32).

SP + CP: Megatron-SP's all-gather / reduce-scatter over tp act on the sequence that is already this rank's cp shard
(zigzag); the ring attention runs on the gathered shard's tp-local heads. SP + EP: each tp rank's sequence shard enters
the MoE layer, its tokens routed by all-to-all over ep; the MoE weights, trained by that shard alone, are summed over tp.
Each run is checked against one float64 process (loss, parameters), the byte model per dimension, the MoE routing and
the memory model; each check is then shown failing under a broken rule: a scatter that hands each tp rank the wrong
share, a gather that keeps the gathered input instead of re-gathering it, MoE gradients left unsummed over tp, a token
split that routes the whole cp shard, and a memory formula that forgets SP's split of the norms."""
import contextlib
import dataclasses
import itertools
import math
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

from backend.experiments.parallel import mesh
from backend.experiments.parallel.mesh import MeshConfig
from backend.parallel import mesh_train
from backend.parallel import sp as sp_module
from backend.parallel import token_split as split_module
from backend.parallel.mesh import DIMS, DeviceMesh
from backend.parallel.token_split import TokenSplit, token_split
from tests.mesh_runs import checks as _checks, run_plans

WORLD = 4
BASE = dict(world_size=WORLD, seq=8, d_model=16, n_heads=8, d_head=4, d_ff=16, vocab=16, steps=2, batch=8, layers=2,
            pp=1, tp=2, sp=True, microbatches=2)
SP_CP = MeshConfig(**BASE, cp=2)
SP_EP = MeshConfig(**BASE, ep=2, experts=4)
SP_CP_MOE = MeshConfig(**BASE, cp=2, experts=4, n_kv_heads=2)  # GQA too


# ---- broken rules, applied inside the ranks --------------------------------------------------------------------------

def _shifted_scatter(ctx, x, wire, name):
    """g' handing tp rank t the share of rank t+1 (the sum is right, the share is not)."""
    ctx.wire, ctx.name = wire, name
    return wire.reduce_scatter(x.roll(-(x.shape[sp_module.SEQ] // wire.n), sp_module.SEQ), sp_module.SEQ, "forward", name)


def _keep_gathered(ctx, x_local, weight, wire, name):
    """A gathering linear that saves the whole gathered input for its weight gradient (no re-gather in backward)."""
    ctx.wire, ctx.name = wire, name
    full = wire.all_gather(x_local, sp_module.SEQ, "forward", name)
    ctx.save_for_backward(full, weight)
    return F.linear(full, weight)


def _from_kept(ctx, grad):
    full, weight = ctx.saved_tensors
    grad_weight = grad.reshape(-1, grad.shape[-1]).T @ full.reshape(-1, full.shape[-1])
    return ctx.wire.reduce_scatter(grad @ weight, sp_module.SEQ, "backward", ctx.name), grad_weight, None, None


def _norms_only(module, wire):
    """SP's gradient sum over tp as for a dense model: the norm weights (1-D) only, the MoE layers' left unsummed."""
    for p in module.parameters():
        if getattr(p, "sequence_parallel", False) and p.grad is not None and p.dim() == 1:
            p.grad = wire.all_reduce(p.grad, "backward", "norm weight gradients")


BROKEN = {  # name: the (object, attribute, replacement) patched for the run
    "none": [],
    "shifted scatter": [(sp_module.ReduceScatterToSP, "forward", staticmethod(_shifted_scatter))],
    "no re-gather": [(sp_module.GatherLinear, "forward", staticmethod(_keep_gathered)),
                     (sp_module.GatherLinear, "backward", staticmethod(_from_kept))],
    "MoE gradients unsummed": [(mesh_train, "sum_norm_grads", _norms_only)],
}


def _patched(broken: str) -> contextlib.ExitStack:
    stack = contextlib.ExitStack()
    for target, name, value in BROKEN[broken]:
        stack.enter_context(mock.patch.object(target, name, value))
    return stack


JOBS = [(SP_CP, "none"), (SP_EP, "none"), (SP_CP_MOE, "none"),
        (SP_CP, "shifted scatter"), (SP_CP, "no re-gather"), (SP_EP, "MoE gradients unsummed")]


@pytest.fixture(scope="module")
def runs():
    payloads = run_plans(JOBS, WORLD, patch=_patched, timeout_s=600)
    return {(id(cfg), broken): p for (cfg, broken), p in zip(JOBS, payloads)}


def _failed(checks: dict) -> set[str]:
    """Which kinds of check failed: loss/parameters, bytes, routing, activations."""
    kinds = {"final parameters": "parameters", "every step's loss": "loss", "bytes equal the model": "bytes",
             "every MoE call routed": "routing", "activations held": "activations"}
    return {kind for name, c in checks.items() if not c.passed for key, kind in kinds.items() if key in name}


@pytest.mark.parametrize("cfg", [SP_CP, SP_EP, SP_CP_MOE], ids=["sp+cp", "sp+ep", "sp+cp+moe"])
def test_sp_beside_cp_and_moe_equals_one_process_and_every_model(runs, cfg):
    checks = _checks(cfg, runs[id(cfg), "none"])
    assert all(c.passed for c in checks.values()), [(n, c.error) for n, c in checks.items() if not c.passed]
    assert checks["final parameters: every rank's shard equals one process on the whole batch"].error < 1e-9
    assert sum(n.endswith("bytes equal the model") for n in checks) == WORLD
    assert ("every MoE call routed each expert the assignments the reference routed those tokens" in checks) == bool(cfg.experts)


def test_sp_sends_the_norm_and_moe_gradients_over_tp_and_routes_only_its_shard(runs):
    """What SP adds around an MoE layer, read off the run: each tp rank routes half the tokens the ep slice holds (its
    sequence shard), and its tp bytes include one all-reduce per MoE weight, per step."""
    payloads = runs[id(SP_EP), "none"]
    for p in payloads:
        first = p["moe"][0]
        assert first["tokens"] == BASE["batch"] // (SP_EP.dp * SP_EP.ep * SP_EP.microbatches) * BASE["seq"] // SP_EP.tp
    norms = mesh.sequence_parallel_numels(dataclasses.replace(SP_EP, experts=0), BASE["layers"], True)
    with_moe = mesh.sequence_parallel_numels(SP_EP, BASE["layers"], True)
    h, f, e = SP_EP.d_model, SP_EP.d_ff, SP_EP.experts
    assert sum(with_moe) - sum(norms) == BASE["layers"] * (e * h + 3 * h * f * (e // SP_EP.ep + 1))


def test_a_scatter_to_the_wrong_share_fails_the_loss_and_parameter_checks(runs):
    assert {"loss", "parameters"} <= _failed(_checks(SP_CP, runs[id(SP_CP), "shifted scatter"]))


def test_a_gather_kept_instead_of_regathered_fails_the_byte_check(runs):
    """Right numbers (loss and parameters pass), one all-gather fewer per gathering linear in backward."""
    failed = _failed(_checks(SP_CP, runs[id(SP_CP), "no re-gather"]))
    assert "bytes" in failed and not {"loss", "parameters"} & failed


def test_moe_gradients_unsummed_over_tp_fail_the_parameter_and_byte_checks(runs):
    assert {"parameters", "bytes"} <= _failed(_checks(SP_EP, runs[id(SP_EP), "MoE gradients unsummed"]))


def test_a_byte_model_without_the_moe_gradients_fails(runs, monkeypatch):
    right = mesh.sequence_parallel_numels
    monkeypatch.setattr(mesh, "sequence_parallel_numels",
                        lambda cfg, layers, last: right(dataclasses.replace(cfg, experts=0), layers, last))
    assert _failed(_checks(SP_EP, runs[id(SP_EP), "none"])) == {"bytes"}


def test_a_memory_formula_without_sps_norm_split_fails(runs, monkeypatch):
    right = mesh.activation_elements
    monkeypatch.setattr(mesh, "activation_elements", lambda *a, **k: right(*a[:7], False, *a[8:], **k))
    assert _failed(_checks(SP_CP, runs[id(SP_CP), "none"])) == {"activations"}


@pytest.mark.parametrize("wrong", ["whole cp shard", "other tp share"])
def test_a_token_split_routing_the_wrong_tokens_fails_the_routing_check(runs, monkeypatch, wrong):
    """The experiment reads the same token split mesh_train feeds the ranks; a split that says each tp rank routes its
    whole cp shard (as without SP), or the other tp rank's share, disagrees with what the ranks routed."""
    right = mesh.split_of

    def split_of(config, coords):
        s = right(config, coords)
        other = right(config, {**coords, "tp": 1 - coords["tp"]})
        return TokenSplit(s.sequences, s.positions, s.positions if wrong == "whole cp shard" else other.sp_positions)
    monkeypatch.setattr(mesh, "split_of", split_of)
    assert "routing" in _failed(_checks(SP_CP_MOE, runs[id(SP_CP_MOE), "none"]))


# ---- the one token split against a derivation by hand ----------------------------------------------------------------

def _by_hand(batch, seq, m, sizes, coords, sp):
    """numpy.array_split's slices (the first n % k one longer) of the batch over dp x ep (dp outer), then into m
    micro-batches; zigzag: 2cp equal chunks, cp rank r holding chunks r and 2cp-1-r; SP: tp equal contiguous shares."""
    def slices(items, k):
        n, out, start = len(items), [], 0
        for i in range(k):
            size = n // k + (i < n % k)
            out.append(items[start:start + size])
            start += size
        return out
    mine = slices(list(range(batch)), sizes["dp"] * sizes["ep"])[coords["dp"] * sizes["ep"] + coords["ep"]]
    n, r = sizes["cp"], coords["cp"]
    c = seq // (2 * n)
    chunks = [list(range(i * c, (i + 1) * c)) for i in range(2 * n)]
    held = chunks[r] + chunks[2 * n - 1 - r] if n > 1 else list(range(seq))
    share = len(held) // sizes["tp"]
    return slices(mine, m), held, held[coords["tp"] * share:(coords["tp"] + 1) * share] if sp else held


MESHES = [dict(dp=2, ep=1, cp=2, tp=2), dict(dp=1, ep=2, cp=1, tp=2), dict(dp=3, ep=2, cp=1, tp=1),
          dict(dp=1, ep=1, cp=4, tp=2), dict(dp=2, ep=2, cp=2, tp=1)]


def _disagreements(batch=13, seq=16, m=3) -> int:
    wrong = 0
    for sizes, sp in itertools.product(MESHES, (False, True)):
        if sp and sizes["tp"] == 1:
            continue
        shape = {**{d: 1 for d in DIMS}, **sizes}
        for rank in range(math.prod(shape.values())):
            coords = DeviceMesh.coords(rank, shape)
            got = token_split(batch, seq, m, shape, coords, sp)
            seqs, held, sp_held = _by_hand(batch, seq, m, shape, coords, sp)
            wrong += ([s.tolist() for s in got.sequences] != seqs) + (got.positions.tolist() != held) + \
                (got.sp_positions.tolist() != sp_held)
    return wrong


def test_the_token_split_equals_a_derivation_by_hand_and_covers_every_token():
    assert _disagreements() == 0
    # every (sequence, position) once over dp x ep x cp x tp under SP, and causal work equal over the cp ranks (zigzag)
    shape = {**{d: 1 for d in DIMS}, "dp": 2, "cp": 2, "tp": 2}
    held = []
    for rank in range(8):
        s = token_split(6, 8, 2, shape, DeviceMesh.coords(rank, shape), True)
        held += [(q, p) for mb in s.sequences for q in mb.tolist() for p in s.sp_positions.tolist()]
    assert sorted(held) == [(q, p) for q in range(6) for p in range(8)]
    work = [sum(p + 1 for p in token_split(1, 16, 1, {"cp": 4}, {"cp": r}).positions.tolist()) for r in range(4)]
    assert len(set(work)) == 1


def test_a_contiguous_cp_split_disagrees_with_the_derivation(monkeypatch):
    monkeypatch.setattr(split_module, "cp_positions", lambda seq, i, n, split: torch.arange(i * seq // n, (i + 1) * seq // n))
    assert _disagreements() > 0


def test_sp_beside_cp_needs_each_cp_shard_to_split_over_tp():
    """seq 12 holds cp 2's four zigzag chunks, but each cp shard's 6 positions do not split over tp 4: refused by name
    with the unit allowed (lcm(2cp, cp x tp) = 8); seq 16 runs the same mesh's validation."""
    from backend.config import ConfigError
    with pytest.raises(ConfigError) as info:
        MeshConfig(**dict(BASE, world_size=8, cp=2, tp=4, seq=12)).validate()
    assert info.value.field == "seq" and "a multiple of 8" in str(info.value)
    MeshConfig(**dict(BASE, world_size=8, cp=2, tp=4, seq=16)).validate()
