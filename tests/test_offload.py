"""CPU offload: ZeRO-Offload (ours, stages 1 and 2) and FSDP2's CPUOffloadPolicy against their non-offloaded runs,
one process, memory per pool and bytes moved host <-> device per step; runs that break the rule fail the checks."""
import functools
import multiprocessing

import numpy as np
import pytest

from backend.comm.spawn import spawn_ranks
from backend.config import ConfigError
from backend.experiments import RunContext
from backend.experiments.parallel import fsdp, zero
from backend.experiments.parallel.fsdp import FSDPConfig
from backend.experiments.parallel.zero import ZeroConfig


def _cases(world):
    base = dict(world_size=world, hidden=6, layers=3, batch=12, steps=3, model="mlp")  # 126 parameters: uneven ZeRO shards, an empty FSDP2 row shard at n = 4
    mixed = dict(base, hidden=16, precision="bf16_mixed")
    return {"zero1": (zero, ZeroConfig(stage=1, **base)), "zero1-offload": (zero, ZeroConfig(stage=1, offload=True, **base)),
            "zero2": (zero, ZeroConfig(stage=2, **base)), "zero2-offload": (zero, ZeroConfig(stage=2, offload=True, **base)),
            "zero2 bf16": (zero, ZeroConfig(stage=2, **mixed)), "zero2-offload bf16": (zero, ZeroConfig(stage=2, offload=True, **mixed)),
            "fsdp": (fsdp, FSDPConfig(**base)), "fsdp-offload": (fsdp, FSDPConfig(offload=True, **base))}


def _all(rank, world, cases, ctx):
    import importlib

    return [importlib.import_module(name).run_rank(rank, world, cfg, ctx) for name, cfg in cases]


@pytest.fixture(scope="module", params=[2, 4])
def runs(request):
    cases = _cases(request.param)
    per_rank = spawn_ranks(_all, request.param, [(m.__name__, c) for m, c in cases.values()], RunContext(timeout_s=240))
    assert multiprocessing.active_children() == []
    return {name: (module, cfg, [per_rank[r][i] for r in range(request.param)]) for i, (name, (module, cfg)) in enumerate(cases.items())}


def test_offloaded_runs_pass_every_check(runs):
    for name, (module, cfg, reports) in runs.items():
        result = module.EXPERIMENT.combine(cfg, reports)
        assert result.passed, (name, [(c.name, c.error) for c in result.checks if not c.passed])
        assert any("host <-> device" in c.name for c in result.checks) == name.split()[0].endswith("offload")


@pytest.mark.parametrize("plain, offloaded", [("zero1", "zero1-offload"), ("zero2", "zero2-offload"),
                                              ("zero2 bf16", "zero2-offload bf16"), ("fsdp", "fsdp-offload")])
def test_offload_changes_where_not_what(runs, plain, offloaded):
    """Bitwise the same parameters and losses as without offload; the optimizer states leave the device."""
    assert runs[plain][2][0].memory["optimizer states"] > 0
    for a, b in zip(runs[plain][2], runs[offloaded][2]):
        assert np.array_equal(a.params, b.params) and a.losses == b.losses
        assert b.memory["optimizer states"] == 0  # (FSDP2 at n = 4 leaves rank 3 no rows: 0 either way)
        master = b.host_memory.get("parameters (master shard)", 0) if "bf16" in plain else 0  # counted apart once on the host
        assert b.host_memory["optimizer states"] + master == a.memory["optimizer states"]


def test_zero_offload_moves_the_papers_bytes_per_parameter(runs):
    """ZeRO-Offload per owned parameter per step: fp64 8 down and 8 up; bf16 mixed 4 down (fp32 gradients) and
    2 up (bf16 parameters), the paper's fp16 figure being 2 and 2. Read off the run, not the formula."""
    for name, down, up in (("zero2-offload", 8, 8), ("zero2-offload bf16", 4, 2)):
        module, cfg, reports = runs[name]
        for r in reports:
            owned = r.host_memory["parameters (master shard)"] // (4 if "bf16" in name else 8)
            assert r.extra["moved"] == {"device_to_host": down * owned * cfg.steps, "host_to_device": up * owned * cfg.steps}


def _rank_moving_fp32_parameters(rank, world, cfg, ctx):
    """ZeRO-Offload that sends the updated master shard up in fp32 instead of casting it to bf16 on the host."""
    from backend.parallel import offload

    move = offload.Pools.move
    offload.Pools.move = lambda self, t, to, dtype=None: move(self, t, to)
    return zero.run_rank(rank, world, cfg, ctx)


def _rank_fsdp_keeping_parameters(rank, world, cfg, ctx):
    """FSDP2 told not to reshard after forward: one host -> device copy per step instead of two."""
    import torch.distributed.fsdp as api

    api.fully_shard = functools.partial(api.fully_shard, reshard_after_forward=False)
    return fsdp.run_rank(rank, world, cfg, ctx)


@pytest.mark.parametrize("rank_fn, module, cfg", [
    (_rank_moving_fp32_parameters, zero, ZeroConfig(world_size=2, hidden=16, layers=2, batch=8, steps=2, stage=1, offload=True, precision="bf16_mixed",
                                                      model="mlp")),
    (_rank_fsdp_keeping_parameters, fsdp, FSDPConfig(world_size=2, hidden=6, layers=2, batch=8, steps=2, offload=True, model="mlp")),
])
def test_a_run_that_breaks_the_rule_fails_the_bytes_check(rank_fn, module, cfg):
    reports = spawn_ranks(rank_fn, 2, cfg.validate(), RunContext(timeout_s=120))
    result = module.EXPERIMENT.combine(cfg, reports)
    check = next(c for c in result.checks if "host <-> device" in c.name)
    assert not check.passed and check.error > 0
    assert next(c for c in result.checks if c.name.startswith("final parameters")).passed  # the arithmetic is still right


def test_offload_refuses_stage_3():
    with pytest.raises(ConfigError) as info:
        ZeroConfig.from_dict({"stage": "3", "offload": "true"})
    assert info.value.field == "offload"


def test_the_data_parallel_page_draws_the_pools_and_the_bytes_moved():
    from tests.test_pages import _app, _recorded

    rid = _recorded("parallel.zero", {"world_size": "2", "hidden": "8", "layers": "2", "batch": "8", "steps": "2",
                                      "stage": "2", "offload": "true"})
    at = _app("pages/data_parallel.py", strategy="parallel.zero", run=rid)
    assert not at.exception, at.exception
    assert any("bytes moved host" in h.value for h in at.subheader)
    assert len(at.get("vega_lite_chart")) >= 3  # memory per rank and pool, loss, bytes moved
