"""Recompute's price in the mesh run: full recompute under every kind of schedule (plain B, interleaved, split I/W,
V-shaped) and Korthikanti's selective recompute under tp, each equal to one process, its extra FLOPs equal to the
model (one more forward per (stage, micro-batch); QKᵀ and P·V again per layer) and its activations equal to the
formula; a broken rule fails. And where each rank's step goes: the last step split into compute, exposed
communication per dimension and idle, summing to its wall time (a split that counts a nested collective twice fails),
and replayed with one core per rank and a lane per dimension's communication (a collective waits for its group's
slowest member; with communication free the replay is the makespan model)."""
import dataclasses
import multiprocessing

import pytest

from backend.comm.spawn import spawn_ranks
from backend.experiments import RunContext
from backend.experiments.parallel import mesh
from backend.experiments.parallel.mesh import MeshConfig

BASE = dict(world_size=4, batch=8, seq=8, d_model=16, n_heads=8, n_kv_heads=4, d_head=4, d_ff=16, vocab=16, layers=4,
            steps=2, microbatches=4, pp=2)
FLOPS = "{} recompute's extra FLOPs per rank equal the model"


def _all(rank, world, configs, ctx):
    return [mesh.run_rank(rank, world, cfg, ctx) for cfg in configs]


@pytest.fixture(scope="module")
def runs():
    configs = [MeshConfig(schedule="interleaved_1f1b", virtual_stages=2, tp=1, recompute="full", **BASE).validate(),
               MeshConfig(schedule="zb_v", tp=1, recompute="full", **BASE).validate(),
               MeshConfig(schedule="zb_h1", tp=2, recompute="selective", **BASE).validate()]
    per_rank = spawn_ranks(_all, 4, configs, RunContext(timeout_s=600))
    assert multiprocessing.active_children() == []
    return {c.schedule: (c, [per_rank[r][i] for r in range(4)]) for i, c in enumerate(configs)}


def test_full_recompute_costs_one_forward_under_every_kind_of_schedule(runs):
    for name in ("interleaved_1f1b", "zb_v"):
        cfg, payloads = runs[name]
        result = mesh.combine(cfg, payloads)
        assert result.passed, (name, [(c.name, c.error, c.detail) for c in result.checks if not c.passed])
        m = result.metrics  # the whole step's extra is F / (F + B) of it; a GEMM's backward is two GEMMs: +1/3
        assert m["recompute_flops_overhead"] == m["recompute_flops_model"] and m["backward_to_forward_flops"] == 2.0
        assert abs(m["recompute_flops_overhead"] - 1 / 3) < 1e-3
        assert all(r["activations_saved_bytes"] > 0 for r in result.tables["recompute"])


def test_a_forward_left_uncounted_or_recomputed_activations_held_too_briefly_fail(runs, monkeypatch):
    cfg, payloads = runs["zb_v"]
    payloads[0]["price"]["without_forwards"].pop()
    assert not {c.name: c for c in mesh.combine(cfg, payloads).checks}[FLOPS.format("full")].passed
    right = mesh.peak_in_flight  # a split backward's I rebuilds the activations, held until W: drop that rule
    monkeypatch.setattr(mesh, "peak_in_flight", lambda order, per, kept=None: right(
        [a for a in order if a[0] != "I"] if kept else order, per, kept))
    checks = mesh.combine(cfg, payloads).checks
    assert not next(c for c in checks if c.name.startswith("activations held at")).passed


def test_selective_recompute_drops_the_scores_and_recomputes_two_gemms(runs, monkeypatch):
    cfg, payloads = runs["zb_h1"]
    result = mesh.combine(cfg, payloads)
    assert result.passed, [(c.name, c.error, c.detail) for c in result.checks if not c.passed]
    heads = cfg.n_heads // cfg.tp
    for row, p in zip(result.tables["recompute"], payloads):  # 4·b·(a/tp)·s²·d per layer per micro-batch
        assert row["extra_flops"] == 4 * (cfg.batch // cfg.microbatches) * heads * cfg.seq ** 2 * cfg.d_head \
            * p["layers_here"] * cfg.microbatches
    # the scores a·s²·b (float64) per layer were not kept: the formula with them does not match the run
    assert not next(c for c in mesh.combine(dataclasses.replace(cfg, recompute="none"), payloads).checks
                    if c.name.startswith("activations held at")).passed
    monkeypatch.setattr(mesh, "core_flops", lambda b, a, s, d: 2 * b * a * s * s * d)  # only QKᵀ recomputed
    assert not {c.name: c for c in mesh.combine(cfg, payloads).checks}[FLOPS.format("selective")].passed


def _step_flops_off(rows: list[dict], payloads) -> float:
    """The largest gap between the recompute table's FLOPs per step (without, with) and an independent sum: pandas over
    the table's forward, backward and extra columns, and the FLOP counter's own totals in the ranks' payloads."""
    import pandas as pd

    got = pd.DataFrame(rows).set_index("rank")[["step_flops_without", "step_flops_with"]]
    summed = pd.DataFrame(rows).set_index("rank")
    summed = pd.DataFrame({"step_flops_without": summed[["forward_flops", "backward_flops"]].sum(axis=1),
                           "step_flops_with": summed[["forward_flops", "backward_flops", "extra_flops"]].sum(axis=1)})
    counted = pd.DataFrame({"step_flops_without": [p["price"]["without_flops"] for p in payloads],
                            "step_flops_with": [p["price"]["with_flops"] for p in payloads]},
                           index=pd.Index([p["rank"] for p in payloads], name="rank"))
    return float(max((got - summed).abs().to_numpy().max(), (got - counted.loc[got.index]).abs().to_numpy().max()))


def test_each_ranks_flops_per_step_with_and_without_recompute_are_in_the_result(runs, monkeypatch):
    """The page's per-rank FLOPs bars come from the result (pages only draw), equal to pandas' sums and to the counter's
    totals; a stored version 3 run gains them by the upgrade; a rule that leaves the recomputed forwards out fails."""
    from backend.result import VERSION_KEY

    for name, (cfg, payloads) in runs.items():
        result = mesh.combine(cfg, payloads)
        assert _step_flops_off(result.tables["recompute"], payloads) == 0, name
    stored = result.to_dict()
    for row in stored["tables"]["recompute"]:
        del row["step_flops_without"], row["step_flops_with"]
    stored[VERSION_KEY] = 3
    upgraded = mesh.RESULT.upgrade(stored)
    assert _step_flops_off(upgraded["tables"]["recompute"], payloads) == 0

    def without_the_recomputed_forwards(rows):
        for r in rows:
            r["step_flops_without"] = r["step_flops_with"] = r["forward_flops"] + r["backward_flops"]
        return rows
    monkeypatch.setattr(mesh, "step_flops", without_the_recomputed_forwards)
    assert _step_flops_off(mesh.RESULT.upgrade(stored)["tables"]["recompute"], payloads) > 0
    assert _step_flops_off(mesh.combine(cfg, payloads).tables["recompute"], payloads) > 0


SPLIT = "each rank's last step splits into compute, exposed communication per dimension and idle that sum to its wall time"


def test_each_ranks_step_splits_into_compute_communication_by_dimension_and_idle(runs):
    for name, (cfg, payloads) in runs.items():
        result = mesh.combine(cfg, payloads)
        assert {c.name: c for c in result.checks}[SPLIT].passed
        for row in result.tables["step_split"]:
            assert row["compute_ms"] > 0 and row["pp_ms"] > 0 and row["cp_ms"] == row["ep_ms"] == 0
            assert (row["tp_ms"] > 0) == (cfg.tp > 1) and (row["dp_ms"] > 0) == (cfg.dp > 1)  # each dimension that talks
        replay = result.tables["step_replayed"]  # the same step with one core per rank: its span is the replayed step
        assert {r["rank"] for r in replay} == {p["rank"] for p in payloads}
        assert abs(max(r["end_ms"] for r in replay) - result.metrics["step_replayed_ms"]) < 1e-3
        lanes = {(r["rank"], r["lane"]) for r in result.tables["step_lanes"]}
        assert {(p["rank"], "compute") for p in payloads} <= lanes and ((0, "tp") in lanes) == (cfg.tp > 1)


def test_a_split_that_counts_nested_collectives_twice_fails(runs, monkeypatch):
    from backend.experiments.parallel import _step_split as S

    def twice(intervals, step):  # each collective inside an action also counted as the action's compute
        return S.parts(intervals + [(dict(it, op="compute"), iv) for it, iv in intervals if it["op"] == "collective"], step)
    monkeypatch.setattr(mesh, "parts", twice)
    cfg, payloads = runs["zb_h1"]  # tp 2: its all-reduces run inside the forwards and backwards
    assert not {c.name: c for c in mesh.combine(cfg, payloads).checks}[SPLIT].passed


def _means_off_pandas(rows: list[dict], means: list[dict]) -> float:
    """The largest gap between the result's per-schedule bubble means and pandas' groupby mean of the per-rank rows."""
    import pandas as pd

    ran = pd.DataFrame([r for r in rows if not r["refused"]])
    ref = ran.groupby("schedule", sort=False)[["bubble_replayed", "bubble_makespan_model"]].mean()
    got = pd.DataFrame(means).set_index("schedule")[["bubble_replayed", "bubble_makespan_model"]]
    assert list(got.index) == list(ref.index)
    return float((got - ref).abs().to_numpy().max())


def test_one_plan_under_every_schedule_side_by_side():
    """pp 2 x dp 2 with 4 micro-batches per rank: all seven synchronous schedules run the plan, each checked as usual;
    the zero-bubble V's closed-form bubble is the smallest; a wrong weight in one schedule's run fails the comparison."""
    from backend.parallel.pp.schedules import SCHEDULES

    cfg = MeshConfig(schedule="1f1b", tp=1, compare_schedules=True, **dict(BASE, steps=2)).validate()
    payloads = spawn_ranks(mesh.run_rank, 4, cfg, RunContext(timeout_s=600))
    assert multiprocessing.active_children() == []
    result = mesh.combine(cfg, payloads)
    assert result.passed, [(c.name, c.error, c.detail) for c in result.checks if not c.passed]
    rows = result.tables["schedules"]
    assert {r["schedule"] for r in rows if not r["refused"]} == {n for n, s in SCHEDULES.items() if not s.asynchronous}
    assert all(sum(r["schedule"] == n for r in rows) == 4 for n in {r["schedule"] for r in rows})  # every rank, each
    formula = {r["schedule"]: r["bubble_formula"] for r in rows}
    assert min(formula, key=formula.get) == "zb_v"
    assert _means_off_pandas(rows, result.tables["schedule_means"]) < 1e-12
    first_rank = lambda rows: [dict(r, ranks=1) for r in rows if r["rank"] == 0]  # noqa: E731  (a mean of one rank)
    assert _means_off_pandas(rows, first_rank(rows)) > 1e-3, "a per-schedule mean of rank 0 alone is told apart"
    name = next(k for k in payloads[0]["schedules"]["zb_h1"]["params"])
    payloads[0]["schedules"]["zb_h1"]["params"][name] = payloads[0]["schedules"]["zb_h1"]["params"][name] + 1e-6
    check = next(c for c in mesh.combine(cfg, payloads).checks if c.name.startswith("every schedule's run"))
    assert not check.passed and "zb_h1" in check.detail


REPLAY_SUM = "each rank's replayed step with communication lanes splits into compute, exposed communication per dimension and idle that sum to it"
REPLAY_FREE = "the replay with communication free equals the makespan model, action by action"


def _toy():
    """Ranks 0 and 1: one tp group on pipeline stage 0; rank 2: stage 1, receiving rank 0's activation."""
    coords = {0: {"pp": 0, "tp": 0}, 1: {"pp": 0, "tp": 1}, 2: {"pp": 1, "tp": 0}}
    comp = lambda us: {"op": "compute", "cost_us": us}  # noqa: E731
    coll = {"op": "collective", "dim": "tp", "name": "all_reduce", "cost_us": 1.0}
    steps = {0: [comp(5.0), dict(coll), comp(2.0), {"op": "send", "dim": "pp", "peer": 2, "tag": 7}],
             1: [comp(2.0), dict(coll), comp(4.0)],
             2: [comp(1.0), {"op": "recv", "dim": "pp", "peer": 0, "tag": 7, "cost_us": 0.5}, comp(3.0)]}
    return steps, coords


def test_a_collective_waits_for_its_groups_slowest_member_and_a_receive_for_its_send(monkeypatch):
    """By hand: the all-reduce starts at 5 when rank 0 arrives and ends at 6 on both; rank 0 sends at 8, rank 2 waits
    from 1 to 8 and receives by 8.5, then computes to 11.5, the step. Rank 1: compute 6, tp 1, idle 4.5 (3 waiting for
    rank 0, 1.5 after its last item). A collective that does not wait for its slowest member breaks these numbers."""
    from backend.experiments.parallel import _step_split as S

    steps, coords = _toy()
    replayed = S.replay_step(steps, S.match_calls(steps, coords))
    assert [(a["ts"], a["ts"] + a["dur"]) for a in replayed[1]] == [(0, 2), (5, 6), (6, 10)]
    assert [(a["ts"], a["ts"] + a["dur"]) for a in replayed[2]] == [(0, 1), (8, 8.5), (8.5, 11.5)]
    step, parts = S.replay_split(replayed)
    assert step == 11.5 and parts[1]["compute"] == 6 and parts[1]["tp"] == 1 and parts[1]["idle"] == 4.5
    assert parts[2] == {**dict.fromkeys(S.CATEGORIES, 0.0), "compute": 4.0, "pp": 0.5, "idle": 7.0}
    right = S.match_calls  # broken: a collective with no partners (each member goes on alone)
    monkeypatch.setattr(S, "match_calls", lambda st, co: {k: v for k, v in right(st, co).items() if st[k[0]][k[1]]["op"] != "collective"})
    broken = S.replay_step(steps, S.match_calls(steps, coords))
    assert [(a["ts"], a["ts"] + a["dur"]) for a in broken[1]] != [(0, 2), (5, 6), (6, 10)]


def test_the_replay_with_communication_lanes_splits_each_step_and_frees_to_the_makespan_model(runs, monkeypatch):
    for name, (cfg, payloads) in runs.items():
        result = mesh.combine(cfg, payloads)
        checks = {c.name: c for c in result.checks}
        assert checks[REPLAY_SUM].passed and checks[REPLAY_FREE].passed, name
        for row in result.tables["comm_replay"]:  # each dimension that talks has time on its lane
            assert row["compute_ms"] > 0 and row["pp_ms"] > 0 and (row["tp_ms"] > 0) == (cfg.tp > 1) and row["cp_ms"] == 0
        assert result.metrics["step_replayed_with_comm_ms"] == pytest.approx(result.tables["comm_replay"][0]["step_ms"], abs=1e-3)
        assert {r["lane"] for r in result.tables["comm_lanes"]} >= {"compute", "pp"} | ({"tp"} if cfg.tp > 1 else set())
    cfg, payloads = runs["zb_h1"]
    from backend.experiments.parallel import _step_split as S

    def waits_counted_as_communication(replayed):  # the wait for a slower member also counted on the dimension's lane
        step, parts = S.replay_split(replayed)
        for r, items in replayed.items():
            for before, a in zip(items, items[1:]):
                if a["op"] == "collective":
                    parts[r][a["dim"]] += a["ts"] - (before["ts"] + before["dur"])
        return step, parts
    monkeypatch.setattr(mesh, "replay_split", waits_counted_as_communication)
    assert not {c.name: c for c in mesh.combine(cfg, payloads).checks}[REPLAY_SUM].passed
    monkeypatch.undo()
    right = mesh.match_calls  # a receive that does not wait for its send
    monkeypatch.setattr(mesh, "match_calls", lambda st, co: {k: v for k, v in right(st, co).items() if st[k[0]][k[1]]["op"] != "recv"})
    assert not {c.name: c for c in mesh.combine(cfg, payloads).checks}[REPLAY_FREE].passed
