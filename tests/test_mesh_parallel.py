"""3D parallel: every factorisation of 4 ranks into pp x dp x tp trains the tiny LLaMA like one process."""
import multiprocessing

import pytest

from backend.comm.spawn import spawn_ranks
from backend.config import ConfigError
from backend.experiments import RunContext
from backend.experiments.parallel import mesh
from backend.experiments.parallel.mesh import PRESETS, MeshConfig

FACTORISATIONS = [(1, 1), (4, 1), (1, 4), (2, 1), (1, 2), (2, 2)]  # (tp, pp); dp = 4 / (tp x pp)
BASE = dict(world_size=4, batch=8, seq=4, d_model=16, n_heads=4, n_kv_heads=4, d_head=4, d_ff=16, vocab=16, layers=4, steps=2)


def _all(rank, world, configs, ctx):
    return [mesh.run_rank(rank, world, cfg, ctx) for cfg in configs]


@pytest.fixture(scope="module")
def runs():
    configs = [MeshConfig(tp=tp, pp=pp, **BASE).validate() for tp, pp in FACTORISATIONS]
    per_rank = spawn_ranks(_all, 4, configs, RunContext(timeout_s=600))
    assert multiprocessing.active_children() == []
    return [(cfg, [per_rank[r][i] for r in range(4)]) for i, cfg in enumerate(configs)]


def test_every_factorisation_of_four_ranks_equals_one_process(runs):
    assert sorted((c.pp, c.dp, c.tp) for c, _ in runs) == sorted([(1, 4, 1), (1, 1, 4), (4, 1, 1), (1, 2, 2), (2, 2, 1), (2, 1, 2)])
    for cfg, payloads in runs:
        result = mesh.combine(cfg, payloads)
        assert result.passed, ((cfg.pp, cfg.dp, cfg.tp), [(c.name, c.error) for c in result.checks if not c.passed])
        assert result.metrics["final_loss"] < result.tables["loss"][0]["loss"]  # it trains


def test_groups_follow_the_mesh(runs):
    cfg, payloads = next((c, p) for c, p in runs if (c.tp, c.pp) == (2, 2))
    groups = {g["dimension"]: g["ranks"] for g in mesh.combine(cfg, payloads).tables["groups"] if g["group"] == 0}
    assert groups == {"tp": [0, 1], "pp": [0, 2]}  # tensor parallel innermost: neighbouring ranks


def test_a_wrong_shard_fails(runs):
    cfg, payloads = next((c, p) for c, p in runs if c.tp == 4)
    name = next(k for k in payloads[0]["params"] if "w13" in k)
    payloads[0]["params"][name], payloads[1]["params"][name] = payloads[1]["params"][name], payloads[0]["params"][name]
    assert not mesh.combine(cfg, payloads).passed


def test_seed_002_preset_is_valid():
    (preset,) = PRESETS.values()
    cfg = MeshConfig.from_dict({k: str(v) for k, v in preset.items()})
    assert (cfg.pp, cfg.dp, cfg.tp) == (4, 2, 1)


@pytest.mark.parametrize("values, field", [
    ({"world_size": "4", "tp": "3", "pp": "1"}, "tp"), ({"world_size": "4", "tp": "1", "pp": "4", "layers": "6"}, "layers"),
    ({"world_size": "4", "tp": "4", "pp": "1", "n_kv_heads": "2"}, "n_kv_heads"),
    ({"world_size": "8", "tp": "1", "pp": "1", "batch": "4"}, "batch"),
])
def test_bad_inputs(values, field):
    with pytest.raises(ConfigError) as info:
        MeshConfig.from_dict(values)
    assert info.value.field == field
