"""Compose parallelism: every factorisation of 4 ranks into pp x dp x cp x tp trains the tiny LLaMA like one process, and
the MoE variant on every factorisation with an ep dimension (plus MoE under tp, where each tp rank runs it alike)."""
import itertools
import math

import pytest

from backend.config import ConfigError
from backend.experiments.parallel import mesh
from backend.experiments.parallel.mesh import PRESETS, MeshConfig
from backend.comm.collectives import ring_bytes
from tests.mesh_runs import checks as _checks, failures, run_plans

DIMS = ("pp", "dp", "cp", "ep", "tp")
ALL = [dict(zip(DIMS, f)) for f in itertools.product((1, 2, 4), repeat=5) if math.prod(f) == 4]  # 15
FACTORISATIONS = [f for f in ALL if f["ep"] == 1]                            # dense: the 10 without ep
MOE = [f for f in ALL if f["ep"] > 1] + [dict(pp=2, dp=1, cp=1, ep=1, tp=2)]  # MoE: the 5 with ep, and one under tp
# GQA (8 query heads, 4 KV heads) so tp and the ring both split grouped heads; seq 8 divides into cp=4's 8 zigzag chunks
BASE = dict(world_size=4, batch=8, seq=8, d_model=16, n_heads=8, n_kv_heads=4, d_head=4, d_ff=16, vocab=16, layers=4, steps=2)


@pytest.fixture(scope="module")
def runs():
    configs = [MeshConfig(pp=f["pp"], cp=f["cp"], tp=f["tp"], **BASE) for f in FACTORISATIONS]
    configs += [MeshConfig(pp=f["pp"], cp=f["cp"], tp=f["tp"], ep=f["ep"], experts=4, **BASE) for f in MOE]
    return list(zip(configs, run_plans(configs)))


def test_every_factorisation_of_four_ranks_equals_one_process(runs):
    shapes = [{d: getattr(c, d) for d in DIMS} for c, _ in runs]
    assert len(runs) == 16 and all(f in shapes for f in ALL)
    for cfg, payloads in runs:
        result = mesh.combine(cfg, payloads)
        assert result.passed, ((cfg.pp, cfg.dp, cfg.cp, cfg.ep, cfg.tp), failures(result))
        assert result.metrics["final_loss"] < result.tables["loss"][0]["loss"]  # it trains
        sent = {k: sum(p["bytes"][k] for p in payloads) for k in payloads[0]["bytes"]}
        used = {"tp": cfg.tp, "pp": cfg.pp, "cp ring": cfg.cp, "dp gradients": cfg.dp, "cp gradients": cfg.cp,
                "ep all-to-all": cfg.ep, "ep gradients": cfg.ep}
        assert {k for k, v in sent.items() if v} == {k for k, n in used.items() if n > 1}  # each dimension talks, only it


def test_experts_live_on_their_ep_rank_and_a_wrong_routing_fails(runs):
    cfg, payloads = next((c, p) for c, p in runs if c.ep == 4)
    result = mesh.combine(cfg, payloads)
    assert {(r["rank"], r["expert"]) for r in result.tables["experts"]} == {(r, r) for r in range(4)}  # 4 experts, 1 each
    assert sum(r["rows computed"] for r in result.tables["experts"]) == cfg.steps * cfg.batch * cfg.seq * cfg.layers * cfg.top_k
    import pandas as pd  # the page's totals per rank and expert, against pandas' groupby sum of the per-block rows

    ref = pd.DataFrame(result.tables["experts"]).groupby(["rank", "expert"])["rows computed"].sum().to_dict()
    assert {(r["rank"], r["expert"]): r["rows computed"] for r in result.tables["experts_per_rank"]} == ref
    payloads[1]["moe"][0]["kept"][0] += 1
    assert not _checks(cfg, payloads)["every MoE call routed each expert the assignments the reference routed those tokens"].passed


def test_groups_follow_the_mesh(runs):
    cfg, payloads = next((c, p) for c, p in runs if (c.tp, c.pp) == (2, 2))
    groups = {g["dimension"]: g["ranks"] for g in mesh.combine(cfg, payloads).tables["groups"] if g["group"] == 0}
    assert groups == {"tp": [0, 1], "pp": [0, 2]}  # tensor parallel innermost: neighbouring ranks
    cfg, payloads = next((c, p) for c, p in runs if (c.cp, c.dp) == (2, 2))
    groups = {g["dimension"]: g["ranks"] for g in mesh.combine(cfg, payloads).tables["groups"] if g["group"] == 0}
    assert groups == {"cp": [0, 1], "dp": [0, 2]}


def test_context_parallel_ranks_hold_zigzag_positions_and_ring_the_kv(runs):
    cfg, payloads = next((c, p) for c, p in runs if c.cp == 4)
    result = mesh.combine(cfg, payloads)
    assert [r["cp"] for r in result.tables["ranks"]] == [0, 1, 2, 3]
    ring = [e for p in payloads for e in p["trace"]["events"] if e["name"].startswith("K/V block")]
    assert len(ring) == 4 * cfg.steps * cfg.microbatches * cfg.layers * 2 * (cfg.cp - 1)  # forward and backward


def test_a_wrong_shard_fails(runs):
    cfg, payloads = next((c, p) for c, p in runs if c.tp == 4)
    name = next(k for k in payloads[0]["params"] if "w13" in k)
    payloads[0]["params"][name], payloads[1]["params"][name] = payloads[1]["params"][name], payloads[0]["params"][name]
    assert not mesh.combine(cfg, payloads).passed


def test_a_wrong_ring_byte_count_fails(runs):
    cfg, payloads = next((c, p) for c, p in runs if c.cp == 2 and c.tp == 2)
    payloads[0]["bytes"]["cp ring"] += 8
    assert not mesh.combine(cfg, payloads).passed


def test_ring_bytes_of_uneven_chunks_add_up():
    """Chunks that do not divide evenly (torch.tensor_split): per-rank shares differ, and sum to the ring's total."""
    for numel, n in ((10, 4), (7, 3), (6, 4)):
        shares = [ring_bytes("all_reduce", numel, n, 8, j) for j in range(n)]
        assert sum(shares) == 2 * (n - 1) * numel * 8 and len(set(shares)) > 1
        assert sum(ring_bytes("reduce_scatter", numel, n, 8, j) for j in range(n)) == (n - 1) * numel * 8
    with pytest.raises(ValueError):
        ring_bytes("all_reduce", 10, 4, 8)


def test_three_dimensions_on_eight_ranks():
    """pp 2 x dp 2 x tp 2: every dimension live at once, 8 processes."""
    cfg = MeshConfig.from_dict({k: str(v) for k, v in PRESETS["3d8"].items()})
    payloads = run_plans([cfg], world=8, timeout_s=300)[0]
    result = mesh.combine(cfg, payloads)
    assert result.passed, failures(result)
    assert {g["dimension"] for g in result.tables["groups"]} == {"pp", "dp", "tp"}
    assert all(r["tp bytes sent"] and r["pp bytes sent"] and r["dp gradients bytes sent"] for r in result.tables["ranks"])


def test_presets_are_valid():
    shapes = [{d: getattr(MeshConfig.from_dict({k: str(v) for k, v in preset.items()}), d) for d in DIMS}
              for preset in PRESETS.values()]
    assert shapes[:3] == [dict(pp=4, dp=2, cp=1, ep=1, tp=1), dict(pp=2, dp=2, cp=1, ep=1, tp=2),
                          dict(pp=2, dp=1, cp=1, ep=2, tp=1)]


@pytest.mark.parametrize("values, field", [
    ({"world_size": "4", "tp": "3", "pp": "1"}, "tp"), ({"world_size": "4", "tp": "1", "pp": "4", "layers": "6"}, "layers"),
    ({"world_size": "4", "tp": "4", "pp": "1", "n_kv_heads": "2"}, "n_kv_heads"),
    ({"world_size": "8", "tp": "1", "pp": "1", "batch": "4"}, "batch"),
    ({"world_size": "4", "tp": "1", "pp": "1", "cp": "4", "seq": "12"}, "seq"),
    ({"world_size": "4", "tp": "2", "pp": "1", "cp": "4"}, "cp"),
    ({"world_size": "4", "tp": "1", "ep": "2"}, "ep"), ({"world_size": "4", "tp": "1", "ep": "2", "experts": "3"}, "experts"),
    ({"experts": "2", "top_k": "3"}, "top_k"),
])
def test_bad_inputs(values, field):
    with pytest.raises(ConfigError) as info:
        MeshConfig.from_dict(values)
    assert info.value.field == field


def _schedule_configs():
    """Every synchronous schedule on pp 2 x tp 2 (interleaved with 2 chunks), the V schedules on pp 4 as well, and
    ZB-V under MoE x ep and under cp (its ring inside a split backward)."""
    from backend.parallel.pp.schedules import SCHEDULES
    small = dict(BASE, microbatches=4)
    out = [MeshConfig(schedule=name, pp=2, tp=2, virtual_stages=2 if plan.interleaved else 1, **small)
           for name, plan in SCHEDULES.items() if not plan.asynchronous]
    out += [MeshConfig(schedule=name, pp=4, tp=1, **dict(small, layers=8, microbatches=8)) for name in ("zb_v", "dualpipe_v")]
    out += [MeshConfig(schedule="zb_v", pp=2, tp=1, ep=2, experts=4, **small),
            MeshConfig(schedule="dualpipe_v", pp=2, tp=1, cp=2, **dict(small, batch=8))]
    out += [MeshConfig(schedule="1f1b", pp=2, tp=1, dp_strategy=dp, **dict(small, microbatches=2)) for dp in ("allreduce", "zero1")]
    return [c.validate() for c in out]


@pytest.fixture(scope="module")
def schedule_runs():
    configs = _schedule_configs()
    return list(zip(configs, run_plans(configs)))


def test_every_schedule_in_the_mesh_equals_one_process(schedule_runs):
    from backend.parallel.pp.schedules import SCHEDULES
    assert {c.schedule for c, _ in schedule_runs} == {n for n, s in SCHEDULES.items() if not s.asynchronous}
    for cfg, payloads in schedule_runs:
        result = mesh.combine(cfg, payloads)
        assert result.passed, (cfg.schedule, cfg.pp, failures(result))
        plan = cfg.plan
        for p in payloads:  # each rank ran its own order of the schedule, on the stages the schedule places there
            assert p["order"] == [str(a) for a in plan.actions(cfg.pp, cfg.microbatches, cfg.virtual_stages)[p["coords"]["pp"]]]
            assert sorted(p["stages"]) == plan.stages_on(p["coords"]["pp"], cfg.pp, cfg.virtual_stages)
        if plan.v_shape:  # the first and last stage on pp rank 0: the loss is reported there
            assert all(p["last_stage"] == (p["coords"]["pp"] == 0) for p in payloads)


def test_schedules_differ_in_activations_held(schedule_runs):
    """GPipe holds every micro-batch at its peak, 1F1B at most pp - r: the measured peaks show it, and a peak
    counted as if every micro-batch were alive fails the check for 1F1B."""
    by = {(c.schedule, c.pp): (c, p) for c, p in schedule_runs if c.tp == 2}
    gpipe = {p["rank"]: p["memory"]["activations"] for p in by["gpipe", 2][1]}
    cfg, payloads = by["1f1b", 2]
    f1b = {p["rank"]: p["memory"]["activations"] for p in payloads}
    assert 2 * f1b[0] == gpipe[0] and 4 * f1b[2] == gpipe[2]  # of 4 equal micro-batches, stage 0 keeps 2, stage 1 one
    for p in payloads:
        p["memory"]["activations"] = sum(p["activations"].values())  # all micro-batches alive at once
    assert not _checks(cfg, payloads)["activations held at 1F1B (PipeDream-flush)'s peak within 10 % of the formula"].passed


def test_a_v_turn_counted_as_a_message_fails(schedule_runs):
    """In a V, stage pp-1 hands its output to stage pp on the same rank: no bytes. Counting it fails the byte check."""
    cfg, payloads = next((c, p) for c, p in schedule_runs if c.schedule == "zb_v" and c.pp == 4)
    last_rank = next(p for p in payloads if p["coords"]["pp"] == 3)
    act = sum(b * cfg.seq * cfg.d_model * 8 for b in mesh.split_of(cfg, last_rank["coords"]).microbatch_sizes)
    last_rank["bytes"]["pp"] += cfg.steps * act
    assert not mesh.combine(cfg, payloads).passed


@pytest.mark.parametrize("values, field", [
    ({"schedule": "dualpipe_v", "microbatches": "2", "batch": "8"}, "microbatches"),
    ({"schedule": "zb_v", "layers": "2", "tp": "2", "pp": "2"}, "layers"),
    ({"schedule": "1f1b", "virtual_stages": "2"}, "virtual_stages"),
    ({"schedule": "pipedream"}, "schedule"),
])
def test_bad_schedule_inputs(values, field):
    with pytest.raises(ConfigError) as info:
        MeshConfig.from_dict(values)
    assert info.value.field == field


def test_zero1_over_dp_shards_adams_state_and_equals_one_process(schedule_runs):
    """pp 2 x dp 2: ZeRO-1 (mesh_dp.ZeroShard) passes every check with half the optimizer state of the
    all-reduce run and the same bytes over dp (2ψ(n-1)/n either way); a rank claiming the whole state fails."""
    by = {c.dp_strategy: (c, p) for c, p in schedule_runs if c.dp == 2 and c.pp == 2 and c.schedule == "1f1b"}
    (plain_cfg, plain), (cfg, zero) = by["allreduce"], by["zero1"]
    assert mesh.combine(cfg, zero).passed
    assert all(2 * z["memory"]["optimizer states"] == a["memory"]["optimizer states"] for z, a in zip(zero, plain))
    assert [z["bytes"]["dp gradients"] for z in zero] == [a["bytes"]["dp gradients"] for a in plain]
    zero[0]["memory"]["optimizer states"] = plain[0]["memory"]["optimizer states"]
    assert not _checks(cfg, zero)["parameters, gradients and optimizer states per rank equal the zero1 memory model"].passed


def test_zero_over_one_dp_rank_is_the_degenerate_case_not_a_refusal():
    """ZeRO (or DDP) over dp = 1 runs as DeepSpeed and FSDP do on one rank: nothing sent, nothing sharded (its runs are
    in tests/test_mesh_covering.py's array)."""
    cfg = MeshConfig.from_dict({"dp_strategy": "zero3"})  # defaults: pp 2 x tp 2 on 4 ranks, dp 1
    assert cfg.dp == 1 and mesh.dp_memory("zero3", 10, 1) == mesh.dp_memory("allreduce", 10, 1)
    assert mesh.dp_bytes("zero3", [10], 1, 3, 4096) == 0


def test_each_pipelines_replay_equals_the_makespan_model_and_a_wrong_dependency_fails(schedule_runs, monkeypatch):
    """Per pipeline (ranks sharing every coordinate but pp), the last step replayed at its mean stage costs equals the
    makespan model action by action; a model whose backwards do not wait for the next stage's gradient fails."""
    from backend.parallel.pp import makespan as M

    for cfg, payloads in schedule_runs:
        if cfg.pp > 1:
            check = next(c for c in mesh.combine(cfg, payloads).checks if "makespan model" in c.name)
            assert check.passed, (cfg.schedule, check.error, check.detail)
            assert {r["rank"] for r in mesh.combine(cfg, payloads).tables["pipeline"]} == {p["rank"] for p in payloads}
    cfg, payloads = next((c, p) for c, p in schedule_runs if c.schedule == "1f1b" and c.pp > 1)
    right = M._needs
    monkeypatch.setattr(M, "_needs", lambda a, last: [n for n in right(a, last) if n[0] != "back"])
    assert not next(c for c in mesh.combine(cfg, payloads).checks if "makespan model" in c.name).passed
