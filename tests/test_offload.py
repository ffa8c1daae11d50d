"""CPU offload through the data-parallel pages on the tiny LLaMA: FSDP2's CPUOffloadPolicy on the mesh's fsdp2 against
the same run without it (bitwise the same weights; memory per pool and bytes moved host <-> device per step against
the model, at dp 3 where FSDP2 pads the last rank's rows), a run that breaks the rule failing the bytes check; the
page draws the pools. (ZeRO-Offload on the mesh: tests/test_mesh_offload.py.)"""
import copy
import multiprocessing

import numpy as np
import pytest

from backend.comm.spawn import spawn_ranks
from backend.experiments import RunContext
from backend.experiments.parallel import fsdp
from backend.experiments.parallel.fsdp import FSDPConfig

BASE = dict(world_size=3, hidden=10, layers=2, batch=6, steps=2)  # 10 rows over 3: 4, 4, 2 (the last rank's padded)
MOVED = "bytes moved host <-> device per step equal the FSDP2 shards'"


def _both(rank, world, configs, ctx):
    return [fsdp.run_rank(rank, world, c, ctx) for c in configs]


@pytest.fixture(scope="module")
def runs():
    configs = [FSDPConfig(**BASE).validate(), FSDPConfig(offload=True, **BASE).validate()]
    per_rank = spawn_ranks(_both, 3, configs, RunContext(timeout_s=240))
    assert multiprocessing.active_children() == []
    return [(c, [per_rank[r][i] for r in range(3)]) for i, c in enumerate(configs)]


def test_fsdp2_offload_passes_and_changes_where_not_what(runs):
    (plain_cfg, plain), (cfg, offloaded) = runs
    result = fsdp.EXPERIMENT.combine(cfg, offloaded)
    assert result.passed, [(c.name, c.error) for c in result.checks if not c.passed]
    assert {MOVED, "the host pool holds the FSDP2 CPUOffloadPolicy memory model"} <= {c.name for c in result.checks}
    for a, b in zip(plain, offloaded):
        assert all(np.array_equal(a["params"][k], b["params"][k]) for k in a["params"]) and a["losses"] == b["losses"]
        assert b["memory"]["optimizer states"] == 0 < a["memory"]["optimizer states"] == b["host_memory"]["optimizer states"]
        assert b["host_memory"]["parameters (shard)"] == a["memory"]["parameters"]
    rows = [r for r in result.tables["moved"] if r["direction"] == "host to device"]
    assert rows[0]["measured_bytes_per_step"] > 0 and len({r["measured_bytes_per_step"] for r in rows}) == 1  # padded alike
    down = {r["rank"]: r["measured_bytes_per_step"] for r in result.tables["moved"] if r["direction"] == "device to host"}
    by_dp = {p["rank"]: p["coords"]["dp"] for p in offloaded}
    assert down[next(r for r, d in by_dp.items() if d == 2)] < down[next(r for r, d in by_dp.items() if d == 0)]  # 2 rows, not 4


def test_a_byte_moved_or_held_off_the_model_fails(runs):
    cfg, payloads = runs[1]
    for pool in ("moved", "host_memory"):
        broken = copy.deepcopy(payloads)
        key = next(iter(broken[1][pool]))
        broken[1][pool][key] += 8
        assert not fsdp.EXPERIMENT.combine(cfg, broken).passed, pool


def _rank_fsdp_resharding_after_forward(rank, world, cfg, ctx):
    """FSDP2 told to reshard after the forward (the retired MLP loop's choice): it gathers again in the backward, so
    each parameter shard is copied up twice a step instead of once."""
    import torch.distributed.fsdp as api

    real = api.fully_shard

    def resharding(module, **kw):
        return real(module, **{**kw, "reshard_after_forward": True})
    resharding.state = real.state
    api.fully_shard = resharding
    return fsdp.run_rank(rank, world, cfg, ctx)


def test_a_run_that_breaks_the_rule_fails_the_bytes_check():
    cfg = FSDPConfig(offload=True, **BASE).validate()
    result = fsdp.EXPERIMENT.combine(cfg, spawn_ranks(_rank_fsdp_resharding_after_forward, 3, cfg, RunContext(timeout_s=120)))
    check = next(c for c in result.checks if c.name == MOVED)
    assert not check.passed and check.error > 0
    assert next(c for c in result.checks if c.name.startswith("final parameters")).passed  # the arithmetic is still right


def test_the_data_parallel_page_draws_the_pools_and_the_bytes_moved():
    from tests.test_pages import _app, _recorded

    rid = _recorded("parallel.zero", {"world_size": "2", "hidden": "8", "layers": "2", "batch": "8", "steps": "2",
                                      "stage": "2", "offload": "true"})
    at = _app("pages/data_parallel.py", strategy="parallel.zero", run=rid)
    assert not at.exception, at.exception
    assert any("bytes moved host" in h.value for h in at.subheader)
    assert len(at.get("vega_lite_chart")) >= 3  # memory per rank and pool, loss, bytes moved
