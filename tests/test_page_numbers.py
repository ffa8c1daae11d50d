"""Numbers the pages used to compute, now in their experiments' results (issue #32, "pages only draw"): the roofline
lines of hardware.roofline, hardware.decode and hardware.gemm, and the decode-speed chart's rolling median, axis range
and off-chart count of attention.kv_cache. Each against an independent computation (numpy, pandas), each shown failing
when its rule is broken, and each filled into a run stored before it by the schema's version step."""
import json

import numpy as np
import pandas as pd
import pytest

from backend import experiments
from backend.experiments.attention import kv_cache
from backend.hardware import roofline
from backend.hardware.devices import DEVICES, dram
from backend.result import VERSION_KEY
from tests.test_result_schema import OLD_RESULTS


# --- the roofline's lines ------------------------------------------------------------------------------------------
def _roofs() -> list[dict]:
    return [{"device": "a CPU", "peak_flops": 1.3e11, "bandwidth": 2.1e10}] + [
        {"device": name, "peak_flops": spec["peak_flops"]["fp16/bf16 tensor"], "bandwidth": dram(name)[2]}
        for name, spec in DEVICES.items()]


def roof_line_error(rows: list[dict], roofs: list[dict], intensities) -> float:
    """Largest relative gap between the tabled lines and numpy's min(peak, bandwidth × intensity) on the same grid."""
    xs = np.asarray(intensities, dtype=float)
    want = np.concatenate([np.minimum(r["peak_flops"], r["bandwidth"] * xs) for r in roofs])
    got = np.array([row["attainable_flops_per_s"] for row in rows])
    assert len(got) == len(want) and [row["device"] for row in rows] == [r["device"] for r in roofs for _ in xs]
    return float(np.max(np.abs(got - want) / want))


def test_roof_lines_are_min_of_peak_and_bandwidth_times_intensity():
    xs = np.logspace(-1, 4, 50)
    assert roof_line_error(roofline.roof_lines(_roofs(), xs), _roofs(), xs) < 1e-15


def test_roof_lines_check_fails_with_a_broken_roofline(monkeypatch):
    monkeypatch.setattr(roofline, "attainable", lambda peak, bw, x: max(peak, bw * x))  # the roof's max, not its min
    xs = np.logspace(-1, 4, 50)
    assert roof_line_error(roofline.roof_lines(_roofs(), xs), _roofs(), xs) > 0.5


@pytest.mark.parametrize("name, step, roofs_table, grid", [
    ("hardware.roofline", 2, "roofs", np.logspace(-1, 3, 60)),           # the page's former grids, typed again
    ("hardware.decode", 2, "roof", np.logspace(-0.5, 4, 80)),
    ("hardware.gemm", 2, "roofs", [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]),
])
def test_a_run_stored_before_the_lines_gets_them_from_its_version_step(name, step, roofs_table, grid):
    schema = experiments.get(name).schema
    roofs = [{**r, "precision": "fp32"} for r in _roofs()] if name == "hardware.roofline" else _roofs()
    stored = {"tables": {roofs_table: roofs}, "metrics": {}}
    schema.upgrades[step](stored)  # the step that brings the lines (version step -> step + 1)
    assert roof_line_error(stored["tables"]["roof_lines"], roofs, grid) < 1e-12


def test_a_real_old_roofline_run_opens_with_its_lines():
    stored = json.loads((OLD_RESULTS / "hardware.roofline.json").read_text())
    assert "roof_lines" not in stored["tables"]
    opened = experiments.get("hardware.roofline").schema.upgrade(stored)
    assert opened[VERSION_KEY] == 3
    assert roof_line_error(opened["tables"]["roof_lines"], opened["tables"]["roofs"], np.logspace(-1, 3, 60)) < 1e-12


# --- the KV cache page's decode-speed chart -------------------------------------------------------------------------
def _steps(seed: int = 0) -> list[dict]:
    """Three variants' decode steps, shuffled, with a few descheduled steps (50-100× the usual time)."""
    rng = np.random.default_rng(seed)
    rows = [{"variant": v, "context": c, "ms_per_token": float(base + 0.002 * c + rng.normal(0, 0.05)), "cache_bytes_read": 64 * c}
            for v, base in (("mha", 1.0), ("gqa", 0.8), ("mla", 1.3)) for c in range(8, 60)]
    for i in rng.choice(len(rows), 4, replace=False):
        rows[i]["ms_per_token"] *= rng.uniform(50, 100)
    return [rows[i] for i in rng.permutation(len(rows))]


def pandas_view(rows: list[dict]) -> tuple[pd.Series, dict]:
    """The chart's numbers by pandas, as the page computed them: a centred rolling median of 9 per variant, and the
    axis at the variants' far fences (quartile ± 3 IQR) ×1.2 above and ×0.8 below (at least 0)."""
    speed = pd.DataFrame(rows).sort_values(["variant", "context"])
    median = speed.groupby("variant")["ms_per_token"].transform(lambda s: s.rolling(9, center=True, min_periods=1).median())
    q = speed.groupby("variant")["ms_per_token"].quantile([0.25, 0.75]).unstack()
    top = float((q[0.75] + 3 * (q[0.75] - q[0.25])).max()) * 1.2
    low = max(0.0, float((q[0.25] - 3 * (q[0.75] - q[0.25])).min()) * 0.8)
    return median.set_axis(list(zip(speed["variant"], speed["context"]))), {
        "axis_low_ms": low, "axis_high_ms": top, "off_chart_steps": int((speed["ms_per_token"] > top).sum()),
        "slowest_ms": float(speed["ms_per_token"].max())}


def view_mismatches(rows: list[dict]) -> list[str]:
    """Where decode_speed_view departs from pandas_view on these rows."""
    metrics = kv_cache.decode_speed_view(rows)
    medians, want = pandas_view(rows)
    bad = [f"{k}: {metrics[k]} vs {v}" for k, v in want.items() if not np.isclose(metrics[k], v, rtol=1e-12, atol=0)]
    bad += [f"median at {r['variant']} {r['context']}" for r in rows
            if not np.isclose(r["median_ms"], medians[(r["variant"], r["context"])], rtol=1e-12, atol=0)]
    return bad


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_decode_speed_view_equals_pandas(seed):
    rows = _steps(seed)
    assert view_mismatches(rows) == []
    assert kv_cache.decode_speed_view(rows)["off_chart_steps"] >= 1  # the spikes are off the chart (else it tests little)


@pytest.mark.parametrize("rule, broken", [("ROLLING_STEPS", 3), ("FENCE_IQR", 1.5)])
def test_decode_speed_view_check_fails_with_a_broken_rule(monkeypatch, rule, broken):
    monkeypatch.setattr(kv_cache, rule, broken)
    assert view_mismatches(_steps(0))


def test_a_real_old_kv_cache_run_opens_with_its_decode_speed_view():
    stored = json.loads((OLD_RESULTS / "attention.kv_cache.json").read_text())
    assert "decode_speed.axis_high_ms" not in stored["metrics"]
    opened = experiments.get("attention.kv_cache").schema.upgrade(stored)
    rows = opened["tables"]["decode_speed"]
    medians, want = pandas_view(rows)
    assert all(np.isclose(opened["metrics"][f"decode_speed.{k}"], v, rtol=1e-12) for k, v in want.items())
    assert all(np.isclose(r["median_ms"], medians[(r["variant"], r["context"])]) for r in rows)


# --- the GPU execution page's totals and warp tiles ----------------------------------------------------------------
def gemm_mismatches(result: dict) -> list[str]:
    """hardware.gemm's totals against other paths to them: bytes counted in all = the traffic table's rows summed;
    threads = programs × threads per program; the warp tiles cover the block exactly once (a numpy coverage grid)."""
    m, t, cfg = result["metrics"], result["tables"], result["config"]
    h = t["hierarchy"][0]
    bad = [] if m["bytes_counted"] == sum(r["bytes counted"] for r in t["traffic"]) else ["bytes_counted"]
    bad += [] if h["threads"] == h["programs"] * h["threads_per_program"] else ["threads"]
    bad += [] if h["warps"] * h["threads_per_warp"] == h["threads"] else ["warps"]
    cover = np.zeros((cfg["block_m"], cfg["block_n"]), dtype=int)
    for w in t["warp_tiles"]:
        cover[w["row0"]:w["row1"], w["col0"]:w["col1"]] += 1
    bad += [] if (cover == 1).all() and len(t["warp_tiles"]) == h["warps_per_program"] else ["warp_tiles"]
    return bad


@pytest.fixture(scope="module")
def gemm_run() -> dict:
    return experiments.run("hardware.gemm", sweep_sizes="32").to_dict() | {
        "config": experiments.get("hardware.gemm").make_config({"sweep_sizes": "32"}).to_dict()}


def test_gemm_totals_and_warp_tiles_agree_with_their_other_paths(gemm_run):
    assert gemm_mismatches(gemm_run) == []


@pytest.mark.parametrize("broken", ["totals", "tiles"])
def test_gemm_totals_check_fails_with_a_broken_rule(gemm_run, broken):
    from backend.experiments.hardware import gemm

    stored = json.loads(json.dumps(gemm_run))
    h = stored["tables"]["hierarchy"][0]
    if broken == "totals":  # threads counted per program, not per warp: the launch's threads ÷ warps
        h["threads"] = gemm.hierarchy_totals({**h, "threads_per_warp": 1})["threads"]
    else:                   # each warp's rows halved: the block's lower half left uncovered
        h_t = {**h, "warp_tile": [h["warp_tile"][0] // 2, h["warp_tile"][1]]}
        stored["tables"]["warp_tiles"] = gemm.warp_tiles(h_t)
    assert gemm_mismatches(stored)


def test_a_gemm_run_stored_before_the_totals_gets_them_from_its_version_step(gemm_run):
    schema = experiments.get("hardware.gemm").schema
    stored = json.loads(json.dumps(gemm_run))
    del stored["metrics"]["bytes_counted"], stored["tables"]["warp_tiles"]
    for k in ("warps", "threads"):
        del stored["tables"]["hierarchy"][0][k]
    schema.upgrades[3](stored)
    assert gemm_mismatches(stored) == []


# --- the context-parallel page's hidden transfer time --------------------------------------------------------------
def hidden_mismatches(ring: list[dict]) -> int:
    """Rows whose hidden time is not pandas' in-flight minus blocked time (the part of the transfer under compute)."""
    df = pd.DataFrame(ring)
    return int((~np.isclose(df["hidden_us"], df["in_flight_us"].to_numpy() - df["blocked_us"].to_numpy(), rtol=0, atol=1e-9)).sum())


def _v1_ring() -> list[dict]:
    rng = np.random.default_rng(3)
    return [{"rank": r, "what": f"K/V step {s}", "in_flight_us": float(f), "blocked_us": float(f * rng.uniform(0, 1))}
            for r in range(4) for s in range(3) for f in [rng.uniform(50, 500)]]


def test_a_cp_run_stored_before_the_hidden_time_gets_it_from_its_version_step():
    stored = {"tables": {"ring": _v1_ring()}, "metrics": {}}
    experiments.get("parallel.cp").schema.upgrades[1](stored)
    assert hidden_mismatches(stored["tables"]["ring"]) == 0


def test_hidden_time_check_fails_with_a_broken_rule(monkeypatch):
    from backend.experiments.parallel import cp

    ring = cp.with_hidden(_v1_ring())
    for r in ring:  # the broken rule: the blocked tail counted as hidden too
        r["hidden_us"] = r["in_flight_us"]
    assert hidden_mismatches(ring) == len(ring)


# --- the NSA page's compressed span --------------------------------------------------------------------------------
def span_mismatches(selection: list[dict], cmp_block: int, cmp_stride: int) -> list[int]:
    """Queries whose compressed span is not the furthest end of its visible compressed keys, key i covering tokens
    [i·stride, i·stride + block) (numpy), or reaches past the query itself."""
    ends = [int(np.max(np.arange(r["compressed_visible"]) * cmp_stride + cmp_block, initial=0)) for r in selection]
    return [r["query"] for r, e in zip(selection, ends) if r["compressed_end"] != e or e > r["query"] + 1]


@pytest.fixture(scope="module")
def nsa_run() -> dict:
    settings = {"seq_len": "128"}
    return experiments.run("attention.nsa", **settings).to_dict() | {
        "config": experiments.get("attention.nsa").make_config(settings).to_dict()}


def test_nsa_compressed_spans_end_at_the_last_visible_key(nsa_run):
    cfg, selection = nsa_run["config"], nsa_run["tables"]["selection"]
    assert span_mismatches(selection, cfg["cmp_block"], cfg["cmp_stride"]) == []
    assert any(r["compressed_visible"] > 1 for r in selection)


def test_nsa_span_check_fails_with_a_broken_rule(nsa_run):
    from backend.experiments.attention import nsa

    cfg = nsa_run["config"]
    broken = nsa.with_spans(json.loads(json.dumps(nsa_run["tables"]["selection"])), cfg["cmp_block"], cfg["cmp_block"])  # stride = block
    assert span_mismatches(broken, cfg["cmp_block"], cfg["cmp_stride"])


def test_a_nsa_run_stored_before_the_spans_gets_them_from_its_version_step(nsa_run):
    stored = json.loads(json.dumps(nsa_run))
    for r in stored["tables"]["selection"]:
        del r["compressed_end"]
    experiments.get("attention.nsa").schema.upgrades[2](stored)
    cfg = stored["config"]
    assert span_mismatches(stored["tables"]["selection"], cfg["cmp_block"], cfg["cmp_stride"]) == []


# --- the paged-decode page's empty slots ---------------------------------------------------------------------------
def empty_slot_mismatches(rows: list[dict]) -> list[str]:
    """Allocators whose empty slots, as a share of the reserved ones, are not the waste read off the cache tensors'
    bytes (1 − bytes used ÷ bytes reserved), or that do not add up to the reserved slots."""
    return [r["allocator"] for r in rows if r["slots_empty"] + r["slots_used"] != r["slots_reserved"]
            or not np.isclose(r["slots_empty"] / r["slots_reserved"], 1 - r["bytes_used"] / r["bytes_reserved"], rtol=1e-12)]


@pytest.fixture(scope="module")
def paged_run() -> dict:
    return experiments.run("kvcache.paged_decode", sequences=2, prompt_len=18, new_tokens=3).to_dict()


def test_paged_empty_slots_are_the_waste_read_off_the_bytes(paged_run):
    rows = paged_run["tables"]["seed_waste"]
    assert empty_slot_mismatches(rows) == [] and max(r["slots_empty"] for r in rows) == 1020  # seed 000's 1,020


def test_paged_empty_slot_check_fails_with_a_broken_rule(paged_run):
    rows = json.loads(json.dumps(paged_run["tables"]["seed_waste"]))
    for r in rows:  # the broken rule: the empty slots counted from the block size's rounding only
        r["slots_empty"] = r["slots_reserved"] % 16
    assert empty_slot_mismatches(rows)


def test_a_paged_run_stored_before_the_empty_slots_gets_them_from_its_version_step(paged_run):
    stored = json.loads(json.dumps(paged_run))
    for r in stored["tables"]["seed_waste"]:
        del r["slots_empty"]
    experiments.get("kvcache.paged_decode").schema.upgrades[1](stored)
    assert empty_slot_mismatches(stored["tables"]["seed_waste"]) == []
