"""Pipeline schedules: gradients vs one process at p = 2 and 4, op order vs torch.distributed.pipelining,
peak live activations vs the bound, PipeDream's weight versions, bad inputs, no process left behind."""
import multiprocessing

import pytest

from backend.config import ConfigError
from backend.comm.spawn import spawn_ranks
from backend.experiments import RunContext
from backend.parallel.pp.executor import run_rank
from backend.experiments.pipeline.run import PipelineConfig, combine, pipedream_seed_example, run_rank_with_peer
from backend.parallel.pp.schedules import SCHEDULES, live_activations


def _matrix_rank(rank, world, configs, ctx):
    return [run_rank_with_peer(rank, world, c, ctx) for c in configs]


def _configs(p):
    small = dict(world_size=p, hidden=16, batch=8, layers=2 * p)
    out = [PipelineConfig(schedule=s, microbatches=4, **small) for s in ("naive", "gpipe", "1f1b", "zb_h1")]
    out += [PipelineConfig(schedule="gpipe", microbatches=4, recompute=True, **small),
            PipelineConfig(schedule="1f1b", microbatches=4, recompute=True, **small),
            PipelineConfig(schedule="interleaved_1f1b", microbatches=4, virtual_stages=2, **small),
            PipelineConfig(schedule="pipedream", microbatches=8, **small),  # m >= 5: seed 000's example at p = 4
            PipelineConfig(schedule="pipedream", microbatches=8, weight_stashing=False, **small),
            PipelineConfig(schedule="pipedream", microbatches=8, vertical_sync=True, **small)]
    return [c.validate() for c in out]


@pytest.fixture(scope="module", params=[2, 4])
def matrix(request):
    p = request.param
    configs = _configs(p)
    per_rank = spawn_ranks(_matrix_rank, p, configs, RunContext(timeout_s=240))
    assert multiprocessing.active_children() == []  # every rank process ended
    return [(c, [per_rank[r][i] for r in range(p)]) for i, c in enumerate(configs)]


def test_every_schedule_passes_its_checks(matrix):
    for config, payloads in matrix:
        result = combine(config, payloads)
        failed = [(c.name, c.error) for c in result.checks if not c.passed]
        assert not failed, (config.schedule, failed)
        names = " ".join(c.name for c in result.checks)
        if config.schedule != "pipedream":
            assert "gradients equal" in names
        if config.schedule in ("interleaved_1f1b", "zb_h1", "gpipe", "1f1b"):
            assert "torch.distributed.pipelining" in names


def test_peak_live_activations(matrix):
    for config, payloads in matrix:
        m = 1 if config.schedule == "naive" else config.microbatches
        for pl in payloads:
            expected = {"gpipe": m, "1f1b": min(m, config.world_size - pl["rank"])}.get(config.schedule)
            if expected is not None:
                assert pl["peak_live"] == expected


def test_pipedream_stashing_consistency(matrix):
    stash, no_stash, vsync = [(c, p) for c, p in matrix if c.schedule == "pipedream"]
    versions = [v for pl in stash[1] for v in pl["versions"]]
    assert versions and all(v["forward_version"] == v["backward_version"] for v in versions)
    versions = [v for pl in no_stash[1] for v in pl["versions"]]
    if no_stash[0].world_size > 1:
        assert any(v["forward_version"] != v["backward_version"] for v in versions)
        assert max(e["relative_error"] for pl in no_stash[1] for e in pl["grad_errors"]) > 0


def test_pipedream_reproduces_seed_000s_weight_versions(matrix):
    """At 4 ranks each PipeDream variant's run checks micro-batch 5's versions against the seed's figures; versions
    from another variant, or counted one update late, fail that check."""
    runs = [(c, p) for c, p in matrix if c.schedule == "pipedream"]
    if runs[0][0].world_size != 4:
        assert all(pipedream_seed_example(c, [v for pl in p for v in pl["versions"]]) is None for c, p in runs)
        return
    versions = {(c.weight_stashing, c.vertical_sync): [v for pl in p for v in pl["versions"]] for c, p in runs}
    for config, payloads in runs:
        check = next(c for c in combine(config, payloads).checks if c.name.startswith("seed 000's PipeDream"))
        assert check.passed, check.detail
    stash, no_stash, vsync = (c for c, _ in runs)
    assert not pipedream_seed_example(stash, versions[(False, False)]).passed  # backward on newer weights
    assert not pipedream_seed_example(vsync, versions[(True, False)]).passed   # device 2 on its own newest version
    assert not pipedream_seed_example(no_stash, versions[(True, False)]).passed
    late = [dict(v, backward_version=v["backward_version"] + 1, forward_version=v["forward_version"] + 1)
            for v in versions[(True, False)]]
    check = pipedream_seed_example(stash, late)
    assert not check.passed and "device 1 forward: version 2 (seed: 1)" in check.detail


def test_a_wrong_gradient_fails_the_check(matrix):
    config, payloads = next((c, p) for c, p in matrix if c.schedule == "1f1b" and not c.recompute)
    payloads[0]["grads"][0][0] = payloads[0]["grads"][0][0] + 1e-6
    assert not combine(config, payloads).passed


def test_schedule_bounds_from_the_order():
    for p, m in ((4, 8), (3, 5)):
        for r in range(p):
            assert live_activations(SCHEDULES["gpipe"].actions(p, m)[r]) == m
            assert live_activations(SCHEDULES["1f1b"].actions(p, m)[r]) == SCHEDULES["1f1b"].live_bound(p, m, r) == min(m, p - r)


@pytest.mark.parametrize("values, field", [
    ({"world_size": "1"}, "world_size"),
    ({"schedule": "interleaved_1f1b", "virtual_stages": "2", "microbatches": "2", "world_size": "4", "layers": "8"}, "microbatches"),
    ({"schedule": "interleaved_1f1b", "virtual_stages": "3", "layers": "8"}, "layers"),
    ({"virtual_stages": "2"}, "virtual_stages"),
    ({"batch": "30", "microbatches": "8"}, "batch"),
    ({"schedule": "zb_h1", "recompute": "true"}, "recompute"),
])
def test_bad_inputs(values, field):
    with pytest.raises(ConfigError) as info:
        PipelineConfig.from_dict(values)
    assert info.value.field == field


def test_pipedream_vertical_sync(matrix):
    config, payloads = [(c, p) for c, p in matrix if c.schedule == "pipedream"][2]
    by_mb = {}
    for pl in payloads:
        for v in pl["versions"]:
            by_mb.setdefault(v["mb"], set()).add(v["forward_version"])
    assert all(len(vs) == 1 for vs in by_mb.values())
    plain = [(c, p) for c, p in matrix if c.schedule == "pipedream"][0][1]
    spread = {}
    for pl in plain:
        for v in pl["versions"]:
            spread.setdefault(v["mb"], set()).add(v["forward_version"])
    if config.world_size > 2:
        assert any(len(vs) > 1 for vs in spread.values())  # without it, stages disagree


def test_idle_split_on_a_hand_timed_trace():
    """Two ranks, one micro-batch, times in µs worked out by hand: rank 1's recv of the activation starts at 2, the
    data is ready at 10 (rank 0's F ends), it returns at 14: 8 waiting, 4 transfer; its idle (40 - 16) leaves 12
    between. Rank 0's recv of the gradient starts at 10, the gradient is ready at 30 (rank 1's B), it returns at 33."""
    from backend.experiments.pipeline.run import idle_split

    def ev(rank, lane, name, ts, end, **args):
        return {"rank": rank, "lane": lane, "name": name, "ts": ts, "dur": end - ts, "args": args}

    events = [ev(0, "compute", "F0", 0, 10, kind="F", stage=0, mb=0), ev(1, "recv", "recv act 0", 2, 14, stage=1, mb=0),
              ev(1, "compute", "F0", 14, 20, kind="F", stage=1, mb=0), ev(1, "compute", "B0", 20, 30, kind="B", stage=1, mb=0),
              ev(0, "recv", "recv grad 0", 10, 33, stage=0, mb=0), ev(0, "compute", "B0", 33, 40, kind="B", stage=0, mb=0)]
    split = idle_split(events, 2)
    assert split[0] == {"idle": 23, "waiting": 20, "transfer": 3, "between": 0}
    assert split[1] == {"idle": 24, "waiting": 8, "transfer": 4, "between": 12}
