"""Expert parallel MoE against the same MoE in one process, at 2, 3 (uneven token slices) and 4 ranks."""
import multiprocessing

import pytest
import torch

from backend.comm.spawn import spawn_ranks
from backend.config import ConfigError
from backend.experiments import RunContext
from backend.experiments.parallel import ep
from backend.experiments.parallel.ep import EPConfig
from backend.models.moe import capacity_topk, expert_capacity


@pytest.mark.parametrize("world, extra", [(2, {}), (3, {"experts": 6, "tokens": 50}), (4, {"capacity_factor": 0.5})])
def test_expert_parallel_equals_one_process(world, extra):
    cfg = EPConfig(world_size=world, **extra).validate()
    payloads = spawn_ranks(ep.run_rank, world, cfg, RunContext(timeout_s=300))
    assert multiprocessing.active_children() == []
    result = ep.combine(cfg, payloads)
    assert result.passed, [(c.name, c.error) for c in result.checks if not c.passed]
    table = result.tables["experts"]
    assert sum(r["kept"] + r["dropped"] for r in table) == cfg.tokens * cfg.top_k
    assert all(r["kept"] <= r["capacity"] for r in table)
    if cfg.capacity_factor < 1:
        assert result.metrics["dropped assignments"] > 0
    # the all-to-all matrix's rows are what each rank's experts computed
    load = {(r["rank"]): 0 for r in result.tables["load"]}
    for r in result.tables["load"]:
        load[r["rank"]] += r["rows computed"]
    assert load == {j: sum(r["rows"] for r in result.tables["all_to_all"] if r["to rank"] == j) for j in range(world)}
    # a wrong byte count fails
    next(r for r in payloads[0]["log"] if r["name"] == "dispatch")["sent_bytes"] += 1
    assert not ep.combine(cfg, payloads).passed


def test_routing_keeps_first_choices_first():
    logits = torch.tensor([[5.0, 4.0, 0.0], [5.0, 0.0, 4.0], [0.0, 5.0, 4.0]], dtype=torch.float64)

    def kept(capacity_factor):
        r = capacity_topk(logits, 2, capacity_factor)
        return sorted((e, t) for (t, _), e in zip(r.kept.nonzero().tolist(), r.indices[r.kept].tolist()))
    assert kept(1.0) == [(0, 0), (0, 1), (1, 0), (1, 2), (2, 1), (2, 2)]  # capacity 2: nothing dropped
    # capacity 1. expert 0: tokens 0 and 1 both chose it first; token 0 wins by order. expert 1: token 2's first
    # choice beats token 0's second. expert 2: token 1's second choice beats token 2's second by order.
    assert kept(0.5) == [(0, 0), (1, 2), (2, 1)]
    assert kept(None) == kept(1.0)
    assert expert_capacity(64, 2, 4, 1.0) == 32 and expert_capacity(10, 1, 4, 1.0) == 3


@pytest.mark.parametrize("values, field", [
    ({"world_size": "3"}, "experts"), ({"top_k": "5"}, "top_k"), ({"tokens": "1"}, "tokens"),
    ({"capacity_factor": "0"}, "capacity_factor"),
])
def test_bad_inputs(values, field):
    with pytest.raises(ConfigError) as info:
        EPConfig.from_dict(values)
    assert info.value.field == field


def test_capacity_is_exact_and_the_drop_check_catches_the_float_rule():
    """cf 1.1 with 100 tokens per rank, top-1 over 10 experts: capacity ceil(1.1 · 100 / 10) is exactly 11 (the float
    product 11.000000000000002 rounds up to 12). The run drops to 11; drops computed with the float rule fail the check."""
    import math
    cfg = EPConfig(world_size=2, tokens=200, experts=10, top_k=1, capacity_factor=1.1).validate()
    payloads = spawn_ranks(ep.run_rank, 2, cfg, RunContext(timeout_s=300))
    result = ep.combine(cfg, payloads)
    assert result.passed, [(c.name, c.error) for c in result.checks if not c.passed]
    assert {r["capacity"] for r in result.tables["experts"]} == {11}
    assert max(r["kept"] for r in result.tables["experts"]) == 11
    routed = [r for p in payloads for r in p["reference_stats"]["routed"]]
    assert any(r >= 12 for r in routed)  # an expert where 11 and 12 drop differently
    for p in payloads:  # what the float rule would have dropped
        cap = math.ceil(1.1 * p["stats"]["tokens"] / 10)
        p["stats"]["dropped"] = [max(0, r - cap) for r in p["reference_stats"]["routed"]]
    failed = [c.name for c in ep.combine(cfg, payloads).checks if not c.passed]
    assert failed == ["dropped assignments equal Σ max(0, routed − capacity) per expert"]
