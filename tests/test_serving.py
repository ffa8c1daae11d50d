"""The serving engine and its simulator: tokens equal single-request decoding under every policy, the CPU
attention path equals the Triton kernel, the simulator replays the engine's schedule, decode runs
equal single steps, the cost-model fit recovers a known answer, fidelity on a small held-out trace,
and bad settings."""
import dataclasses
import json
from pathlib import Path

import numpy as np

import pytest
import torch

from backend import experiments
from backend.config import ConfigError
from backend.serving import attention
from backend.serving.calibrate import calibrate, replay_mismatches
from backend.serving.schema import BENCH_ENGINE_SPREAD, BENCH_REQUESTS, BENCH_WORST_ERROR
from backend.experiments.serving.engine import LOGITS_TOL
from backend.serving.engine import ModelExecutor, logits_error, serve, serve_interleaved, tiny_llama, token_mismatches
from backend.serving.scheduler import Scheduler, SchedulerConfig, StepLog
from backend.serving.simulator import TERMS, CostModel, CostModelExecutor, ReplayExecutor, features, fidelity, latency_summary, simulate
from backend.serving.workload import shared_prefix, sharegpt_like
from backend.store import RunStore
from tests.conftest import REPO


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    return tiny_llama(0)


def small(seed=1, n=10, rate=50.0):
    return sharegpt_like(n, rate, seed, prompt_median=24, output_median=12, max_len=96)


POLICIES = {  # name: (config, trace, what must have happened)
    "chunked": (SchedulerConfig(token_budget=32), small(), "chunks"),
    "fcfs": (SchedulerConfig(chunked_prefill=False, token_budget=256), small(), ""),
    "prefix caching": (SchedulerConfig(prefix_caching=True, num_blocks=64),
                       shared_prefix(10, 50.0, 1, prefix_len=40, question_median=8, output_median=8, max_len=96), "hits"),
    "recompute": (SchedulerConfig(num_blocks=12, block_size=8, token_budget=64, preemption="recompute"), small(2, 12), "preempted"),
    "swap": (SchedulerConfig(num_blocks=12, block_size=8, token_budget=64, preemption="swap"), small(2, 12), "preempted"),
    "fcfs + swap": (SchedulerConfig(num_blocks=12, block_size=8, chunked_prefill=False, token_budget=256, preemption="swap"),
                    small(2, 12), "preempted"),
}


@pytest.mark.parametrize("policy", POLICIES)
def test_engine_tokens_equal_single_request_greedy_decoding(model, policy):
    config, trace, expect = POLICIES[policy]
    sched = serve(model, trace, config)
    assert token_mismatches(model, sched) == []
    sched.m.check_invariants()
    if expect == "preempted":
        assert sched.preemptions.sum() > 0
    if expect == "hits":
        assert sched.m.stats.prefix_hit_tokens > 0
    if expect == "chunks":
        assert (sched.log.table()["prefill_tokens"] == 32).any()  # a prompt longer than the budget was split


class WrongTables(attention.TorchPagedAttention):
    """A deliberately wrong variant: every sequence reads the block table of the next one."""

    def __init__(self, tables, seq, pos, block_size):
        super().__init__(tables.roll(1, 0), seq, pos, block_size)


def test_token_check_catches_a_wrong_attention(model):
    sched = serve(model, small(), SchedulerConfig(), attention=WrongTables)
    assert len(token_mismatches(model, sched)) > 0


def test_cpu_attention_equals_triton_kernel_and_reference():
    q, pool, tables, seq, pos = attention.mixed_batch(seed=3)
    ours = attention.TorchPagedAttention(tables, seq, pos, pool.shape[2])(q, pool)
    kernel = attention.TritonPagedAttention(tables, seq, pos, pool.shape[2])(q, pool)
    reference = attention.paged_attention_reference(q, pool, tables, seq, pos)
    assert (ours - kernel).abs().max() < 1e-5
    assert (ours - reference).abs().max() < 1e-5
    shifted = attention.paged_attention_reference(q, pool, tables, seq, torch.clamp(pos - 1, min=0))
    assert (ours - shifted).abs().max() > 1e-2  # the comparison sees an off-by-one causal mask


def test_simulator_given_engine_step_times_makes_the_same_schedule(model):
    config, trace, _ = POLICIES["recompute"]
    real = serve(model, trace, config, record_batches=True)
    assert replay_mismatches(real) == 0
    times = real.log.table()["time"]
    slower = Scheduler(trace, config, record_batches=True).run(ReplayExecutor(list(times * 5)))
    assert any(not np.array_equal(a[0], b[0]) for a, b in zip(real.batches, slower.batches)) or \
        len(real.batches) != len(slower.batches)  # other step times do change the schedule


COST = CostModel(0.0040, 9.8e-5, 3.1e-4, 2e-5, 2.5e-3, 3e-3, noise=tuple(np.linspace(-0.25, 0.35, 64)),
                 drift_share=0.4, drift_persistence=0.8, slow_drift_share=0.2, slow_drift_persistence=0.995)  # noise: drawn alike both ways


@pytest.mark.parametrize("config, trace", [
    (SchedulerConfig(), sharegpt_like(600, 10.0, 3)),
    (SchedulerConfig(chunked_prefill=False, num_blocks=48, preemption="swap"), sharegpt_like(300, 30.0, 3)),
    (SchedulerConfig(prefix_caching=True, num_blocks=64), shared_prefix(300, 20.0, 4)),
    (SchedulerConfig(num_blocks=40, max_batch=32, token_budget=64), sharegpt_like(300, 30.0, 5)),
])
def test_decode_runs_equal_the_step_by_step_schedule(config, trace, monkeypatch):
    monkeypatch.setattr(StepLog, "FLUSH_EVERY", 5)  # the log joins its steps and runs often: their order must survive it
    in_runs, decode_run = [], Scheduler.decode_run

    def counted(*args, **kwargs):
        now, steps = decode_run(*args, **kwargs)
        in_runs.append(steps)
        return now, steps

    monkeypatch.setattr(Scheduler, "decode_run", counted)
    fast, slow = simulate(trace, config, COST), simulate(trace, config, COST, step_by_step=True)
    assert sum(in_runs) >= 50  # runs were taken (else the two are trivially equal)
    assert len(fast.log) == len(slow.log)
    assert np.array_equal(fast.first_token, slow.first_token) and np.array_equal(fast.finish, slow.finish)
    a, b = fast.log.table(), slow.log.table()
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert fast.m.stats == slow.m.stats
    fast.m.check_invariants()


def test_a_runs_own_noise_path_gives_its_figures_back():
    """bench/serving.py's decomposition: fed a run's residuals (step time less the model's mean) as its noise, the
    simulator retakes that run's steps, decode runs included, and so its latencies."""
    trace = sharegpt_like(300, 10.0, 7)
    drawn = simulate(trace, SchedulerConfig(), COST, noise_seed=3)
    steps = drawn.log.table()
    again = simulate(trace, SchedulerConfig(), COST, noise_path=COST.relative_residuals(steps))
    assert len(again.log) == len(drawn.log) and np.allclose(again.finish, drawn.finish, rtol=1e-9)
    residuals = steps["time"] - COST.predict_steps(steps)
    assert COST.step_error(steps) == pytest.approx(-residuals.mean() / steps["time"].mean())


def test_swap_steps_are_charged_the_measured_copy_cost_per_block(model):
    config = SchedulerConfig(chunked_prefill=False, num_blocks=48, preemption="swap")
    trace = sharegpt_like(300, 30.0, 3)
    exact = dataclasses.replace(COST, noise=(), per_swapped_block=2e-3)  # no noise: each step's time is its mean
    sched = simulate(trace, config, exact, step_by_step=True)
    log = sched.log.table()
    swaps = [e["blocks"] for e in sched.m.events if e["op"] in ("swap-out", "swap-in")]
    assert swaps and log["swapped_blocks"].sum() == sum(swaps)  # every block copied, out or in, is counted once
    predicted = exact.predict(log["prefill_tokens"], log["decode_tokens"], log["kv_blocks"], log["swapped_blocks"])
    assert np.allclose(log["time"], predicted, rtol=1e-12)
    free = exact.predict(log["prefill_tokens"], log["decode_tokens"], log["kv_blocks"])
    assert np.allclose(log["time"] - free, 2e-3 * log["swapped_blocks"])
    per_block = ModelExecutor(model, config).swap_seconds_per_block()
    assert 0 < per_block < 1e-3  # a 16 KiB block copied in RAM: microseconds, on the engine's clock
    steps = dict(log, time=free + per_block * log["swapped_blocks"])  # the fit takes the measured copies off
    fit = CostModel.fit(steps, noise=False, per_swapped_block=per_block)
    assert fit.per_swapped_block == per_block and fit.rmse < 1e-12
    assert np.allclose(fit.predict(log["prefill_tokens"], log["decode_tokens"], log["kv_blocks"]), free, rtol=1e-9)


def test_prefill_chunks_count_the_pairs_their_attention_scores():
    trace = dataclasses.replace(small(n=1), prompt_len=np.array([40]), output_len=np.array([3]))
    log = simulate(trace, SchedulerConfig(token_budget=16), COST, step_by_step=True).log.table()
    # chunks 0-16, 16-32, 32-40 of 16-token blocks: each chunk's queries against its context in whole blocks (16, 32,
    # 48 keys), masked or not; then two decodes, which attend over KV blocks instead
    assert log["prefill_pairs"].tolist() == [16 * 16, 16 * 32, 8 * 48, 0, 0]
    assert log["prefill_tokens"].tolist() == [16, 16, 8, 0, 0]
    # Two chunks in one step: both padded to the longer chunk and to the wider context.
    two = dataclasses.replace(small(n=2), arrival=np.array([0.0, 0.0]), prompt_len=np.array([20, 7]), output_len=np.array([2, 2]))
    first = simulate(two, SchedulerConfig(block_size=4), COST, step_by_step=True).log.table()
    assert first["prefill_pairs"][0] == 2 * 20 * 20 and first["prefill_tokens"][0] == 27


def test_the_engines_prefill_attention_scores_the_pairs_the_step_counts():
    """The count is the engine's own work: its chunk SDPA's score matrix has exactly that many entries."""
    q, pool, tables, seq, pos = attention.mixed_batch(block_size=4)  # chunks of 7 and 4 tokens, to positions 6 and 12
    paged = attention.TorchPagedAttention(tables, seq, pos, 4)
    assert tables.shape[1] * 4 == 16 and paged.mask.numel() == 2 * 7 * 16  # 2 chunks x 7 queries x 4 blocks of keys
    wide = torch.cat([tables, tables[:, :2]], 1)  # a batch whose longest sequence is longer than any chunk's reach
    assert attention.TorchPagedAttention(wide, seq, pos, 4).mask.numel() == 2 * 7 * 16
    assert torch.allclose(attention.TorchPagedAttention(wide, seq, pos, 4)(q, pool),
                          attention.paged_attention_reference(q, pool, tables, seq, pos), atol=1e-5)


def test_cost_model_fit_recovers_a_known_answer():
    rng = np.random.default_rng(0)
    n = 400
    steps = {"prefill_tokens": rng.integers(0, 256, n).astype(float), "decode_tokens": rng.integers(0, 32, n).astype(float),
             "kv_blocks": rng.integers(0, 200, n).astype(float)}
    steps["prefill_pairs"] = steps["prefill_tokens"] * rng.integers(1, 256, n)  # chunks at various context lengths
    truth = CostModel(0.004, 5e-5, 3e-4, 1e-5, per_prefill_pair=2e-9, per_batched_decode_step=3e-4)
    steps["time"] = truth.predict(steps["prefill_tokens"], steps["decode_tokens"], steps["kv_blocks"],
                                  prefill_pairs=steps["prefill_pairs"])
    exact = CostModel.fit(steps)
    for name in ("intercept", "per_prefill_token", "per_decode_token", "per_kv_block", "per_prefill_pair", "per_batched_decode_step"):
        assert getattr(exact, name) == pytest.approx(getattr(truth, name), rel=1e-9)
    assert exact.r2 == pytest.approx(1.0) and exact.rmse < 1e-12
    steps["time"] = steps["time"] * rng.normal(1, 0.02, n)  # 2% noise: still close, and the error is reported
    noisy = CostModel.fit(steps)
    assert noisy.per_prefill_token == pytest.approx(truth.per_prefill_token, rel=0.05)
    assert 0.005 < noisy.mape < 0.04


def test_designed_steps_split_what_the_runs_move_together():
    """In the runs every decode token reads three KV blocks, so the runs alone cannot split a step's cost between
    the two; designed steps (their own offset: they skip the scheduler's bookkeeping) settle it, and only the runs'
    steps make the fit's error and noise."""
    rng = np.random.default_rng(1)
    truth = CostModel(0.004, 5e-5, 3e-4, 2e-5, per_prefill_pair=1e-8)
    decode = rng.integers(1, 16, 300).astype(float)
    runs = {"prefill_tokens": np.zeros(300), "decode_tokens": decode, "kv_blocks": 3 * decode, "prefill_pairs": np.zeros(300)}
    runs["time"] = truth.predict(0, decode, 3 * decode) + rng.normal(0, 1e-4, 300)
    grid = np.array([(b, b * n) for b in (1, 4, 16) for n in (1, 8)] * 3, dtype=float)
    designed = {"prefill_tokens": np.zeros(len(grid)), "decode_tokens": grid[:, 0], "kv_blocks": grid[:, 1],
                "prefill_pairs": np.zeros(len(grid))}
    designed["time"] = truth.predict(0, grid[:, 0], grid[:, 1]) - 0.001  # 1 ms less: no bookkeeping
    alone, split = CostModel.fit(runs), CostModel.fit(runs, designed=designed)
    assert abs(alone.per_kv_block / truth.per_kv_block - 1) > 0.5  # without them the split is arbitrary
    assert alone.per_decode_token + 3 * alone.per_kv_block == pytest.approx(truth.per_decode_token + 3 * truth.per_kv_block, rel=0.05)
    assert split.per_decode_token == pytest.approx(truth.per_decode_token, rel=0.02)
    assert split.per_kv_block == pytest.approx(truth.per_kv_block, rel=0.05)
    assert split.intercept + split.per_decode_step == pytest.approx(truth.intercept, rel=0.02)  # the offset stays out
    assert split.steps == 300 and split.designed_steps == len(grid) and split.rmse == pytest.approx(1e-4, rel=0.1)  # the runs' fit error, not the grid's


def test_designed_steps_are_counted_as_the_scheduler_counts_a_step(model):
    """A designed step's features are those the scheduler would log for that batch: the same simulator terms."""
    config = SchedulerConfig(block_size=16, num_blocks=40, max_batch=8, token_budget=64)
    rows = ModelExecutor(model, config).designed_steps(config, repeats=1)
    decode, chunk = rows["decode_tokens"] > 0, rows["prefill_tokens"] > 0
    assert (decode ^ chunk).all() and (rows["time"] > 0).all() and rows["decode_tokens"].max() <= 8
    assert rows["kv_blocks"].max() <= 40 and rows["prefill_tokens"].max() <= 64
    for tokens, kv, pairs in zip(rows["prefill_tokens"][chunk], rows["kv_blocks"][chunk], rows["prefill_pairs"][chunk]):
        cached = (kv * 16 - tokens) // 16 * 16  # the designed chunks start at a block boundary
        trace = dataclasses.replace(small(n=1), prompt_len=np.array([int(cached + tokens)]), output_len=np.array([1]))
        sched = Scheduler(trace, dataclasses.replace(config, token_budget=int(max(cached, tokens))), record_batches=True)
        sched.run(CostModelExecutor(COST))
        log = sched.log.table()
        assert (log["prefill_tokens"][-1], log["kv_blocks"][-1], log["prefill_pairs"][-1]) == (tokens, kv, pairs)


def test_cost_model_coefficients_stay_non_negative_when_terms_move_together():
    rng = np.random.default_rng(1)
    decode = rng.integers(1, 16, 300).astype(float)
    kv = decode * 5 + rng.normal(0, 0.5, 300)  # KV blocks follow the decode count: a free fit trades one against the other
    steps = {"prefill_tokens": np.zeros(300), "decode_tokens": decode, "kv_blocks": kv,
             "time": 0.005 + 4e-4 * decode + rng.normal(0, 2e-4, 300)}
    X = np.column_stack(features(steps["prefill_tokens"], decode, kv))  # every term, unconstrained
    free = np.linalg.lstsq(X, steps["time"], rcond=None)[0]
    fit = CostModel.fit(steps)
    assert min(fit.intercept, fit.per_prefill_token, fit.per_decode_token, fit.per_kv_block) >= 0
    assert fit.rmse >= np.sqrt(np.mean((X @ free - steps["time"]) ** 2)) - 1e-12  # the constraint costs fit, never gains it


@pytest.mark.serial  # the engine's own repeat is the yardstick: another test's ranks on the same 2 cores blur it
def test_fidelity_on_a_small_held_out_trace(model):
    """Not skipped in CI: the engines run interleaved (each sees the same machine), and the tolerances are
    stated from what a trace this small allows on a shared 2-core machine: medians and throughput within 20%
    (or twice the engine's own run-to-run spread, as the run's check, if wider), the p90s (the 3rd largest of
    24 requests) within 35%. Measured at load 12: errors up to 15% and 23%, and the engine differing from
    itself by up to 21% on a median. bench/serving.py holds the full figure on 320-request traces. A simulator
    whose steps take twice as long fails the median bound, so the test tells a right model from a wrong one.
    Where the engine differs from itself by 37.5% or more the machine is too noisy to judge: measured again, 3 tries."""
    judged = 0.75  # widest bound at which the test still means something (the engine repeating itself within 37.5%)
    for _ in range(3):  # a burst of noise from outside the VM can blur one measurement; then measure again
        cal = calibrate(model, SchedulerConfig(), [sharegpt_like(12, 8.0, 1000), sharegpt_like(12, 16.0, 1001)],
                        sharegpt_like(24, 8.0, 0))
        spread = max(abs(v) for v in cal.repeat.values())
        if 2 * spread < judged:
            break
    central = ("ttft_p50", "tpot_p50", "throughput_tok_s")
    bound = max(0.20, 2 * spread)
    assert bound < judged, cal.repeat  # the engine repeats itself well enough for the test to mean something
    assert max(abs(cal.fidelity[k]) for k in central) <= bound, (cal.fidelity, cal.repeat)
    assert max(abs(cal.fidelity[k]) for k in ("ttft_p90", "tpot_p90")) <= max(0.35, 2 * spread), (cal.fidelity, cal.repeat)
    assert cal.checks()[0].passed  # the replayed schedule
    assert "Fidelity, simulated vs real" in cal.fidelity_note() and cal.tolerance() >= BENCH_WORST_ERROR  # reported on every run
    slow = dataclasses.replace(cal.cost, **{t: 2 * getattr(cal.cost, t) for t in TERMS})
    wrong = fidelity(cal.real_summary, latency_summary(simulate(cal.real.trace, cal.real.config, slow)))
    assert max(abs(wrong[k]) for k in central) > bound, (wrong, cal.repeat)


def test_the_tolerance_basis_is_the_benchmarks_committed_worst_figure():
    import json
    from pathlib import Path

    bench = json.loads((Path(__file__).parent.parent / "bench" / "results" / "serving.json").read_text())
    assert {f["requests"] for f in bench["fidelity"]} == {BENCH_REQUESTS}
    assert BENCH_WORST_ERROR == pytest.approx(max(f["worst"] for f in bench["fidelity"]), abs=5e-4)
    assert BENCH_ENGINE_SPREAD == pytest.approx(max(f["engine_spread"] for f in bench["fidelity"]), abs=5e-4)


def drifting(n, parts, rng):
    """n steps of unit-variance noise: AR(1) drifts (share, persistence) plus independent noise in the rest."""
    z = np.sqrt(1 - sum(share for share, _ in parts)) * rng.standard_normal(n)
    for share, phi in parts:
        level, x = 0.0, np.empty(n)
        for i in range(n):
            level = phi * level + rng.normal(0, np.sqrt(1 - phi ** 2))
            x[i] = level
        z += np.sqrt(share) * x
    return z


def random_steps(n, rng):
    steps = {"prefill_tokens": rng.integers(0, 64, n).astype(float), "decode_tokens": rng.integers(1, 16, n).astype(float),
             "kv_blocks": rng.integers(1, 80, n).astype(float)}
    steps["mean"] = COST.predict(steps["prefill_tokens"], steps["decode_tokens"], steps["kv_blocks"])
    return steps


def halves(steps, n):
    return [{k: v[:n // 2] for k, v in steps.items()}, {k: v[n // 2:] for k, v in steps.items()}]


def test_cost_model_noise_keeps_the_residuals_distribution_and_drift():
    """The noise table has the fitted relative quantiles' distribution and the fitted drift's autocorrelation."""
    rng = np.random.default_rng(2)
    steps, noise = random_steps(4000, rng), 0.2 * drifting(4000, [(0.6, 0.9)], rng)
    steps["time"] = steps["mean"] * (1 + noise)
    fit = CostModel.fit(halves(steps, 4000))
    lags = np.array([1, 5, 10, 20])
    assert fit.autocorrelation(lags) == pytest.approx(0.6 * 0.9 ** lags, abs=0.08)
    table = fit.noise_table()
    assert np.quantile(table, 0.9) == pytest.approx(np.quantile(noise, 0.9), rel=0.1)
    assert np.corrcoef(table[:-1], table[1:])[0, 1] == pytest.approx(0.6 * 0.9, abs=0.08)
    flat = CostModel.fit({**steps, "time": steps["mean"] * (1 + 0.2 * rng.standard_normal(4000))})
    assert flat.autocorrelation([1])[0] < 0.1  # independent noise shows no drift
    steps["time"][123] += 0.17  # one 170 ms stall (the machine's, seen in a profile) stays one step's worth of noise
    stalled = CostModel.fit(steps).noise_table()
    assert stalled.max() < 1.0 and abs(stalled.mean() - table.mean()) < 0.02
    # A paced profile steps in bursts (20 rounds of every 50): paired by rounds, the drift's persistence per round is
    # still found; paired by step index it would read lower (a step after a pause is further from the one before).
    taken = np.concatenate([np.arange(start, start + 20) for start in range(0, 4000, 50)])
    paced = CostModel.fit({k: v[taken] for k, v in steps.items()}, rounds=[taken])
    assert paced.autocorrelation(lags) == pytest.approx(0.6 * 0.9 ** lags, abs=0.1)


def test_cost_model_noise_has_a_slow_drift_beside_the_fast_one():
    """The machine's speed moves on two time scales (bench/serving.py: an autocorrelation still 0.15 at lag 80):
    both drifts are found, and the table keeps the slow one's long reach, which one AR(1) fitted near lag 1 loses."""
    rng = np.random.default_rng(5)
    n, parts = 24000, [(0.35, 0.7), (0.3, 0.995)]
    steps, noise = random_steps(n, rng), 0.2 * drifting(n, parts, rng)
    steps["time"] = steps["mean"] * (1 + noise)
    fit = CostModel.fit(halves(steps, n))
    assert fit.slow_drift_share == pytest.approx(0.3, abs=0.1) and fit.slow_drift_persistence > 0.98
    lags = np.array([1, 3, 10, 40, 80])
    truth = sum(share * phi ** lags for share, phi in parts)
    assert fit.autocorrelation(lags) == pytest.approx(truth, abs=0.07)
    table = fit.noise_table()
    for lag, expected in zip(lags, truth):
        assert np.corrcoef(table[:-lag], table[lag:])[0, 1] == pytest.approx(expected, abs=0.08)


def test_the_noise_is_relative_to_the_steps_predicted_time():
    """Residuals whose spread grows with the step (as measured: about 22% of the predicted time for steps of 4.5 to
    13 ms) give a noise a long step takes in proportion: its spread over its mean is a short step's."""
    rng = np.random.default_rng(3)
    steps = random_steps(4000, rng)
    steps["time"] = steps["mean"] * (1 + 0.2 * rng.standard_normal(4000))
    fit = CostModel.fit(steps)
    executor = CostModelExecutor(fit)
    short = executor.decode_times(0, np.full(20000, 1.0), np.full(20000, 1.0))
    long = executor.decode_times(0, np.full(20000, 16.0), np.full(20000, 80.0))
    assert long.mean() > 1.7 * short.mean()
    assert long.std() / long.mean() == pytest.approx(short.std() / short.mean(), rel=0.03)
    assert short.std() / short.mean() == pytest.approx(0.2, rel=0.1)


def test_a_paced_engine_spreads_its_steps_over_its_leads_rounds(model):
    """The profile keeps pace with the held-out run (calibrate's use): its steps meet the machine of the whole run,
    not only of its first rounds, and its tokens are still the model's."""
    lead, short = small(3, 32, 20.0), small(4, 4, 20.0)
    config = SchedulerConfig(token_budget=64)
    free, paced, led = serve_interleaved(model, [(short, config, False), (short, config, False), (lead, config, False)],
                                         pace_with=[None, 2, None])
    end = led.rounds[-1]
    assert free.rounds == list(range(len(free.rounds))) and free.rounds[-1] < end / 2  # run at once: done early
    assert paced.rounds[-1] > 0.8 * end  # paced: to near the lead's end
    assert token_mismatches(model, paced) == []


@pytest.mark.parametrize("name, values, field", [
    ("serving.engine", {"block_size": "12"}, "block_size"),
    ("serving.engine", {"max_batch": "300", "token_budget": "256"}, "max_batch"),
    ("serving.engine", {"policy": "fcfs", "token_budget": "64"}, "token_budget"),
    ("serving.engine", {"num_blocks": "10"}, "num_blocks"),
    ("serving.engine", {"workload": "burst"}, "workload"),
    ("serving.simulate", {"rate": "0"}, "rate"),
    ("serving.simulate", {"n_requests": "2000000"}, "n_requests"),
    ("serving.simulate", {"preemption": "drop"}, "preemption"),
])
def test_bad_settings_name_the_field(name, values, field):
    with pytest.raises(ConfigError) as info:
        experiments.get(name).make_config(values)
    assert info.value.field == field


def test_bad_traces_are_refused():
    with pytest.raises(ValueError, match="n >= 1"):
        sharegpt_like(0, 1.0)
    with pytest.raises(ValueError, match="rate > 0"):
        shared_prefix(5, 0.0)


def test_a_request_that_never_fits_is_reported_not_looped_on():
    trace = dataclasses.replace(small(n=2), prompt_len=np.array([60, 10]), output_len=np.array([6, 6]))
    with pytest.raises(RuntimeError, match="never be scheduled"):
        simulate(trace, SchedulerConfig(num_blocks=4, block_size=16), COST)


UPLOADED = "arrival,prompt_len,output_len,prefix_id,prefix_len\n0,40,6,0,32\n25,20,5,-1,0\n10,36,4,0,32\n"


def test_an_uploaded_trace_is_served_and_simulated(model, tmp_path, monkeypatch):
    """Uploaded as the kvcache page's traces are (BOM-tolerant, capped, named by content hash); arrivals in ms."""
    from backend import uploads

    monkeypatch.setenv("EXPLORER_DATA_DIR", str(tmp_path))
    digest = uploads.save_trace(("\ufeff" + UPLOADED).encode())
    config = experiments.get("serving.simulate").make_config({"trace": digest, "prefix_caching": "true"})
    trace = config.requests(10, seed=0)
    assert trace.arrival.tolist() == [0.0, 0.010, 0.025] and trace.prompt_len.tolist() == [40, 36, 20]  # in arrival order
    assert trace.prompt(0)[:32] == trace.prompt(1)[:32] != trace.prompt(2)[:32]  # the shared prefix
    served = serve(model, trace, config.scheduler_config())
    assert token_mismatches(model, served) == [] and served.m.stats.prefix_hit_tokens == 32
    assert np.array_equal(simulate(trace, config.scheduler_config(), COST).generated, trace.output_len)


@pytest.mark.parametrize("csv, message", [
    ("arrival,prompt_len,output_len\n0,200,100\n", "300 tokens, prompt and output (allowed: prompt_len + output_len <= 256"),
    (None, "no uploaded trace has this hash"),
])
def test_a_bad_uploaded_trace_names_the_trace_field(tmp_path, monkeypatch, csv, message):
    from backend import uploads

    monkeypatch.setenv("EXPLORER_DATA_DIR", str(tmp_path))
    digest = uploads.save_trace(csv.encode()) if csv else "0" * 64
    with pytest.raises(ConfigError) as info:
        experiments.get("serving.engine").make_config({"trace": digest})
    assert info.value.field == "trace" and message in str(info.value)
    with pytest.raises(ConfigError, match="is not a trace name"):
        experiments.get("serving.simulate").make_config({"trace": "/etc/passwd"})


def test_the_page_draws_a_default_engine_run_with_every_check_passed():
    """The defaults pass their checks (fidelity included: its yardstick is the engine's own spread) and the page draws."""
    from tests.sweep import render_recorded

    at = render_recorded("pages/serving.py", "serving.engine")
    assert any("a bigger run" in m.value for m in at.markdown)
    run_id = at.query_params["run"][0] if isinstance(at.query_params["run"], list) else at.query_params["run"]
    stored = json.loads(Path(RunStore().get(run_id).result_path).read_text())
    assert _shares_off(stored["tables"]["latency"]) < 1e-12  # the CDFs drawn are the result's


def _shares_off(rows: list[dict]) -> float:
    """The largest gap between the latency rows' shares and pandas' empirical CDF: rank(method="max", pct=True) per
    source over the requests with a value (the share no larger, ties together, as Vega's cume_dist)."""
    import pandas as pd

    t, gap = pd.DataFrame(rows), 0.0
    for field in ("ttft", "tpot", "e2e"):
        has = t[t[field].notna()]
        ref = has.groupby("source")[field].rank(method="max", pct=True)
        gap = max(gap, float((has[f"{field}_share"] - ref).abs().max()))
        assert t.loc[t[field].isna(), f"{field}_share"].isna().all()
    return gap


def test_the_latency_cdfs_come_from_the_result_and_old_runs_gain_them(monkeypatch):
    """A real run stored before the shares (tests/data/old_results) gains them by the upgrade, equal to pandas'; a share
    counting only strictly smaller values fails."""
    from backend.serving import report

    old = json.loads((REPO / "tests" / "data" / "old_results" / "serving.engine.json").read_text())
    assert "ttft_share" not in old["tables"]["latency"][0]
    schema = experiments.get("serving.engine").schema
    assert _shares_off(schema.upgrade(old)["tables"]["latency"]) < 1e-12

    def strictly_smaller(rows, fields=("ttft", "tpot", "e2e")):
        for field in fields:
            for r in rows:
                same = [q[field] for q in rows if q["source"] == r["source"] and q[field] is not None]
                r[f"{field}_share"] = None if r[field] is None else sum(v < r[field] for v in same) / len(same)
        return rows
    monkeypatch.setattr(report, "with_shares", strictly_smaller)
    assert _shares_off(schema.upgrade(old)["tables"]["latency"]) > 1e-3


@pytest.mark.parametrize("view", ["engine", "simulate"])
def test_the_bigger_run_linked_from_the_page_fits_the_servers_budget(view):
    from backend.serving.schema import BIG

    config = experiments.get(f"serving.{view}").make_config({k: str(v) for k, v in BIG[view].items()})  # validate() included
    assert config.estimate().seconds > experiments.get(f"serving.{view}").make_config({}).estimate().seconds


class ForgetsTheFirstKey(attention.TorchPagedAttention):
    """A subtly wrong variant: decodes past position 60 no longer see position 0's key (an evicted attention sink)."""

    def __init__(self, tables, seq, pos, block_size):
        super().__init__(tables, seq, pos, block_size)
        if self.decode_rows.any():
            lens = pos[self.decode_rows] + 1
            first_slot = torch.zeros_like(self.invalid)
            first_slot[torch.cumsum(-(-lens // block_size), 0)[:-1] * block_size] = True  # each query's slot of position 0
            first_slot[0] = True
            self.invalid = self.invalid | (first_slot & (lens[self.slot_owner] > 60))


@pytest.mark.parametrize("policy", POLICIES)
def test_every_sampled_logits_row_equals_a_full_recompute(model, policy):
    """The engine's logits (paged KV, batched, preempted and resumed) against one causal forward of the request's
    whole sequence without a cache: float32 differences of about 1e-6, every sampled row compared."""
    config, trace, _ = POLICIES[policy]
    sched = serve(model, trace, config, record_batches=True)
    err, rows = logits_error(model, sched)
    assert rows == int(trace.output_len.sum())
    assert err < LOGITS_TOL


def test_logits_check_catches_what_the_token_check_misses(model):
    """Forgetting one key late in long sequences leaves every greedy token of this trace unchanged (the token check
    passes) but moves the logits by 0.026, 2,600 times the logits check's tolerance."""
    sched = serve(model, small(), SchedulerConfig(), attention=ForgetsTheFirstKey, record_batches=True)
    assert token_mismatches(model, sched) == []
    assert logits_error(model, sched)[0] > 100 * LOGITS_TOL
    wrong = serve(model, small(), SchedulerConfig(), attention=WrongTables, record_batches=True)
    assert logits_error(model, wrong)[0] > 0.1


PAGE_FRAME = ("pages", "streamlit", "altair", "pandas", "urllib")


def library_imports(source: str) -> list[str]:
    """The modules a page imports beyond the frame (pages.*), its drawing libraries and result schemas (*.schema)."""
    import ast

    names = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names.append(node.module or "")
    return [n for n in names if n.split(".")[0] not in PAGE_FRAME and not n.endswith(".schema")]


@pytest.mark.parametrize("page", ["serving.py", "kv_cache.py", "paged_attention.py", "paged_decode.py"])
def test_the_serving_and_kv_pages_import_only_the_frame_and_result_schemas(page):
    from pathlib import Path

    assert library_imports((Path(__file__).parent.parent / "pages" / page).read_text()) == []


def test_the_page_import_rule_sees_a_library_import():
    assert library_imports("from backend.serving.report import cost_model_summary\nimport pages.ui\n") == ["backend.serving.report"]
