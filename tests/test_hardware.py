"""This machine's probes (pointer chase, read bandwidth), Little's law and the seed's latency figures, and the device
presets against datasheet values."""
import numpy as np
import pytest

from backend import experiments
from backend.hardware.latency import cache_levels, chase_latency, littles_law, random_cycle, read_bandwidth
from backend.hardware.devices import DEVICES, SOURCES, dram, ops_per_datum

MB, GB, TB = 1e6, 1e9, 1e12

# Datasheet values, typed in from the vendors' documents (see SOURCES), in the presets' conventions:
# (device, figure, value, relative tolerance)
DATASHEET = [
    ("A100 (80 GB SXM)", "sms", 108, 0), ("A100 (80 GB SXM)", "fp16/bf16 tensor", 312 * TB, 0),
    ("A100 (80 GB SXM)", "fp32", 19.5 * TB, 0), ("A100 (80 GB SXM)", "HBM2e bandwidth", 2039 * GB, 0),
    ("A100 (80 GB SXM)", "registers capacity", 27 * 2**20, 0), ("A100 (80 GB SXM)", "NVLink per direction", 300 * GB, 0),
    ("H100 (SXM)", "sms", 132, 0), ("H100 (SXM)", "fp16/bf16 tensor", 989 * TB, 0.001), ("H100 (SXM)", "HBM3 bandwidth", 3.35 * TB, 0),
    ("H100 (SXM)", "registers capacity", 33 * 2**20, 0), ("H100 (SXM)", "NVLink per direction", 450 * GB, 0),
    ("H200 (SXM)", "HBM3e bandwidth", 4.8 * TB, 0), ("H200 (SXM)", "HBM3e capacity", 141 * GB, 0),
    ("RTX 4090", "sms", 128, 0), ("RTX 4090", "fp32", 82.58 * TB, 0), ("RTX 4090", "fp16/bf16 tensor", 165.2 * TB, 0),
    ("RTX 4090", "registers capacity", 33.5 * MB, 0.01), ("RTX 4090", "GDDR6X bandwidth", 1.008 * TB, 0),
    ("RTX 4090", "GDDR6X capacity", 24 * GB, 0), ("RTX 4090", "L2 capacity", 72 * MB, 0),  # decimal, as the datasheet (and the other presets)
]


def _figure(device, figure):
    spec = DEVICES[device]
    if figure in spec:
        return spec[figure]
    if figure in spec["peak_flops"]:
        return spec["peak_flops"][figure]
    if figure == "NVLink per direction":
        return next(bw for level, (_, bw) in spec["levels"].items() if level.startswith("NVLink"))
    level, what = figure.rsplit(" ", 1)
    capacity, bandwidth = spec["levels"][level]
    return bandwidth if what == "bandwidth" else capacity


@pytest.mark.parametrize("device, figure, value, rel", DATASHEET)
def test_presets_match_the_datasheets(device, figure, value, rel):
    assert _figure(device, figure) == pytest.approx(value, rel=rel, abs=0)


def test_every_preset_figure_has_a_source_and_the_4090_is_gddr():
    for device, spec in DEVICES.items():
        assert (device, "peak_flops") in SOURCES and (device, "sm") in SOURCES
        for level in spec["levels"]:
            assert (device, f"level:{level}") in SOURCES, (device, level)
        assert spec["levels"]["registers"][0] == spec["sms"] * spec["registers_per_sm"]
    assert dram("RTX 4090")[0] == "GDDR6X" and not any("HBM" in level for level in DEVICES["RTX 4090"]["levels"])
    assert ops_per_datum("A100 (80 GB SXM)")["PCIe 4"] == pytest.approx(6240)


def test_littles_law_reproduces_seed_002():
    law = littles_law(89e-9, 131e9, 16)
    assert round(law["bytes_in_flight"]) == 11_659
    assert round(100 * law["one_request_fraction"], 2) == 0.14
    assert round(law["requests_in_flight_needed"]) == 729


def test_random_cycle_is_one_cycle_and_the_chase_follows_it():
    rng = np.random.default_rng(0)
    buf, order = random_cycle(64 * 100, rng)
    line, seen = int(order[0]), set()
    for _ in range(100):
        seen.add(line)
        line = int(buf[line * 8]) // 8
    assert len(seen) == 100 and line == order[0]
    probe = chase_latency(64 * 1000, 12_345, rng)
    assert probe["ended_where_predicted"] and probe["ns_per_load"] > 0


def test_a_broken_chain_is_caught():
    """A chain cut into two cycles ends elsewhere than the single cycle predicts: the check can fail."""
    rng = np.random.default_rng(1)
    buf, order = random_cycle(64 * 64, rng)
    buf[order[31] * 8] = order[0] * 8                       # line 31 now loops back to the start
    from backend.hardware import latency

    end = latency.ctypes.c_int64()
    latency._probes().chase(buf.ctypes.data, int(order[0]) * 8, 40, latency.ctypes.byref(end))
    assert end.value != int(order[40]) * 8


def test_read_bandwidth_reads_every_word():
    probe = read_bandwidth(1 << 16, min_bytes_read=1 << 20, repeats=2)
    assert probe["sum_correct"] and probe["bytes_per_s"] > 1e8


def test_cache_levels_are_read_from_the_kernel():
    levels = cache_levels()
    assert levels and levels[0]["level"] == "L1" and all(a["bytes"] < b["bytes"] for a, b in zip(levels, levels[1:]))


@pytest.mark.parametrize("spacing", [2, 4])
def test_latency_experiment_passes(spacing):
    result = experiments.run("hardware.latency", max_mib=16, spacing=spacing, steps=20_000)
    assert result.passed, [c for c in result.checks if not c.passed]
    assert result.tables["levels"][0]["level"] == "L1"
    a100 = next(r for r in result.tables["gpu_littles_law"] if r["device"].startswith("A100"))
    assert a100["bytes_in_flight"] == pytest.approx(500e-9 * 2039e9)


# --- seed 003's RTX 4090 figures as run checks of hardware.roofline
def _roofs():
    from backend.hardware.devices import DEVICES, dram

    return [{"device": n, "precision": p, "peak_flops": s["peak_flops"][p], "bandwidth": dram(n)[2]}
            for n, s in DEVICES.items() for p in ("fp16/bf16 tensor", "fp32")]


def test_seed_4090_checks_pass_and_the_ridge_is_found_on_the_roof():
    from backend.experiments.hardware.roofline import seed_4090_checks

    checks, ridge = seed_4090_checks(_roofs())
    assert all(c.passed for c in checks), checks
    assert ridge == pytest.approx(82.58 / 1.008, rel=1e-9)  # the preset's own ratio, found by bisection


def test_seed_4090_peak_check_fails_on_the_tensor_core_peak(monkeypatch):
    from backend.experiments.hardware.roofline import seed_4090_checks
    from backend.hardware.devices import DEVICES

    monkeypatch.setitem(DEVICES["RTX 4090"]["peak_flops"], "fp32", 165.2e12)  # the fp16 tensor figure drawn as fp32
    checks, _ = seed_4090_checks(_roofs())
    assert [c.passed for c in checks] == [False, True, False]


def test_seed_4090_ridge_check_fails_with_a_broken_roofline(monkeypatch):
    from backend.experiments.hardware import roofline

    monkeypatch.setattr(roofline, "attainable", lambda peak, bw, ai: min(peak, 2 * bw * ai))  # bandwidth counted twice
    checks, _ = roofline.seed_4090_checks(_roofs())
    assert [c.passed for c in checks] == [True, True, False]


# --- the per-level traffic table of hardware.roofline (drawn by the memory hierarchy page) -------------------------
def _hierarchy(n=256, d=64, block=64):
    from backend.attention.flash import io_model
    from backend.experiments.hardware.roofline import hierarchy_rows

    return hierarchy_rows(io_model(n, d, 4, block, block), n, block)


def _hierarchy_problems(rows, n=256, d=64, block=64) -> list[str]:
    """Against the closed forms: naive attention in fp32 moves Q, K, V, O once and writes and reads S and P
    (4Nd + 4N² words) through DRAM; flash re-reads on chip, at each of its (N / block)² tile steps, the tile bytes of
    one step; seed 002's A100 ops per datum (L1 ≈ 8, PCIe ≈ 6,240); every preset's every level has a row."""
    problems = []
    if sorted({(r["device"], r["level"]) for r in rows}) != sorted((dev, lvl) for dev, s in DEVICES.items() for lvl in s["levels"]):
        problems.append("not one row per preset level")
    step = (block * d + 2 * block * d) * 4 + block * block * 4 + block * d * 4 + 2 * block * 4  # Q, K, V tiles, S/P, O acc, m, l
    for r in rows:
        dram_level = DEVICES[r["device"]]["dram"]
        if r["level"] == dram_level and r["naive_bytes"] != 4 * (4 * n * d + 4 * n * n):
            problems.append(f"{r['device']} {dram_level}: naive {r['naive_bytes']}")
        if r["level"].startswith("L1"):
            dram_row = next(x for x in rows if x["device"] == r["device"] and x["level"] == dram_level)
            if r["flash_bytes"] != dram_row["flash_bytes"] + step * (n // block) ** 2:
                problems.append(f"{r['device']} L1: flash {r['flash_bytes']}")
    a100 = {r["level"]: r["ops_per_datum_fp64"] for r in rows if r["device"] == "A100 (80 GB SXM)"}
    if abs(a100["L1 / shared"] - 8) > 0.4 or abs(a100["PCIe 4"] - 6240) > 312:
        problems.append(f"A100 ops per datum {a100['L1 / shared']}, {a100['PCIe 4']}")
    return problems


def test_the_hierarchy_table_holds_the_closed_forms():
    rows = _hierarchy()
    assert _hierarchy_problems(rows) == []
    assert {(r["device"], r["level"]) for r in rows if r["approximate"]} <= {(d, lvl) for d, s in DEVICES.items() for lvl in s["levels"]}
    assert all(r["source"] != "no source" for r in rows)


def test_the_hierarchy_table_check_fails_without_the_on_chip_rereads(monkeypatch):
    from backend.experiments.hardware import roofline

    real = roofline.hierarchy_traffic
    monkeypatch.setattr(roofline, "hierarchy_traffic", lambda dev, std, flash, onchip: real(dev, std, flash, 0.0))
    assert any("L1: flash" in p for p in _hierarchy_problems(_hierarchy()))
