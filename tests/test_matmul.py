"""Tiled Triton GEMM (interpreter on a CPU): against torch.matmul for odd sizes and several tiles, counters equal
the closed form, the seed's 5x5 count, the execution model's arithmetic, the experiment and its bad inputs."""
import pytest
import torch

from backend import experiments
from backend.config import ConfigError
from backend.hardware.execution import gemm_hierarchy, tile_reuse, wave_footprint, warp_grid
from kernels.matmul import TENSORS, closed_form_traffic, matmul, program_order, reference_matmul


@pytest.mark.parametrize("M, N, K, bm, bn, bk, group_m, dtype", [
    (37, 45, 29, 16, 16, 16, 1, torch.float32),
    (33, 17, 70, 32, 16, 32, 4, torch.float32),
    (50, 40, 24, 16, 32, 16, 2, torch.float16),
    (1, 5, 5, 16, 16, 16, 1, torch.float32),
])
def test_matmul_masked_tails_and_counters(M, N, K, bm, bn, bk, group_m, dtype):
    g = torch.Generator().manual_seed(M)
    a, b = torch.randn(M, K, generator=g).to(dtype), torch.randn(K, N, generator=g).to(dtype)
    counters = torch.zeros(len(TENSORS), dtype=torch.int64)
    c = matmul(a, b, bm, bn, bk, group_m, counters)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert c.dtype == dtype and (c.float() - reference_matmul(a, b)).abs().max() < tol
    assert dict(zip(TENSORS, counters.tolist())) == closed_form_traffic(M, N, K, a.element_size(), bm, bn)


def test_strided_inputs_and_wrong_variants_are_caught():
    g = torch.Generator().manual_seed(5)
    a, b = torch.randn(40, 24, generator=g).T, torch.randn(40, 20, generator=g)  # a is a transposed view
    counters = torch.zeros(len(TENSORS), dtype=torch.int64)
    c = matmul(a, b, 16, 16, 16, 2, counters)
    assert (c - reference_matmul(a, b)).abs().max() < 1e-4
    assert (matmul(a * 1.001, b, 16, 16, 16, 2) - reference_matmul(a, b)).abs().max() > 1e-3  # a wrong input fails
    assert dict(zip(TENSORS, counters.tolist())) != closed_form_traffic(24, 20, 40, 4, 16, 32)  # a wrong tiling fails


def test_closed_form_counts_the_tile_rereads():
    t = closed_form_traffic(64, 64, 64, 2, 16, 32)
    assert t == {"A": 64 * 64 * 2 * 2, "B": 64 * 64 * 4 * 2, "C": 64 * 64 * 2}


def test_seed_5x5_count_and_its_generalisation():
    seed = tile_reuse(1, 5, 5)
    assert (seed["A_loads"], seed["B_loads"], seed["macs"]) == (5, 25, 25)
    assert tile_reuse(32, 64, 100)["loads_per_mac"] == pytest.approx(1 / 32 + 1 / 64)


@pytest.mark.parametrize("M, N, bm, bn, group_m", [(100, 72, 16, 16, 4), (70, 90, 32, 16, 2), (48, 48, 16, 16, 8)])
def test_program_order_is_the_order_the_kernel_records(M, N, bm, bn, group_m):
    tiles_n = -(-N // bn)
    order = torch.full((-(-M // bm) * tiles_n,), -1, dtype=torch.int32)
    matmul(torch.randn(M, 16), torch.randn(16, N), bm, bn, 16, group_m, order=order)
    recorded = {int(pid): (i // tiles_n, i % tiles_n) for i, pid in enumerate(order.tolist())}
    assert [recorded[pid] for pid in range(len(recorded))] == program_order(M, N, bm, bn, group_m)


def test_program_order_groups_rows_and_covers_every_tile():
    order = program_order(100, 72, 16, 16, 4)
    assert sorted(order) == [(m, n) for m in range(7) for n in range(5)]
    assert order[:5] == [(0, 0), (1, 0), (2, 0), (3, 0), (0, 1)]          # down a group of 4 tile-rows first
    assert order[-3:] == [(4, 4), (5, 4), (6, 4)]                           # the last group is 3 rows short
    big = lambda gm: wave_footprint(program_order(4096, 4096, 128, 128, gm), 108, 128, 128, 4096, 2)[0]["bytes"]  # noqa: E731
    assert big(8) < big(1)


def test_execution_hierarchy_of_a_tile():
    h = gemm_hierarchy(4096, 4096, 4096, 128, 128, 32, 8, "A100 (80 GB SXM)", 2, stages=3)
    assert h["programs"] == 32 * 32 and h["threads_per_program"] == 256 and h["outputs_per_thread"] == 64
    assert h["macs_per_thread"] == 64 * 4096 and h["wmma_per_program"] == 8 * 8 * 2 * 128
    assert h["warp_grid"] == (2, 4) or h["warp_grid"] == (4, 2)
    assert h["tensor_core_ops_per_wmma"] == 64 and h["shared_bytes_per_program"] == 3 * 2 * 128 * 32 * 2
    assert warp_grid(4, 16, 64) == (1, 4)
    assert h["useful_fraction"] == 1.0
    tail = gemm_hierarchy(100, 72, 60, 32, 32, 32, 4, "RTX 4090", 4)
    assert tail["useful_fraction"] == pytest.approx(100 * 72 * 60 / (128 * 96 * 64))


def test_experiment_defaults_pass():
    result = experiments.run("hardware.gemm", sweep_sizes="32,64")
    assert result.passed, [c for c in result.checks if not c.passed]
    counted = [r["intensity counted"] for r in result.tables["sweep"] if r["size"] == 64]
    assert counted == sorted(counted) and counted[-1] > 2 * counted[0]    # larger tiles, higher intensity


@pytest.mark.parametrize("values, field", [
    ({"block_m": "24"}, "block_m"), ({"block_k": "128", "k": "60"}, "block_k"), ({"m": "4096", "n": "4096"}, "m"),
    ({"sweep_sizes": "2048"}, "sweep_sizes"), ({"sweep_sizes": "a,b"}, "sweep_sizes"), ({"dtype": "bfloat16"}, "dtype"),
])
def test_bad_inputs_name_the_setting(values, field):
    if torch.cuda.is_available() and field in ("dtype", "m", "sweep_sizes") and values.get("sweep_sizes") != "a,b":
        pytest.skip("allowed on a GPU")
    with pytest.raises(ConfigError) as info:
        experiments.get("hardware.gemm").make_config(values)
    assert info.value.field == field


def test_kernel_rejects_bad_tiles_and_shapes():
    a = torch.randn(8, 8)
    with pytest.raises(ValueError, match="block_k 24"):
        matmul(a, a, 16, 16, 24)
    with pytest.raises(ValueError, match="share K"):
        matmul(a, torch.randn(9, 8))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_fp16_bf16_against_torch():
    for dtype in (torch.float16, torch.bfloat16):
        a, b = (torch.randn(1000, 1000, device="cuda", dtype=dtype) for _ in range(2))
        c = matmul(a, b, 128, 128, 32, 8, num_warps=8)
        exact = a.double() @ b.double()
        assert (c.double() - exact).abs().max() <= 2 * (torch.matmul(a, b).double() - exact).abs().max() + 1e-3


def test_the_largest_wave_footprint_per_group_m_equals_pandas_max():
    """The page's bars: per case and GROUP_M the most bytes one wave touches (hardware.gemm's largest_wave_footprint),
    against pandas' groupby max; the first wave's bytes instead (not always the largest) is told apart."""
    import pandas as pd

    from backend.experiments.hardware.gemm import largest_wave_footprint

    rows = [{**r, "case": f"{m}x{n}", "group_m": gm} for m, n in ((4096, 4096), (1000, 3000)) for gm in (1, 4, 8)
            for r in wave_footprint(program_order(m, n, 128, 128, gm), 108, 128, 128, 512, 2)]
    ref = pd.DataFrame(rows).groupby(["case", "group_m"])["bytes"].max().to_dict()
    assert {(r["case"], r["group_m"]): r["bytes"] for r in largest_wave_footprint(rows)} == ref
    first = {(r["case"], r["group_m"]): r["bytes"] for r in rows if r["wave"] == 0}
    assert first != ref
