"""The mesh's dp strategies (DDP buckets, ZeRO-2, ZeRO-3 beside all-reduce and ZeRO-1) and its presets on 4 ranks:
each equal to one process in float64, its dp bytes and its per-rank memory equal to the models; a wrong 1/dp
scaling or a wrong shard fails."""
import copy
import multiprocessing

import pytest
import torch

from backend.comm.spawn import spawn_ranks
from backend.experiments import RunContext
from backend.experiments.parallel import mesh
from backend.experiments.parallel.mesh import PRESET_NOTES, PRESETS, MeshConfig
from backend.config import ConfigError
from backend.parallel.ddp import make_buckets

FOUR = [name for name, p in PRESETS.items() if p["world_size"] == 4]
MEMORY = "parameters, gradients and optimizer states per rank equal the {} memory model"


def _all(rank, world, configs, ctx):
    return [mesh.run_rank(rank, world, cfg, ctx) for cfg in configs]


@pytest.fixture(scope="module")
def runs():
    """The 4-rank presets, and pp 2 x dp 2 under 1F1B with every dp strategy (steps 2)."""
    configs = [MeshConfig(preset=name).validate() for name in FOUR]
    configs += [MeshConfig(tp=1, pp=2, schedule="1f1b", dp_strategy=s, steps=2).validate()
                for s in ("allreduce", "ddp", "zero1", "zero2", "zero3")]
    per_rank = spawn_ranks(_all, 4, configs, RunContext(timeout_s=900), preload=("torch.distributed.pipelining",))
    assert multiprocessing.active_children() == []
    return [(cfg, [per_rank[r][i] for r in range(4)]) for i, cfg in enumerate(configs)]


def _strategy(runs, s):
    return next((c, p) for c, p in runs[len(FOUR):] if c.dp_strategy == s)


def test_four_rank_presets_pass_every_check(runs):
    assert set(FOUR) >= {"megatron4", "torchtitan4", "ddp4", "moe_ep"}
    for (cfg, payloads), name in zip(runs, FOUR):
        assert cfg.dp > 1 or cfg.ep > 1, name
        result = mesh.combine(cfg, payloads)
        assert result.passed, (name, [(c.name, c.error) for c in result.checks if not c.passed])
        assert result.metrics["final_loss"] < result.tables["loss"][0]["loss"]


def test_every_dp_strategy_equals_one_process_and_its_models(runs):
    """Bytes and memory against seed 000's figures computed here from the parameter count alone: ψ float64 elements,
    padded to a multiple of dp = 2 for the rings; 2ψ(n-1)/n = ψ per step sent by every strategy, ZeRO-3 one more
    all-gather (ψ/2) to report the weights; memory 8ψ/8ψ/16ψ, halved category by category by ZeRO-1, 2, 3."""
    for s in ("allreduce", "ddp", "zero1", "zero2", "zero3"):
        cfg, payloads = _strategy(runs, s)
        result = mesh.combine(cfg, payloads)
        assert result.passed, (s, [(c.name, c.error) for c in result.checks if not c.passed])
        for p in payloads:
            psi = p["flat_numel"] + p["flat_numel"] % 2
            assert p["bytes"]["dp gradients"] == cfg.steps * psi * 8 + (psi // 2 * 8 if s == "zero3" else 0)
            sharded = {"allreduce": 0, "ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3}[s]
            assert p["memory"]["optimizer states"] == 16 * (psi // 2 if sharded >= 1 else p["flat_numel"])
            assert p["memory"]["gradients"] == 8 * (psi // 2 if sharded >= 2 else p["flat_numel"])
            assert p["memory"]["parameters"] == 8 * (psi // 2 if sharded >= 3 else p["flat_numel"])
    # DDP ran one ring all-reduce per bucket, as many as ddp.make_buckets cuts at bucket_kb
    cfg, payloads = _strategy(runs, "ddp")
    buckets = {e["name"] for e in payloads[0]["trace"]["events"] if "bucket" in e["name"]}
    stage = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(n, dtype=torch.float64)) for n in payloads[0]["param_numels"]])
    assert len(buckets) == len(make_buckets(list(stage), cfg.bucket_kb * 1024)) > 1


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3"])
def test_a_wrong_dp_scaling_fails(runs, monkeypatch, strategy):
    """A memory model that divides by 2 dp instead of dp (or a rank that kept the full state) fails the check."""
    cfg, payloads = copy.deepcopy(_strategy(runs, strategy))
    right = mesh.dp_memory
    monkeypatch.setattr(mesh, "dp_memory", lambda s, n, k, *precision: right(s, n, 2 * k, *precision))
    assert not {c.name: c for c in mesh.combine(cfg, payloads).checks}[MEMORY.format(strategy)].passed
    monkeypatch.setattr(mesh, "dp_memory", right)
    payloads[0]["memory"]["gradients" if strategy != "zero1" else "optimizer states"] *= 2
    assert not {c.name: c for c in mesh.combine(cfg, payloads).checks}[MEMORY.format(strategy)].passed


def test_a_wrong_shard_fails(runs):
    """ZeRO-3's weights gathered with the two dp shards in the wrong order fail the parameter check."""
    cfg, payloads = copy.deepcopy(_strategy(runs, "zero3"))
    p = payloads[0]
    flat = torch.cat([torch.from_numpy(v).reshape(-1) for v in p["params"].values()])
    flat = torch.cat(flat.tensor_split(2)[::-1])
    at = 0
    for k, v in p["params"].items():
        p["params"][k] = flat[at:at + v.size].reshape(v.shape).numpy()
        at += v.size
    checks = {c.name: c for c in mesh.combine(cfg, payloads).checks}
    assert not checks["final parameters: every rank's shard equals one process on the whole batch"].passed


def test_ddp_bytes_follow_the_buckets(runs, monkeypatch):
    """The byte model pads each bucket's ring on its own (odd buckets of 7, 5, 3 elements over dp 2 send 8 + 6 + 4
    elements, one bucket of 15 sends 16), so the bucket cut shows in the bytes; worked by hand."""
    numels = [3, 5, 7]
    one = mesh.dp_bytes("ddp", numels, 2, 1, 10 ** 9)   # one bucket of 15 -> padded to 16
    each = mesh.dp_bytes("ddp", numels, 2, 1, 1)        # three buckets 7, 5, 3 -> 8 + 6 + 4
    assert (one, each) == (16 * 8, 18 * 8)


def test_presets_fill_their_settings_and_each_has_a_note():
    assert set(PRESET_NOTES) == set(PRESETS)
    for name, values in PRESETS.items():
        cfg = MeshConfig.from_dict({"preset": name})
        assert all(getattr(cfg, k) == v for k, v in values.items()), name
    cfg = MeshConfig.from_dict({"preset": "megatron4", "microbatches": "4", "batch": "8"})  # chosen beside it: kept
    assert (cfg.microbatches, cfg.batch, cfg.schedule, cfg.dp) == (4, 8, "interleaved_1f1b", 2)
    assert {PRESETS[n]["dp_strategy"] for n in ("megatron", "torchtitan", "deepseek_v3")} == {"zero1", "fsdp2"}


@pytest.mark.parametrize("strategy", ["ddp", "zero2", "zero3"])
def test_dp_strategies_over_one_dp_rank_are_accepted(strategy):
    """Over dp = 1 a dp strategy is the degenerate case (nothing to send or shard), run in tests/test_mesh_covering.py's
    array: validate accepts it rather than refusing a combination that runs."""
    assert MeshConfig.from_dict({"dp_strategy": strategy}).dp == 1  # defaults: pp 2 x tp 2 on 4 ranks


def test_full_recompute_keeps_only_stage_inputs(monkeypatch):
    """GPipe over pp 4 with 4 micro-batches: full recompute holds the stage inputs of the micro-batches in flight and
    one micro-batch's whole activations, under a third of what the run without recompute holds, equal to the
    model; stage 0's input counted as an embedding (a wrong kept size) fails."""
    base = dict(tp=1, pp=4, schedule="gpipe", microbatches=4, batch=8, steps=2)
    configs = [MeshConfig(recompute=r, **base).validate() for r in ("none", "full")]
    per_rank = spawn_ranks(_all, 4, configs, RunContext(timeout_s=600))
    assert multiprocessing.active_children() == []
    (plain_cfg, plain), (cfg, full) = [(c, [per_rank[r][i] for r in range(4)]) for i, c in enumerate(configs)]
    result = mesh.combine(cfg, full)
    assert result.passed, [(c.name, c.error) for c in result.checks if not c.passed]
    assert all(3 * f["memory"]["activations"] < p["memory"]["activations"] for f, p in zip(full, plain))
    assert [f["losses"] for f in full] == [p["losses"] for p in plain]  # the same arithmetic, run twice
    right = mesh.kept_inputs
    monkeypatch.setattr(mesh, "kept_inputs", lambda c, p: {st: {j: b * c.d_model for j, b in per.items()}
                                                            for st, per in right(c, p).items()})
    checks = {c.name: c for c in mesh.combine(cfg, full).checks}
    assert not checks["activations held at GPipe (F then B)'s peak within 10 % of the formula"].passed


@pytest.mark.parametrize("values", [{"recompute": "selective", "tp": "1", "cp": "2"}])
def test_recompute_refusals_name_the_setting(values):
    with pytest.raises(ConfigError) as info:
        MeshConfig.from_dict(values)
    assert info.value.field == "recompute" and "allowed" in str(info.value)


@pytest.mark.parametrize("values", [{"recompute": "full"}, {"recompute": "full", "tp": "1", "schedule": "zb_h1"},
                                    {"recompute": "full", "tp": "1", "experts": "4"}])
def test_full_recompute_under_tp_and_a_split_backward_is_accepted(values):
    """Full recompute reruns the forward's tp collectives in B (the byte model counts them twice) and under a split
    backward recomputes in I and holds the graph to W (peak_in_flight follows it): both run in the covering array."""
    assert MeshConfig.from_dict(values).recompute == "full"
