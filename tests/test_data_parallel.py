"""DDP, ZeRO-1/2/3 and FSDP2 against one process, at world sizes 2, 3 (uneven shards) and 4."""
import dataclasses
import multiprocessing

import pytest

from backend.config import ConfigError
from backend.comm.spawn import spawn_ranks
from backend.experiments import RunContext
from backend.experiments.parallel import ddp, fsdp, zero
from backend.experiments.parallel.ddp import DDPConfig
from backend.experiments.parallel.dp_ps import PSConfig
from backend.experiments.parallel.fsdp import FSDPConfig
from backend.experiments.parallel.zero import ZeroConfig
from backend.parallel import dp_ps
from backend.parallel.dp_ps import combine_ps
from backend.result import UndeclaredKey


def _cases(world):
    base = dict(world_size=world, hidden=6, layers=4, batch=12, steps=3, model="mlp")  # layers of 42 parameters: uneven shards at n = 4
    return [(ddp, DDPConfig(bucket_kb=1, **base), "ddp"), (ddp, DDPConfig(overlap=False, **base), "ddp"),
            (ddp, DDPConfig(bucket_kb=1, comm_delay_ms=5, **base), "ddp"),
            (zero, ZeroConfig(stage=1, **base), "zero1"), (zero, ZeroConfig(stage=2, **base), "zero2"),
            (zero, ZeroConfig(stage=3, **base), "zero3"), (fsdp, FSDPConfig(**base), "fsdp")]


def _combine(module, cfg, reports):
    return module.EXPERIMENT.combine(cfg, reports)


def _all(rank, world, cases, ctx):
    import importlib

    cases = [(importlib.import_module(name), cfg) for name, cfg in cases]
    return [module.run_rank(rank, world, cfg, ctx) for module, cfg in cases]


@pytest.fixture(scope="module", params=[2, 3, 4])
def runs(request):
    cases = _cases(request.param)
    per_rank = spawn_ranks(_all, request.param, [(module.__name__, cfg) for module, cfg, _ in cases], RunContext(timeout_s=240))
    assert multiprocessing.active_children() == []
    return [(module, cfg, name, [per_rank[r][i] for r in range(request.param)]) for i, (module, cfg, name) in enumerate(cases)]


def test_every_strategy_equals_the_reference_and_its_formulas(runs):
    for module, cfg, name, reports in runs:
        result = _combine(module, cfg, reports)
        failed = [(c.name, c.error) for c in result.checks if not c.passed]
        assert not failed, (name, failed)


def test_zero_memory_shrinks_stage_by_stage(runs):
    held = {name: reports[0].memory for module, cfg, name, reports in runs}
    assert held["zero1"]["optimizer states"] < held["ddp"]["optimizer states"]
    assert held["zero2"]["gradients"] < held["zero1"]["gradients"]
    assert held["zero3"]["parameters"] < held["zero2"]["parameters"]


def test_ddp_bytes_are_counted_on_our_ring_and_a_lost_byte_fails(runs):
    """DDP's buckets go through the Wire's ring (mesh_dp.BucketOverlap), so its bytes are checked as ZeRO's are: each
    bucket padded to a multiple of n, 2P(n-1)/n per rank; a rank that sent 8 bytes more fails the check."""
    import copy

    module, cfg, name, reports = next(r for r in runs if r[2] == "ddp")
    name = "bytes sent per step equal the formula"
    assert next(c for c in _combine(module, cfg, reports).checks if c.name == name).passed
    broken = copy.deepcopy(reports)
    broken[-1].sent_bytes += 8
    assert name in {c.name for c in _combine(module, cfg, broken).checks if not c.passed}


def test_a_wrong_parameter_fails_the_check(runs):
    module, cfg, name, reports = next(r for r in runs if r[2] == "zero2")
    reports[0].params = reports[0].params + 1e-9
    assert not _combine(module, cfg, reports).passed


def test_the_mlp_result_is_held_to_its_own_shape(runs):
    """ddp, zero and fsdp hold results of two shapes, chosen by the result's model: the MLP's requires its own keys
    (a result without one fails the run) and refuses the tiny LLaMA's (the mesh's `dp`)."""
    for module, cfg, name, reports in runs:
        result, schema = _combine(module, cfg, reports), module.EXPERIMENT.schema
        assert schema.shape(result.metrics) is schema.shapes["mlp"]
        schema.stamp(result, name)
        for key in ("parameter_bytes", "psi_padded_bytes", "model"):
            lacking = dataclasses.replace(result, metrics={k: v for k, v in result.metrics.items() if k != key})
            with pytest.raises(UndeclaredKey, match=f"metric '{key}' is missing|metric 'model' is None"):
                schema.stamp(lacking, name)
        with pytest.raises(UndeclaredKey, match="table 'moved' is missing"):
            schema.stamp(dataclasses.replace(result, tables={k: v for k, v in result.tables.items() if k != "moved"}), name)
        with pytest.raises(UndeclaredKey, match="metric 'dp' is not declared"):
            schema.stamp(dataclasses.replace(result, metrics={**result.metrics, "dp": cfg.world_size}), name)


@pytest.mark.parametrize("cls, values, field", [
    (ZeroConfig, {"stage": "4"}, "stage"), (ZeroConfig, {"world_size": "1"}, "world_size"),
    (DDPConfig, {"bucket_kb": "0"}, "bucket_kb"), (FSDPConfig, {"batch": "2", "world_size": "4"}, "batch"),
])
def test_bad_inputs(cls, values, field):
    with pytest.raises(ConfigError) as info:
        cls.from_dict(values)
    assert info.value.field == field


@pytest.mark.parametrize("server, mode", [("rank0", "sync"), ("dedicated", "sync"), ("dedicated", "async"), ("dedicated", "stale")])
def test_parameter_servers(server, mode):
    cfg = PSConfig(world_size=3, hidden=8, layers=2, batch=12, steps=8, server=server, mode=mode, staleness=0,
                   straggler_ms=20 if mode != "sync" else 0).validate()  # the default lr: no tuning for the check
    payloads = spawn_ranks(dp_ps.run_rank, 3, cfg, RunContext(timeout_s=120))
    result = combine_ps(cfg, payloads)
    assert result.passed, [(c.name, c.error, c.detail) for c in result.checks if not c.passed]
    payloads[-1]["sent"] += 8  # a worker's message its server never logged receiving
    assert not combine_ps(cfg, payloads).passed
    payloads[-1]["sent"] -= 8
    if mode == "async":
        assert max(u["staleness"] for u in result.tables["staleness"]) >= 1
        payloads[0]["updates"][-1]["based_on"] = 0  # a log that lies about which version a gradient used
        assert not combine_ps(cfg, payloads).passed


def test_parameter_server_bad_inputs():
    with pytest.raises(ConfigError) as info:
        PSConfig.from_dict({"server": "rank0", "mode": "async"})
    assert info.value.field == "mode"


@pytest.mark.parametrize("stage, world", [(1, 2), (2, 3), (2, 4)])
def test_zero_bf16_mixed_precision(stage, world):
    cfg = ZeroConfig(world_size=world, hidden=16, layers=2, batch=12, steps=3, stage=stage, precision="bf16_mixed",
                     model="mlp").validate()
    reports = spawn_ranks(zero.run_rank, world, cfg, RunContext(timeout_s=120))
    result = _combine(zero, cfg, reports)
    assert result.passed, [(c.name, c.error) for c in result.checks if not c.passed]
    assert result.metrics["relative_error_vs_float64"] > 0  # bf16 does cost accuracy, and the run says how much


def test_mixed_precision_needs_stage_1_or_2():
    with pytest.raises(ConfigError) as info:
        ZeroConfig.from_dict({"stage": "3", "precision": "bf16_mixed", "model": "mlp"})
    assert info.value.field == "precision"
