"""Ring attention against full attention (torch SDPA): causal zigzag and contiguous, non-causal, 2-4 ranks."""
import multiprocessing

import pytest
import torch

from backend.comm.spawn import spawn_ranks
from backend.config import ConfigError
from backend.experiments import RunContext
from backend.experiments.parallel import cp
from backend.experiments.parallel.cp import CPConfig
from backend.parallel.cp import block_attention, merge, positions
from tests.test_page_numbers import hidden_mismatches


@pytest.mark.parametrize("world, extra", [(2, {}), (3, {"seq": 96}), (4, {"seq": 128}), (4, {"seq": 128, "split": "contiguous"}),
                                          (2, {"causal": False, "seq": 64, "batch": 2})])
def test_ring_attention_equals_full_attention(world, extra):
    cfg = CPConfig(world_size=world, **extra).validate()
    payloads = spawn_ranks(cp.run_rank, world, cfg, RunContext(timeout_s=300))
    assert multiprocessing.active_children() == []
    result = cp.combine(cfg, payloads)
    assert result.passed, [(c.name, c.error) for c in result.checks if not c.passed]
    work = [r["unmasked scores"] for r in result.tables["work"]]
    if cfg.causal and cfg.split == "contiguous":
        assert work == sorted(work) and work[-1] > 2 * work[0]  # the last rank does most; rank 0 least
    ring = result.tables["ring"]  # each transfer's time in flight = hidden under compute + blocked, neither negative
    assert hidden_mismatches(ring) == 0 and all(r["hidden_us"] >= 0 and r["blocked_us"] >= 0 for r in ring)
    skipped = [s for s in result.tables["steps"] if not s["computed"]]
    assert bool(skipped) == (cfg.causal and cfg.split == "contiguous")  # zigzag: every block has work for every rank
    payloads[0]["output_error"] = 1e-6  # a wrong output fails
    assert not cp.combine(cfg, payloads).passed


def test_log_sum_exp_merge_is_the_softmax():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, 4, 8, generator=g, dtype=torch.float64) for _ in range(3))
    pos = torch.arange(4)
    whole, _, _ = block_attention(q, k, v, pos, pos, True, 8 ** -0.5)
    out, lse = torch.zeros_like(q), torch.full((1, 1, 4), float("-inf"), dtype=torch.float64)
    for half in (slice(2, 4), slice(0, 2)):  # any order: the merge is commutative
        o_i, l_i, _ = block_attention(q, k[:, :, half], v[:, :, half], pos, pos[half], True, 8 ** -0.5)
        out, lse = merge(out, lse, o_i, l_i)
    assert torch.allclose(out, whole, atol=1e-14, rtol=0)
    wrong = merge(torch.zeros_like(q), torch.zeros(1, 1, 4, dtype=torch.float64), whole, torch.zeros(1, 1, 4, dtype=torch.float64))[0]
    assert not torch.allclose(wrong, whole)  # merging with a bogus partial (lse 0, output 0) is not the softmax


def test_zigzag_positions():
    assert positions(16, 0, 2, "zigzag").tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert positions(16, 1, 2, "zigzag").tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert positions(16, 1, 2, "contiguous").tolist() == list(range(8, 16))


@pytest.mark.parametrize("values, field", [({"seq": "100", "world_size": "4"}, "seq"), ({"split": "random"}, "split"),
                                           ({"world_size": "9"}, "world_size")])
def test_bad_inputs(values, field):
    with pytest.raises(ConfigError) as info:
        CPConfig.from_dict(values)
    assert info.value.field == field
