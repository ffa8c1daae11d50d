"""Recomputation's price: extra forward FLOPs, peak activation bytes and time against the same run without it;
runs and models that break the rule fail the checks."""
import contextlib
import copy
import multiprocessing

import pytest
import torch

from backend.comm.spawn import spawn_ranks
from backend.experiments import RunContext
from backend.experiments.parallel.pipeline import PipelineConfig, combine, run_rank_with_peer
from backend.experiments.parallel import _recompute as recompute


def _matrix_rank(rank, world, configs, ctx):
    return [run_rank_with_peer(rank, world, c, ctx) for c in configs]


@pytest.fixture(scope="module", params=[2, 4])
def runs(request):
    p = request.param
    configs = [PipelineConfig(schedule=s, world_size=p, microbatches=4, hidden=16, batch=8, layers=2 * p, recompute=True).validate()
               for s in ("gpipe", "1f1b", "naive")]
    per_rank = spawn_ranks(_matrix_rank, p, configs, RunContext(timeout_s=240))
    assert multiprocessing.active_children() == []
    return [(c, [per_rank[r][i] for r in range(p)]) for i, c in enumerate(configs)]


def _check(result, start):
    return next(c for c in result.checks if c.name.startswith(start))


def test_recomputation_passes_its_checks_and_saves_what_the_schedule_holds(runs):
    for config, payloads in runs:
        result = combine(config, payloads)
        assert result.passed, (config.schedule, [(c.name, c.error) for c in result.checks if not c.passed])
        for start in ("forward FLOPs per micro-batch", "recomputation's extra forward FLOPs", "peak activation bytes"):
            assert _check(result, start).error == 0
        m = 1 if config.schedule == "naive" else config.microbatches
        b, h = config.batch // m, config.hidden
        for row in result.tables["recompute"]:
            held = {"gpipe": m, "1f1b": min(m, config.world_size - row["rank"]), "naive": 1}[config.schedule]
            per_mb = (config.layers // config.world_size) * b * h * 8  # the tanh outputs dropped per micro-batch
            assert row["saved_bytes"] == (held - 1) * per_mb + (held - 1) * b * h * 8 * (row["stage"] == config.world_size - 1)
            assert row["forwards"] == 2 * row["forwards_without"] == 2 * m


def test_the_flop_overhead_is_the_forward_share(runs):
    """By hand: forward 2bh²L per stage, backward twice that less stage 0's input gradient (2bh²)."""
    for config, payloads in runs:
        m = 1 if config.schedule == "naive" else config.microbatches
        b, h, L, p = config.batch // m, config.hidden, config.layers // config.world_size, config.world_size
        forward = p * 2 * b * h * h * L
        backward = p * 4 * b * h * h * L - 2 * b * h * h
        assert combine(config, payloads).metrics["recompute_flops_overhead"] == round(forward / (forward + backward), 4)


def test_a_recomputation_counted_twice_fails_the_flop_check(runs):
    config, payloads = runs[0]
    payloads = copy.deepcopy(payloads)
    forwards = payloads[-1]["price"]["with_forwards"]
    forwards.append(dict(forwards[-1]))
    assert not _check(combine(config, payloads), "recomputation's extra forward FLOPs").passed


def test_a_model_without_the_rebuilt_micro_batch_fails_the_memory_check(runs, monkeypatch):
    """k·A_in alone (forgetting that the micro-batch being back-propagated is whole again) does not match."""
    config, payloads = runs[0]
    monkeypatch.setattr(recompute, "peak_model", lambda config, layers, last, bound, flag:
                        bound * recompute.activation_model(config, layers, last)[1 if flag else 0])
    assert not _check(combine(config, payloads), "peak activation bytes").passed


class _TorchWithGradInForward:
    """torch, except that no_grad does nothing: the 'recomputing' forward keeps its whole graph."""

    def __getattr__(self, name):
        return (lambda: contextlib.nullcontext()) if name == "no_grad" else getattr(torch, name)


def _rank_keeping_the_graph(rank, world, config, ctx):
    from backend.parallel.pp import executor

    executor.torch = _TorchWithGradInForward()
    return run_rank_with_peer(rank, world, config, ctx)


def test_a_recomputation_that_keeps_the_graph_fails_the_memory_check():
    config = PipelineConfig(schedule="gpipe", world_size=2, microbatches=4, hidden=16, batch=8, layers=4, recompute=True).validate()
    payloads = spawn_ranks(_rank_keeping_the_graph, 2, config, RunContext(timeout_s=120))
    result = combine(config, payloads)
    assert not _check(result, "peak activation bytes").passed
    assert _check(result, "weights after").passed  # the arithmetic is still right: only the memory is not saved


def test_the_pipeline_page_draws_the_price():
    from tests.test_pages import _app, _recorded

    rid = _recorded("parallel.pipeline", {"schedule": "gpipe", "world_size": "2", "microbatches": "4", "hidden": "16",
                                     "batch": "8", "layers": "4", "recompute": "true"})
    at = _app("pages/pipeline.py", run=rid)
    assert not at.exception, at.exception
    assert any(h.value == "Recomputation's price" for h in at.subheader)
    assert {"extra FLOPs (counted)", "peak activations saved"} <= {m.label for m in at.metric}
    assert len(at.get("vega_lite_chart")) >= 4  # two Gantts, live activations, and the price's memory and time


def test_a_recomputation_timed_as_two_forwards_fails_the_time_check(runs, monkeypatch):
    """The time check, on the small runs here too short to time, made active: ratio 1 passes, twice the time fails."""
    monkeypatch.setattr(recompute, "MIN_TIMED_CPU_MS", 0.0)
    config, payloads = runs[0]
    payloads = copy.deepcopy(payloads)
    forwards = sorted(t for pl in payloads for t in pl["price"]["without_forward_cpu_us"])
    for pl in payloads:  # every recomputation exactly as long as the median forward (over the ranks) without it
        pl["price"]["recompute_cpu_us"] = [forwards[len(forwards) // 2]] * len(pl["price"]["recompute_cpu_us"])
    assert _check(combine(config, payloads), "a recomputation takes the time").error < 1e-9
    for pl in payloads:
        pl["price"]["recompute_cpu_us"] = [2 * t for t in pl["price"]["recompute_cpu_us"]]
    assert not _check(combine(config, payloads), "a recomputation takes the time").passed
