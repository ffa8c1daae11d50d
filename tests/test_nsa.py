"""Native sparse attention: equal to the masked dense reference, a wrong mask is caught, the selection rule, the
KV rows against the closed form, full attention when everything is selected, the experiment and its bad inputs."""
import pytest
import torch
import torch.nn.functional as F

from backend import experiments
from backend.attention import nsa, nsa_reference
from backend.attention.nsa import (BRANCHES, closed_form_rows, kv_bytes_per_query, make_params, masked_dense_reference,
                                   nsa_attention, select_blocks, selection_weights)
from backend.config import ConfigError


def _inputs(H, G, n, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(H, n, d, generator=g), torch.randn(G, n, d, generator=g), torch.randn(G, n, d, generator=g), g


@pytest.mark.parametrize("H, G, n, geometry", [
    (4, 1, 200, dict(cmp_block=16, cmp_stride=8, sel_block=32, top_n=3, window=20)),
    (4, 2, 150, dict(cmp_block=8, cmp_stride=8, sel_block=16, top_n=2, window=1, local_blocks=1)),
    (2, 2, 70, dict(cmp_block=32, cmp_stride=16, sel_block=64, top_n=8, window=500)),
])
def test_nsa_equals_masked_dense_reference_and_rows_match_closed_form(H, G, n, geometry):
    q, k, v, g = _inputs(H, G, n, 16)
    params = make_params(16, geometry["cmp_block"], g)
    out, chosen = nsa_attention(q, k, v, params, **geometry)
    ref = masked_dense_reference(q, k, v, chosen, geometry["sel_block"], geometry["window"])
    assert (out - ref).abs().max() < 1e-5
    closed = closed_form_rows(n, **{k_: v_ for k_, v_ in geometry.items() if k_ != "local_blocks"})
    for branch in BRANCHES:
        assert torch.equal(chosen["kv_rows_read"][branch], closed[branch].expand(G, -1))


def test_a_wrong_window_in_the_reference_is_caught():
    q, k, v, g = _inputs(2, 1, 120, 16)
    out, chosen = nsa_attention(q, k, v, make_params(16, 16, g), window=32)
    assert (out - masked_dense_reference(q, k, v, chosen, 32, 33)).abs().max() > 1e-4


def test_selection_takes_the_highest_scores_after_the_forced_blocks():
    n, sel_block = 128, 16                    # 8 selection blocks; compressed blocks = selection blocks here
    p = torch.zeros(1, 1, n, 8)
    p[..., 5] = 0.9                           # block 5 matters most, then block 2
    p[..., 2] = 0.5
    blocks, real, importance = select_blocks(p, n, 16, 16, sel_block, top_n=4, local_blocks=1)
    last = set(blocks[0, -1][real[0, -1]].tolist())
    assert last == {0, 7, 5, 2}               # first, own, then by importance
    blocks, real, _ = select_blocks(p, n, 16, 16, sel_block, top_n=4, local_blocks=2)
    assert set(blocks[0, -1][real[0, -1]].tolist()) == {0, 7, 6, 5}  # the paper's two local blocks: own and the one before
    early = set(blocks[0, 20][real[0, 20]].tolist())
    assert early == {0, 1}                    # only two blocks are visible at t = 20


def test_every_block_selected_is_full_causal_attention():
    q, k, v, g = _inputs(4, 2, 96, 16)
    _, chosen = nsa_attention(q, k, v, make_params(16, 16, g), sel_block=16, top_n=6)
    full = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 0), v.repeat_interleave(2, 0), is_causal=True)
    assert (chosen["branch_outputs"]["selected"] - full).abs().max() < 1e-5


def test_kv_bytes_fall_behind_full_attention_as_n_grows():
    ratios = []
    for n in (256, 1024, 4096):
        rows = closed_form_rows(n, 16, 8, 32, 4, 64)
        b = kv_bytes_per_query({k: r[None] for k, r in rows.items()}, 32, 4)
        ratios.append(b["nsa_last"] / b["full_last"])
    assert ratios == sorted(ratios, reverse=True) and ratios[-1] < 0.2


def test_experiment_defaults_pass():
    result = experiments.run("attention.nsa", sweep_sizes="256,512")
    assert result.passed, [c for c in result.checks if not c.passed]
    at_512 = next(row for row in result.tables["sweep"] if row["seq_len"] == 512)  # the checked run's N, swept apart
    assert result.metrics["nsa_over_full_last"] == pytest.approx(at_512["nsa_over_full_last"])


@pytest.mark.parametrize("values, field", [
    ({"kv_heads": "4", "heads": "6"}, "kv_heads"), ({"cmp_stride": "16", "cmp_block": "8"}, "cmp_stride"),
    ({"sel_block": "16", "cmp_stride": "16", "cmp_block": "32"}, None), ({"sweep_sizes": "10"}, "sweep_sizes"),
    ({"sweep_sizes": "8192", "head_dim": "64"}, "sweep_sizes"), ({"top_n": "3", "local_blocks": "3"}, "top_n"), ({"top_n": "32", "window": "2048", "seq_len": "2048"}, "seq_len"), ({"seq_len": "4096"}, "seq_len"), ({"impl": "triton"}, "seq_len"),
])
def test_bad_inputs_name_the_setting(values, field):
    if field is None:  # allowed
        experiments.get("attention.nsa").make_config(values)
        return
    with pytest.raises(ConfigError) as info:
        experiments.get("attention.nsa").make_config(values)
    assert info.value.field == field


def test_triton_selected_kernel_against_both_references_and_its_byte_count():
    from kernels.nsa_selected import selected_attention, selected_reference

    q, k, v, g = _inputs(4, 2, 40, 16, seed=7)
    _, chosen = nsa_attention(q, k, v, make_params(16, 8, g), cmp_block=8, cmp_stride=8, sel_block=16, top_n=2,
                              local_blocks=1)
    counters = torch.zeros(2, dtype=torch.int64)
    out = selected_attention(q, k, v, chosen["blocks"], chosen["real"], 16, counters)
    assert (out - chosen["branch_outputs"]["selected"]).abs().max() < 1e-5
    assert (out - selected_reference(q, k, v, chosen["blocks"], chosen["real"], 16)).abs().max() < 1e-5
    rows = closed_form_rows(40, 8, 8, 16, 2, 64)["selected"].sum().item() * 2  # two KV groups
    assert counters.tolist() == [rows * 16 * 4] * 2
    wrong = chosen["blocks"].clone()
    wrong[..., -1] = 0                                                          # a wrong block table is caught
    assert (selected_attention(q, k, v, wrong, chosen["real"], 16) - out).abs().max() > 1e-3


def test_experiment_with_the_triton_kernel_passes():
    result = experiments.run("attention.nsa", impl="triton", seq_len=64, sweep_sizes="")
    assert result.passed, [c for c in result.checks if not c.passed]


def test_eq9_weights_by_hand():
    """l = 16, d = 8, l' = 32: selection block 1 holds tokens 32..63. Compressed blocks 3 (24..39) and 7 (56..71) have
    one stride-chunk of 8 inside it, blocks 4, 5, 6 both of theirs; the others none."""
    w = selection_weights(9, 16, 8, 32, 3)
    assert w[:, 1].tolist() == [0, 0, 0, 1, 2, 2, 2, 1, 0]
    assert w[:, 0].tolist() == [2, 2, 2, 1, 0, 0, 0, 0, 0]


@pytest.mark.parametrize("l, d, sel", [(16, 8, 32), (8, 8, 16), (32, 16, 64), (32, 8, 16), (16, 4, 16), (8, 4, 64)])
def test_eq9_weights_count_the_papers_index_pairs(l, d, sel):
    """Each weight equals the number of (m, n), m < l'/d, n < l/d, whose index (l'/d)(j+1) − 1 − m − n is the block,
    enumerated one pair at a time; also for l > l' (the paper's defaults have l < l')."""
    n_cmp, n_sel = 40, 8
    w = selection_weights(n_cmp, l, d, sel, n_sel)
    count = torch.zeros(n_cmp, n_sel)
    for j in range(n_sel):
        for m in range(sel // d):
            for n_ in range(l // d):
                i = sel // d * (j + 1) - 1 - m - n_
                if 0 <= i < n_cmp:
                    count[i, j] += 1
    assert torch.equal(w, count)


@pytest.mark.parametrize("H, G, n, geometry", [
    (4, 1, 200, dict(cmp_block=16, cmp_stride=8, sel_block=32, top_n=4, local_blocks=2)),
    (4, 2, 160, dict(cmp_block=32, cmp_stride=8, sel_block=16, top_n=5, local_blocks=1)),
    (2, 2, 130, dict(cmp_block=8, cmp_stride=4, sel_block=16, top_n=6, local_blocks=3)),
])
def test_selection_equals_the_per_query_float64_reference(H, G, n, geometry):
    q, k, v, g = _inputs(H, G, n, 16, seed=3)
    params = make_params(16, geometry["cmp_block"], g)
    _, chosen = nsa_attention(q, k, v, params, **geometry)
    reference = nsa_reference.select(q, k, params, **geometry, queries=list(range(n)))
    err, differ = nsa_reference.selection_differences(chosen["blocks"], chosen["real"], chosen["importance"], reference, 1e-5)
    assert err < 1e-5 and differ == 0


def _overlap_0_1(n_cmp, cmp_block, cmp_stride, sel_block, n_sel):
    """The rule this project had: every compressed block overlapping a selection block counts once."""
    starts = torch.arange(n_cmp)[:, None] * cmp_stride
    sel_starts = torch.arange(n_sel)[None, :] * sel_block
    return ((starts < sel_starts + sel_block) & (starts + cmp_block > sel_starts)).float()


def test_the_selection_checks_fail_for_the_0_1_overlap_rule(monkeypatch):
    """At the defaults the 0/1 overlap score picks other blocks than the paper's eq. 9 for 41 of the 512 queries."""
    checks = ("selection-block importance equals the paper's eq. 9 over eq. 8's p_cmp, summed over the group's heads",
              "the blocks chosen equal the paper's: the first and local blocks, then the top p_slc (eq. 11)")
    good = experiments.run("attention.nsa", sweep_sizes="")
    assert all(c.passed for c in good.checks if c.name in checks)
    monkeypatch.setattr(nsa, "selection_weights", _overlap_0_1)
    bad = {c.name: c for c in experiments.run("attention.nsa", sweep_sizes="").checks}
    assert not bad[checks[0]].passed and bad[checks[1]].error == 41


def _spans_off(selection: list[dict], sel_block: int, window: int) -> int:
    """Queries whose selected or window spans differ from numpy's: block b as [b·l', min((b+1)·l', t+1)), the window
    as [max(0, t−w+1), t+1)."""
    import numpy as np

    wrong = 0
    for row in selection:
        t, blocks = row["query"], np.array(row["blocks"], dtype=np.int64)
        want = np.stack([blocks * sel_block, np.minimum((blocks + 1) * sel_block, t + 1)], axis=1).reshape(-1, 2)
        got = np.array(row["selected_spans"], dtype=np.int64).reshape(-1, 2)
        wrong += not (np.array_equal(got, want) and (row["window_start"], row["window_end"]) == (max(0, t - window + 1), t + 1))
    return wrong


def test_what_each_query_reads_comes_from_the_result_and_old_runs_gain_it(monkeypatch):
    """The page's per-query spans are the result's (pages only draw), equal to numpy's; a version 3 run gains them by the
    upgrade; a selected block drawn past the query (not causal) fails."""
    from backend.experiments.attention import nsa as exp_nsa
    from backend.result import VERSION_KEY

    settings = dict(seq_len=128, sel_block=16, window=20, sweep_sizes="128")
    result = experiments.run("attention.nsa", **settings)
    assert _spans_off(result.tables["selection"], 16, 20) == 0
    assert any(b * 16 + 16 > row["query"] + 1 for row in result.tables["selection"] for b in row["blocks"])  # a cut block
    stored = {**result.to_dict(), "config": experiments.get("attention.nsa").make_config(settings).to_dict()}
    for row in stored["tables"]["selection"]:
        del row["selected_spans"], row["window_start"], row["window_end"]
    stored[VERSION_KEY] = 3
    assert _spans_off(exp_nsa.RESULT.upgrade(stored)["tables"]["selection"], 16, 20) == 0

    def past_the_query(selection, sel_block, window):
        for row in selection:
            row["selected_spans"] = [[b * sel_block, (b + 1) * sel_block] for b in row["blocks"]]
            row["window_start"], row["window_end"] = max(0, row["query"] - window + 1), row["query"] + 1
        return selection
    monkeypatch.setattr(exp_nsa, "with_read_spans", past_the_query)
    assert _spans_off(exp_nsa.RESULT.upgrade(stored)["tables"]["selection"], 16, 20) > 0
