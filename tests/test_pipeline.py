"""Pipeline schedules: gradients vs one process at p = 2 and 4, op order vs torch.distributed.pipelining,
peak live activations vs the bound, PipeDream's weight versions, bad inputs, no process left behind."""
import dataclasses
import multiprocessing

import torch

import pytest

from backend.config import ConfigError
from backend.comm.spawn import spawn_ranks
from backend.experiments import RunContext
from backend.experiments.parallel.pipeline import PipelineConfig, combine, pipedream_seed_example, run_rank_with_peer
from backend.parallel.pp.schedules import SCHEDULES, live_activations


def _matrix_rank(rank, world, configs, ctx):
    return [run_rank_with_peer(rank, world, c, ctx) for c in configs]


def _configs(p):
    small = dict(world_size=p, hidden=16, batch=8, layers=2 * p)
    out = [PipelineConfig(schedule=s, microbatches=4, **small) for s in ("naive", "gpipe", "1f1b", "zb_h1")]
    out += [PipelineConfig(schedule="zb_v", microbatches=m, **dict(small, batch=2 * m)) for m in (1, 2 * p - 1, 2 * p + 1)]
    out += [PipelineConfig(schedule="dualpipe_v", microbatches=m, **dict(small, batch=2 * m)) for m in (2 * p, 2 * p + 1)]
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
            assert "Adam steps equal one process" in names
        if config.schedule in ("interleaved_1f1b", "zb_h1", "gpipe", "1f1b", "zb_v", "dualpipe_v"):
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


def test_a_wrong_weight_fails_the_check(matrix):
    config, payloads = next((c, p) for c, p in matrix if c.schedule == "1f1b" and not c.recompute)
    name = next(iter(payloads[0]["params"]))
    payloads[0]["params"][name] = payloads[0]["params"][name] + 1e-6
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
    ({"schedule": "dualpipe_v", "microbatches": "4", "batch": "16"}, "microbatches"),
    ({"schedule": "zb_v", "virtual_stages": "2"}, "virtual_stages"),
    ({"schedule": "zb_v", "layers": "4"}, "layers"),
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


V_SCHEDULES = {"zb_v": "ScheduleZBVZeroBubble", "dualpipe_v": "ScheduleDualPipeV"}


def _torch_runtime_order(cls_name: str, p: int, m: int, r: int) -> list[str]:
    """torch's runtime order built here from its class on stand-in stages, independently of run.torch_order."""
    from types import SimpleNamespace
    import torch.distributed.pipelining.schedules as S
    from torch.distributed.pipelining._utils import generate_rank_to_stage_mapping

    mine = generate_rank_to_stage_mapping(p, 2 * p, style="v")[r]
    stages = [SimpleNamespace(num_stages=2 * p, group_size=p, group_rank=r, submod=None, stage_index=s) for s in mine]
    out = []
    for action in getattr(S, cls_name)(stages, n_microbatches=m).pipeline_order_with_comms[r]:
        for a in action.sub_actions or (action,):
            if a.computation_type.value in ("F", "I", "B", "W"):
                out.append(str(a))
    return out


@pytest.mark.parametrize("name", list(V_SCHEDULES))
def test_v_schedules_equal_torch_runtime_order_for_every_m_it_accepts(name):
    """p in {2, 4} and every m from 1 to 4p + 3 that torch's constructor accepts (ZB-V: all; DualPipe-V: m >= 2p);
    torch's refusals are ours (the config's microbatches check)."""
    plan = SCHEDULES[name]
    for p in (2, 4):
        accepted = 0
        for m in range(1, 4 * p + 4):
            try:
                theirs = {r: _torch_runtime_order(V_SCHEDULES[name], p, m, r) for r in range(p)}
            except ValueError:
                with pytest.raises(ConfigError):
                    PipelineConfig(schedule=name, world_size=p, microbatches=m, batch=m, layers=2 * p).validate()
                continue
            accepted += 1
            PipelineConfig(schedule=name, world_size=p, microbatches=m, batch=m, layers=2 * p).validate()
            ours = plan.actions(p, m)
            assert {r: [str(a) for a in ours[r]] for r in range(p)} == theirs, (name, p, m)
            assert {s for r in range(p) for s in plan.stages_on(r, p)} == set(range(2 * p))
            assert plan.stages_on(0, p) == [0, 2 * p - 1]  # the V: the first and last stages on rank 0
        assert accepted >= 3 * p


def test_a_broken_v_order_fails_the_torch_comparison():
    """Swapping the chunks of a V (the looped placement) or deferring no W differs from torch's order."""
    from backend.parallel.pp import schedules
    plan = SCHEDULES["zb_v"]
    looped = lambda p, m, r: [a._replace(stage=3 * p - 1 - a.stage) if a.stage >= p else a for a in schedules.zb_v(p, m, r)]
    broken = dataclasses.replace(plan, order_fn=looped)
    assert any([str(a) for a in broken.actions(4, 8)[r]] != _torch_runtime_order("ScheduleZBVZeroBubble", 4, 8, r)
               for r in range(4))
    eager_w = dataclasses.replace(SCHEDULES["dualpipe_v"], order_fn=lambda p, m, r: [
        a._replace(kind="B") if a.kind == "I" else a for a in schedules.dualpipe_v(p, m, r) if a.kind != "W"])
    assert any([str(a) for a in eager_w.actions(2, 4)[r]] != _torch_runtime_order("ScheduleDualPipeV", 2, 4, r)
               for r in range(2))


def test_v_schedules_live_bounds_and_bubble():
    """ZB-V holds 1F1B's peak (2p chunk activations) on every rank, DualPipe-V 2p + 1; with F = I = W a replay of
    the order at unit costs idles p - 1 units per rank, the formula's (p-1)/(6m+p-1)."""
    for p in (2, 3, 4):
        for m in (2 * p, 3 * p + 1):
            for name, bound in (("zb_v", 2 * p), ("dualpipe_v", 2 * p + 1)):
                plan = SCHEDULES[name]
                orders = plan.actions(p, m)
                assert [live_activations(orders[r]) for r in range(p)] == [bound] * p
                span = _unit_replay(orders, plan, p)
                assert abs((span - 6 * m) / span - plan.bubble(p, m)) < 1e-12, (name, p, m, span)


def _unit_replay(orders, plan, p) -> float:
    """Makespan of the orders with every F, I and W one unit (B two): a rank waits for the F of the stage before and
    the backward of the stage after, each stage on plan.rank_of."""
    done, t, ptr, S = {}, [0.0] * p, [0] * p, 2 * p
    while any(ptr[r] < len(orders[r]) for r in range(p)):
        moved = False
        for r in range(p):
            while ptr[r] < len(orders[r]):
                kind, mb, s = orders[r][ptr[r]]
                dep = ("F", s - 1, mb) if kind == "F" and s > 0 else (("B", s + 1, mb) if kind in "IB" and s < S - 1 else None)
                if dep is not None and dep not in done:
                    break
                assert plan.rank_of(s, p) == r
                t[r] = max(t[r], done.get(dep, 0.0)) + (2.0 if kind == "B" else 1.0)
                done[("F" if kind == "F" else ("W" if kind == "W" else "B"), s, mb)] = t[r]
                ptr[r] += 1
                moved = True
        assert moved, "deadlock"
    return max(t)


class _Counted(torch.autograd.Function):
    """Identity whose backward counts its calls: a stand-in for a collective inside a stage's backward (TP's f)."""
    calls = 0

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        _Counted.calls += 1
        return grad


class _Stage:
    def __init__(self, s, xs, ys):
        torch.manual_seed(s)
        self.index, self.last, self.xs, self.ys = s, s == 1, xs, ys
        self.module = torch.nn.Sequential(torch.nn.Linear(4, 4, dtype=torch.float64), torch.nn.Tanh(),
                                          torch.nn.Linear(4, 4, dtype=torch.float64))

    def input(self, mb):
        return self.xs[mb].clone()

    def input_like(self, mb):
        return torch.empty_like(self.xs[mb])

    def forward(self, x, mb):
        out = self.module[2](_Counted.apply(self.module[1](self.module[0](x))))
        return ((out - self.ys[mb]) ** 2).sum() if self.last else out


def _walk(name, m=3):
    """ZB-V / DualPipe-V on one rank (both chunks there, handed over in memory): the gradients and the counted calls."""
    from backend.parallel.pp.executor import execute
    from backend.trace import Tracer
    g = torch.Generator().manual_seed(1)
    xs, ys = torch.randn(m, 2, 4, generator=g, dtype=torch.float64), torch.randn(m, 2, 4, generator=g, dtype=torch.float64)
    stages = {s: _Stage(s, xs, ys) for s in (0, 1)}
    plan = SCHEDULES[name]
    _Counted.calls = 0
    execute(plan.actions(1, m)[0], plan, stages, [0], 0, 1, m, Tracer(0))
    calls = _Counted.calls
    got = [p.grad.clone() for s in (0, 1) for p in stages[s].module.parameters()]
    ref = {s: _Stage(s, xs, ys) for s in (0, 1)}
    for mb in range(m):
        ref[1].forward(ref[0].forward(xs[mb], mb), mb).backward()
    want = [p.grad for s in (0, 1) for p in ref[s].module.parameters()]
    return max((a - b).abs().max().item() for a, b in zip(got, want)), calls


@pytest.mark.parametrize("name", ["zb_v", "dualpipe_v"])
def test_split_backward_equals_one_backward_and_w_repeats_no_input_gradient_work(name):
    """I then W (torch's stage_backward_input / stage_backward_weight) give the full backward's gradients, and the
    counted node before the weights runs once per stage and micro-batch (2m): a W that reran the backward from the
    output (the executor before this change) runs it again, and fails (below)."""
    err, calls = _walk(name, m=2)
    assert err < 1e-12 and calls == 2 * 2


def test_a_w_that_reruns_the_backward_fails(monkeypatch):
    import torch.distributed.pipelining._backward as B

    def rerun_input(outputs, grads, inputs, weights):
        (dx,) = torch.autograd.grad(outputs, inputs, grads, retain_graph=True)
        inputs[0].grad = dx
        return (dx,), [{"outputs": outputs, "grads": grads}]

    def rerun_weight(weights, groups):
        torch.autograd.backward(groups[0]["outputs"], groups[0]["grads"])  # the whole backward again

    monkeypatch.setattr(B, "stage_backward_input", rerun_input)
    monkeypatch.setattr(B, "stage_backward_weight", rerun_weight)
    err, calls = _walk("zb_v", m=2)
    assert calls > 2 * 2  # the counted node ran again in W


def test_idle_split_on_a_hand_timed_trace():
    """Two ranks, one micro-batch, times in µs worked out by hand: rank 1's recv of the activation starts at 2, the
    data is ready at 10 (rank 0's F ends), it returns at 14: 8 waiting, 4 transfer; its idle (40 - 16) leaves 12
    between. Rank 0's recv of the gradient starts at 10, the gradient is ready at 30 (rank 1's B), it returns at 33."""
    from backend.experiments.parallel.pipeline import idle_split

    def ev(rank, lane, name, ts, end, **args):
        return {"rank": rank, "lane": lane, "name": name, "ts": ts, "dur": end - ts, "args": args}

    events = [ev(0, "compute", "F0", 0, 10, kind="F", stage=0, mb=0), ev(1, "recv", "recv act 0", 2, 14, stage=0, mb=0),
              ev(1, "compute", "F0", 14, 20, kind="F", stage=1, mb=0), ev(1, "compute", "B0", 20, 30, kind="B", stage=1, mb=0),
              ev(0, "recv", "recv grad 0", 10, 33, stage=1, mb=0), ev(0, "compute", "B0", 33, 40, kind="B", stage=0, mb=0)]
    split = idle_split(events, 2)
    assert split[0] == {"idle": 23, "waiting": 20, "transfer": 3, "between": 0}
    assert split[1] == {"idle": 24, "waiting": 8, "transfer": 4, "between": 12}


def _rank_with_the_loss_share_doubled(rank, world, config, ctx):
    """The pipeline's rank whose stages weight the loss by twice the micro-batch's share of the batch's mean."""
    from backend.experiments.parallel import _linear_stack as linear

    init = linear.LinearStage.__init__

    def doubled(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.scale *= 2
    linear.LinearStage.__init__ = doubled
    return run_rank_with_peer(rank, world, config, ctx)


def test_a_loss_share_off_by_two_fails_the_training_checks():
    """The loss off by 2 (and so every gradient): each step's loss is twice one process's, and Adam, though it all but
    cancels a constant factor, leaves the weights further than the tolerance through its eps."""
    config = PipelineConfig(schedule="1f1b", world_size=2, microbatches=4, hidden=16, batch=8, layers=4).validate()
    result = combine(config, spawn_ranks(_rank_with_the_loss_share_doubled, 2, config, RunContext(timeout_s=120)))
    failed = {c.name.split(" ")[0] for c in result.checks if not c.passed}
    assert failed == {"each", "weights"}, failed
