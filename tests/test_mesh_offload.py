"""ZeRO-Offload on the mesh's dp dimension (mesh_dp.DataParallel with offload): the master shard, Adam's m and v in the
host pool, the gradient shard down and the weight shard up each step. In float64 the run equals the same plan without
offload bit for bit (offload moves tensors, it changes no arithmetic); in bf16 mixed precision the host pool and the
bytes moved equal ZeRO-Offload's model (ψ/dp each way: fp32 gradients down, bf16 weights up), and a shard moved up
before its cast to bf16 (twice the bytes) fails that check."""
import copy
import multiprocessing

import numpy as np
import pytest

from backend.comm.spawn import spawn_ranks
from backend.experiments import RunContext
from backend.experiments.parallel import mesh
from backend.experiments.parallel.mesh import MeshConfig
from tests.sweep import assert_refused

PLAN = dict(world_size=2, tp=1, pp=1, microbatches=1, steps=2, layers=2)
CONFIGS = [MeshConfig(dp_strategy="zero1", **PLAN), MeshConfig(dp_strategy="zero1", offload=True, **PLAN),
           MeshConfig(dp_strategy="zero2", offload=True, precision="bf16_mixed", **PLAN)]


def _runs(rank, world, configs, ctx, uncast=False):
    """Each config's mesh run on this rank; `uncast`: the weight shard moved up in the master dtype, cast after."""
    if uncast:
        from backend.parallel.offload import Pools

        move = Pools.move
        Pools.move = lambda self, t, to, dtype=None: move(self, t, to).to(dtype or t.dtype)
    return [mesh.run_rank(rank, world, c.validate(), ctx) for c in configs]


@pytest.fixture(scope="module")
def runs():
    per_rank = spawn_ranks(_runs, 2, CONFIGS, RunContext(timeout_s=300))
    assert multiprocessing.active_children() == []
    return [[per_rank[r][i] for r in range(2)] for i in range(len(CONFIGS))]


def test_offload_changes_no_arithmetic_and_every_run_passes(runs):
    for a, b in zip(runs[0], runs[1]):
        assert a["losses"] == b["losses"]
        assert all(np.array_equal(a["params"][k], b["params"][k]) for k in a["params"])
    for config, payloads in zip(CONFIGS, runs):
        result = mesh.combine(config, payloads)
        assert result.passed, [(c.name, c.error) for c in result.checks if not c.passed]


def test_the_host_pool_holds_adam_and_the_device_does_not(runs):
    result = mesh.combine(CONFIGS[2], runs[2])
    rows = {(r["rank"], r.get("pool"), r["category"]): r["measured_bytes"] for r in result.tables["memory"]}
    psi = runs[2][0]["flat_numel"]
    shard = -(-psi // 2)
    assert rows[(0, "host", "optimizer states")] == 2 * 4 * shard  # fp32 m and v of this rank's shard
    assert rows[(0, "host", "parameters (master shard)")] == 4 * shard
    assert rows[(0, "device", "optimizer states")] == rows[(0, "device", "master weights")] == 0
    assert runs[2][0]["moved"] == {"device_to_host": 4 * shard * 2, "host_to_device": 2 * shard * 2}  # 2 steps


def test_wrong_moved_bytes_or_an_uncast_shard_fail(runs):
    name = "bytes moved host <-> device equal ψ/dp each way per step"
    broken = copy.deepcopy(runs[2])
    broken[1]["moved"]["host_to_device"] += 2
    assert name in {c.name for c in mesh.combine(CONFIGS[2], broken).checks if not c.passed}
    per_rank = spawn_ranks(_uncast, 2, CONFIGS[2], RunContext(timeout_s=300))
    result = mesh.combine(CONFIGS[2], [per_rank[r] for r in range(2)])
    assert name in {c.name for c in result.checks if not c.passed}


def _uncast(rank, world, config, ctx):
    return _runs(rank, world, [config], ctx, uncast=True)[0]


@pytest.mark.parametrize("values", [{"offload": "true", "dp_strategy": "zero3", "tp": "1", "pp": "1"},
                                    {"offload": "true", "dp_strategy": "ddp", "tp": "1", "pp": "1"}])
def test_offload_refused_by_name_outside_zero1_and_zero2(values):
    assert_refused(MeshConfig, values, "offload")
