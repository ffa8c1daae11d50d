"""Every primitive x algorithm at world sizes 2, 3, 4 with sizes that do not divide by the world size."""
import copy

import pytest

from backend.config import ConfigError
from backend.comm.collectives import ALGORITHMS
from backend.experiments.comm.collectives import CollectivesConfig, combine, rank_main
from backend.comm.spawn import spawn_ranks
from backend.experiments import RunContext


def _matrix_rank(rank, world, configs, ctx):
    return [rank_main(rank, world, c, ctx) for c in configs]


def _configs(world):
    numel = 7 * world + 3  # never divisible by 2, 3 or 4
    out = []
    for op, algos in ALGORITHMS.items():
        for algo in algos:
            out.append(CollectivesConfig(op=op, algo=algo, world_size=world, numel=numel, iters=1, root=world - 1))
    out.append(CollectivesConfig(op="all_to_all", algo="direct", world_size=world, numel=numel, iters=1, splits="uneven"))
    out.append(CollectivesConfig(op="all_to_all", algo="builtin", world_size=world, numel=numel, iters=1, splits="uneven"))
    for algo in ("ring", "halving_doubling", "tree"):
        out.append(CollectivesConfig(op="all_reduce", algo=algo, world_size=world, numel=numel, iters=1,
                                     data="normal", dtype="float16"))
    return [c.validate() for c in out]


@pytest.fixture(scope="module", params=[2, 3, 4])
def matrix(request):
    world = request.param
    configs = _configs(world)
    per_rank = spawn_ranks(_matrix_rank, world, configs, RunContext(timeout_s=240))
    return [(c, [per_rank[r][i] for r in range(world)]) for i, c in enumerate(configs)]


def test_every_op_and_algorithm_passes_its_checks(matrix):
    for config, payloads in matrix:
        result = combine(config, payloads)
        failed = [(c.name, c.error, c.tolerance) for c in result.checks if not c.passed]
        assert not failed, (config, failed)
        names = " ".join(c.name for c in result.checks)
        if config.algo != "builtin":
            assert "volume model" in names
        if config.algo == "ring":
            assert "chunk formulas" in names


def test_ring_all_reduce_matches_seed_volume_and_disagrees_with_seed_allgather(matrix):
    config, payloads = next((c, p) for c, p in matrix if c.op == "all_reduce" and c.algo == "ring" and c.data == "integers")
    n, item = config.world_size, 4
    result = combine(config, payloads)
    total_sent = sum(v["sent_bytes"] for v in result.tables["volume"])
    assert total_sent == 2 * (n - 1) * config.numel * item  # 2(n-1)/n·ψ per rank, summed over n ranks
    agreement = result.metrics["seed_allgather_formula_agreement"]
    assert agreement.endswith(f"/{n * (n - 1)}")
    if n > 2:
        assert agreement.startswith("0/")
    assert result.notes


def test_corrupted_traces_fail_the_checks(matrix):
    config, payloads = next((c, p) for c, p in matrix if c.op == "all_reduce" and c.algo == "ring" and c.data == "integers")
    bad = copy.deepcopy(payloads)
    first_send = next(e for e in bad[0]["log"] if e["dir"] == "send")
    first_send["blocks"] = [(first_send["blocks"][0] + 1) % config.world_size]
    bad[1]["sent"] += 4
    bad[2 % config.world_size]["err_ref"] = 1.0
    failed = {c.name for c in combine(config, bad).checks if not c.passed}
    assert any("chunk formulas" in f for f in failed)
    assert any("volume model" in f for f in failed)
    assert any("single-process reference" in f for f in failed)


@pytest.mark.parametrize("values, field", [
    ({"world_size": "1"}, "world_size"), ({"world_size": "64"}, "world_size"), ({"numel": "0"}, "numel"),
    ({"op": "allreduce"}, "op"), ({"algo": "butterfly"}, "algo"), ({"op": "scatter", "algo": "ring"}, "algo"),
    ({"root": "5", "world_size": "4"}, "root"), ({"numel": "3", "world_size": "4"}, "numel"),
])
def test_bad_inputs_name_the_field(values, field):
    with pytest.raises(ConfigError) as info:
        CollectivesConfig.from_dict(values)
    assert info.value.field == field
    assert "allowed" in str(info.value)
