"""Precision in the mesh run: fp32 and bf16 mixed precision (bf16 compute, fp32 master weights, Adam states and gradient
sums) trained on the mesh, checked against one process running the same recipe and against float64; bytes per
dimension and memory per category exact at each dtype's item size. Each check fails when the recipe is broken inside
the ranks: the master copy taken away (Adam steps the bf16 weights), or the gradients summed in bf16."""
import contextlib

import pytest
import torch

from backend.config import ConfigError
from backend.experiments.parallel import mesh
from backend.experiments.parallel.mesh import MeshConfig
from backend.parallel import mesh_train
from backend.numerics.mixed_precision import DynamicLossScaler
from backend.parallel.precision import PRECISIONS, Precision
from tests.mesh_runs import checks as _checks, failures, run_plans

BASE = dict(world_size=4, batch=8, seq=8, d_model=16, n_heads=8, n_kv_heads=4, d_head=4, d_ff=16, vocab=16, layers=4, steps=3)
# Broken recipes, applied inside the ranks only (the check's side keeps the real one)
BROKEN = {"no master copy": Precision(torch.bfloat16, torch.bfloat16, torch.float32),
          "bf16 gradient sums": Precision(torch.bfloat16, torch.float32, torch.bfloat16)}


class NoBackoff(DynamicLossScaler):
    """A scaler that keeps its scale after an overflow (the step is still skipped)."""

    def update(self, found_inf: bool) -> None:
        super().update(False)


@contextlib.contextmanager
def _recipe(broken: str | None):
    if broken is None:
        yield
        return
    saved, scaler = dict(mesh_train.PRECISIONS), mesh_train.DynamicLossScaler
    if broken == "no backoff":
        mesh_train.DynamicLossScaler = NoBackoff
    else:
        mesh_train.PRECISIONS["bf16_mixed"] = BROKEN[broken]
    try:
        yield
    finally:
        mesh_train.PRECISIONS.clear()
        mesh_train.PRECISIONS.update(saved)
        mesh_train.DynamicLossScaler = scaler


ZERO1 = dict(pp=2, tp=1, schedule="1f1b", dp_strategy="zero1", **BASE)  # pp 2 x dp 2: the master copy sharded
SLOW = dict(ZERO1, lr=1e-3)  # updates below a bf16 ulp of most weights: only the fp32 master copy keeps them
FP16 = dict(ZERO1, steps=5, precision="fp16_mixed", init_loss_scale=2 ** 21)  # overflows until the scale has backed off


def _configs():
    return [(MeshConfig(precision="bf16_mixed", **ZERO1), None),
            (MeshConfig(precision="bf16_mixed", pp=1, tp=2, sp=True, dp_strategy="ddp", **BASE), None),
            (MeshConfig(precision="fp32", pp=1, tp=1, cp=2, dp_strategy="zero3", **BASE), None),
            (MeshConfig(precision="bf16_mixed", **SLOW), None),
            (MeshConfig(precision="bf16_mixed", **SLOW), "no master copy"),
            (MeshConfig(precision="bf16_mixed", **ZERO1), "bf16 gradient sums"),
            (MeshConfig(**FP16), None),
            (MeshConfig(**FP16), "no backoff")]


@pytest.fixture(scope="module")
def runs():
    plans = _configs()
    return [(cfg, broken, payloads) for (cfg, broken), payloads in zip(plans, run_plans(plans, patch=_recipe))]


def test_each_precision_passes_every_check(runs):
    for cfg, broken, payloads in runs:
        if broken is None:
            result = mesh.combine(cfg, payloads)
            assert result.passed, (cfg.precision, cfg.dp_strategy, failures(result))
            assert result.metrics["final_loss"] < result.tables["loss"][0]["loss"]  # it trains
            names = [c.name for c in result.checks]
            assert any(f"one process in {cfg.precision}" in n for n in names) and any("float64" in n for n in names)


def test_memory_by_category_counts_each_dtype(runs):
    """bf16_mixed ZeRO-1 over dp 2: 2ψ bf16 weights, 4ψ fp32 gradients, and the fp32 master, m and v sharded: 12ψ/2
    (the ZeRO paper's K = 12 over N_d = 2, with fp32 gradients as FSDP's reduce_dtype keeps them)."""
    cfg, _, payloads = runs[0]
    for p in payloads:
        n, shard = p["flat_numel"], -(-p["flat_numel"] // 2)
        assert p["memory"]["parameters"] == 2 * n and p["memory"]["gradients"] == 4 * n
        assert p["memory"]["master weights"] + p["memory"]["optimizer states"] == 12 * shard
    rows = mesh.combine(cfg, payloads).tables["memory"]
    assert {r["category"] for r in rows} == {"parameters", "gradients", "optimizer states", "master weights", "activations"}
    fp32 = runs[2][2]  # fp32 is not mixed: one copy of the weights, no master apart
    assert all("master weights" not in p["memory"] for p in fp32)


def test_bytes_are_counted_at_the_dtype_sent(runs):
    """bf16_mixed sends bf16 activations over pp, fp32 gradients and bf16 weights over dp (ZeRO-1's reduce-scatter and
    all-gather); counting the activations at 8 bytes fails the byte check."""
    cfg, _, payloads = runs[0]
    for p in payloads:
        sizes = mesh.split_of(cfg, p["coords"]).microbatch_sizes
        act = sum(b * cfg.seq * cfg.d_model for b in sizes)  # elements per step
        assert p["bytes"]["pp"] == cfg.steps * act * 2  # one boundary on each of the two stages, 2 bytes each
    for p in payloads:  # per step: reduce-scatter n/2 fp32 and all-gather n/2 bf16; then the fp32 master gathered to report
        n = -(-p["flat_numel"] // 2) * 2  # this stage's weights, padded to a multiple of dp
        assert p["bytes"]["dp gradients"] == cfg.steps * (n // 2 * 4 + n // 2 * 2) + n // 2 * 4
    payloads[0]["bytes"]["pp"] *= 4
    assert not _checks(cfg, payloads)["rank 0: tensor, pipeline, ring and gradient bytes equal the model"].passed


def test_without_the_master_copy_the_numerical_check_fails(runs):
    """At lr 1e-3 Adam's updates are below a bf16 ulp of most weights: stepping the bf16 weights themselves (no fp32
    master copy) loses them. The same-recipe check and the memory check fail; the correct run passes both."""
    (cfg, _, good), (_, broken, bad) = runs[3], runs[4]
    assert broken == "no master copy"
    name = "final parameters equal one process in bf16_mixed (error as a share of the update)"
    ok, wrong = _checks(cfg, good), _checks(cfg, bad)
    assert ok[name].passed and not wrong[name].passed and wrong[name].error > 3 * ok[name].error
    assert not wrong["parameters, gradients and optimizer states per rank equal the zero1 memory model"].passed


def test_gradients_summed_in_bf16_fail_the_byte_and_memory_checks(runs):
    """Summing gradients over dp in bf16 instead of fp32 is invisible at this size in the weights (one rounding of a
    two-term sum), but not on the wire or in memory: half the dp bytes, half the gradient bytes."""
    cfg, broken, payloads = runs[5]
    assert broken == "bf16 gradient sums"
    checks = _checks(cfg, payloads)
    assert not checks["rank 0: tensor, pipeline, ring and gradient bytes equal the model"].passed
    assert not checks["parameters, gradients and optimizer states per rank equal the zero1 memory model"].passed


def test_fp64_keeps_the_exact_checks():
    cfg = MeshConfig.from_dict({})
    assert cfg.precision == "fp64" and PRECISIONS[cfg.precision].compute == torch.float64
    assert mesh.dp_memory("zero1", 10, 2) == {"parameters": 80, "gradients": 80, "optimizer states": 80}


@pytest.mark.parametrize("values, field", [
    ({"precision": "bf16_mixed", "experts": "4", "ep": "2", "tp": "1"}, "precision"),
    ({"precision": "fp16"}, "precision"),
])
def test_bad_precision_inputs(values, field):
    with pytest.raises(ConfigError) as info:
        MeshConfig.from_dict(values)
    assert info.value.field == field


def test_fp16_loss_scale_skips_the_steps_gradscaler_skips(runs):
    """fp16 from a loss scale of 2^21: the first steps overflow; every rank skips them together and halves the scale,
    step for step as torch.amp.GradScaler does on one process, then trains; ZeRO-1 gathers no weights after a
    skipped step (the byte model counts the skips). A scaler that does not back off fails the scale check."""
    cfg, _, payloads = runs[6]
    result = mesh.combine(cfg, payloads)
    assert result.passed, failures(result)
    skipped = payloads[0]["skipped"]
    assert 0 < sum(skipped) < cfg.steps and all(p["skipped"] == skipped for p in payloads)
    assert payloads[0]["loss_scales"][:3] == [2.0 ** 21, 2.0 ** 20, 2.0 ** 19]
    name = "every rank's loss scale and skipped steps equal torch.amp.GradScaler's"
    assert result.passed and not _checks(*runs[7][::2])[name].passed
