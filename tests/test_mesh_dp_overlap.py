"""DDP's overlap on the mesh (ddp.BucketOverlap): each bucket's ring all-reduce starts on a communication thread
as soon as its gradients are final in the last micro-batch's backward. The run equals the same plan without overlap
bit for bit (same buckets, same ring, same sums), and one float64 process within 1e-9; the buckets really start
before the backward ends; the exposed dp time is the main thread's waits; starting a bucket after its first
micro-batch (before its gradients are final) fails the parameter check."""
import multiprocessing

import numpy as np
import pytest

from backend.comm.spawn import spawn_ranks
from backend.experiments import RunContext
from backend.experiments.parallel import mesh
from backend.experiments.parallel.mesh import MeshConfig
from tests.sweep import assert_refused

PLAN = dict(world_size=2, tp=1, pp=1, dp_strategy="ddp", microbatches=2, bucket_kb=1, steps=2, layers=2)


def _both(rank, world, configs, ctx, early=False):
    """Each config's mesh run on this rank; `early`: a bucket counted final after its first micro-batch's gradients."""
    if early:
        from backend.parallel import ddp

        init = ddp.BucketOverlap.__init__

        def early_init(self, buckets, ranges, wire, tracer, microbatches, reduce):
            init(self, buckets, ranges, wire, tracer, 1, reduce)
        ddp.BucketOverlap.__init__ = early_init
    return [mesh.run_rank(rank, world, c, ctx) for c in configs]


@pytest.fixture(scope="module")
def runs():
    configs = [MeshConfig(overlap=False, **PLAN).validate(), MeshConfig(overlap=True, **PLAN).validate()]
    per_rank = spawn_ranks(_both, 2, configs, RunContext(timeout_s=300))
    assert multiprocessing.active_children() == []
    return configs, [[per_rank[r][i] for r in range(2)] for i in range(2)]


def test_overlap_equals_no_overlap_bit_for_bit_and_one_process(runs):
    (plain_cfg, overlap_cfg), (plain, overlapped) = runs
    for a, b in zip(sorted(plain, key=lambda p: p["rank"]), sorted(overlapped, key=lambda p: p["rank"])):
        assert a["losses"] == b["losses"]
        assert a["params"].keys() == b["params"].keys()
        assert all(np.array_equal(a["params"][k], b["params"][k]) for k in a["params"])
        assert a["bytes"]["dp gradients"] == b["bytes"]["dp gradients"] > 0  # every byte still on the dp dimension
    result = mesh.combine(overlap_cfg, overlapped)
    assert result.passed, [(c.name, c.error) for c in result.checks if not c.passed]
    assert result.checks[0].error < 1e-9


def test_buckets_start_during_the_backward_and_only_the_wait_is_exposed(runs):
    _, (_, overlapped) = runs
    for p in overlapped:
        start, end = p["step_us"][-1]
        events = [e for e in p["trace"]["events"] if start <= e["ts"] and e["ts"] + e["dur"] <= end]
        buckets = [e for e in events if e["args"].get("overlapped")]
        assert len(buckets) > 1 and all(0 <= e["args"]["blocked_us"] <= e["dur"] for e in buckets)
        last_backward = max(e["ts"] + e["dur"] for e in events if e["lane"] == "compute" and e["args"].get("kind") == "B")
        assert min(e["ts"] for e in buckets) < last_backward  # the first bucket left while the backward still ran
    result = mesh.combine(runs[0][1], overlapped)
    split = {r["rank"]: r for r in result.tables["step_split"]}
    for p in overlapped:
        start, end = p["step_us"][-1]
        waits = [e["args"]["blocked_us"] for e in p["trace"]["events"]
                 if e["args"].get("overlapped") and start <= e["ts"] and e["ts"] + e["dur"] <= end]
        assert split[p["rank"]]["dp_ms"] == pytest.approx(sum(waits) / 1e3, rel=1e-6, abs=1e-6)


def test_a_bucket_started_before_its_gradients_are_final_fails():
    config = MeshConfig(overlap=True, **PLAN).validate()
    per_rank = spawn_ranks(_early, 2, config, RunContext(timeout_s=300))
    result = mesh.combine(config, [per_rank[r] for r in range(2)])
    failed = {c.name for c in result.checks if not c.passed}
    assert "final parameters: every rank's shard equals one process on the whole batch" in failed


def _early(rank, world, config, ctx):
    return _both(rank, world, [config], ctx, early=True)[0]


@pytest.mark.parametrize("values, field", [
    ({"overlap": "true", "dp_strategy": "zero1", "tp": "1", "pp": "1"}, "overlap"),
    ({"overlap": "true", "dp_strategy": "ddp", "sp": "true", "tp": "2", "pp": "1"}, "overlap"),
])
def test_overlap_refused_by_name_where_it_does_not_apply(values, field):
    assert_refused(MeshConfig, values, field)
