"""hardware.gemm: the tiled Triton GEMM, its traffic counted per tile shape, and how a GPU would execute it.

Measured (counted inside the kernel as it runs, in the interpreter or on a GPU): global-memory bytes
of A, B and C for the chosen GEMM and for a sweep of tile shapes and sizes; the arithmetic intensity
2·M·N·K / bytes from those counts. Checks: C against torch.matmul (fp64 reference, within 2x torch's own
error in the same dtype); counts equal the closed form exactly; loads per multiply-add equal
1/BLOCK_M + 1/BLOCK_N; seed 002's 5x5 example (a row loaded once, five columns, 25 multiply-adds).
Model (labelled): the execution hierarchy on a device preset, where the counted intensity sits on
each preset's roofline, and the bytes each wave of programs touches under GROUP_M ordering.
"""
from __future__ import annotations

import dataclasses
import time

import torch

from backend.config import Config, ConfigError, setting
from backend.limits import cost, too_costly
from backend.experiments import define
from backend.hardware.execution import TENSOR_CORE_SHAPE, WMMA_SHAPE, gemm_hierarchy, tile_reuse, wave_footprint
from backend.hardware.devices import DEVICES, dram
from backend.hardware.roofline import attainable, roof_lines
from backend.result import Check, Result, Schema
from kernels.matmul import TENSORS, closed_form_traffic, matmul, program_order

TILES = (16, 32, 64, 128)
SWEEP_TILES = ((16, 16), (16, 32), (32, 32), (32, 64), (64, 64))  # (BLOCK_M, BLOCK_N) swept ...
SWEEP_BLOCK_K = 32                                                   # ... at one depth: the counts do not depend on it
# The intensities (FLOP/byte, fp16) each preset's roof line is tabled at: powers of two, 1 to 1,024.
LINE_INTENSITIES = tuple(2.0 ** i for i in range(11))
INTERPRETER_STEPS = 1200  # programs x K steps the interpreter may run in one experiment (~10 ms each on one core)


def _pow2_at_least_16(x: int) -> int:
    return max(16, 1 << (x - 1).bit_length())


def interpreter_steps(M, N, K, block_m, block_n, block_k) -> int:
    return -(-M // block_m) * -(-N // block_n) * -(-K // block_k)


@dataclasses.dataclass
class GemmConfig(Config):
    m: int = setting(100, min=1, max=8192, help="rows of A and C (odd sizes exercise the masked tails)")
    n: int = setting(72, min=1, max=8192, help="columns of B and C")
    k: int = setting(60, min=1, max=8192, help="inner dimension")
    block_m: int = setting(32, choices=TILES, help="tile rows of C per program")
    block_n: int = setting(32, choices=TILES, help="tile columns of C per program")
    block_k: int = setting(32, choices=TILES, help="depth of one K step")
    group_m: int = setting(4, choices=(1, 2, 4, 8), help="tile-rows per group in the program order (L2 reuse)")
    num_warps: int = setting(4, choices=(1, 2, 4, 8), help="warps per program (the execution model; a launch setting on a GPU)")
    dtype: str = setting("float32", choices=("float16", "float32", "bfloat16"), help="element type (bfloat16 on a GPU only)")
    device: str = setting("A100 (80 GB SXM)", choices=tuple(DEVICES), help="preset for the execution model and rooflines")
    sweep_sizes: tuple[int, ...] = setting([48, 64], item_range=(16, 4096),
                                            help="square sizes for the tile-shape sweep (empty: no sweep)")
    seed: int = setting(0, min=0, max=2**31 - 1, help="inputs")

    cost_drivers = ("m", "n", "k", "sweep_sizes")

    def estimate(self):
        """Triton's interpreter dominates on a CPU: ~3.6 ms of CPU a program-step (the main GEMM, the seed's 5x5 and the
        sweep) and ~0.3 s to start (fitted to 1.2 s of CPU at the defaults and 3.9 s at m = 3200, bench/limits.py),
        besides fp64 and same-dtype torch references for C."""
        steps = interpreter_steps(self.m, self.n, self.k, self.block_m, self.block_n, self.block_k) + 1
        steps += sum(interpreter_steps(s, s, s, bm, bn, SWEEP_BLOCK_K) for s in self.sizes() for bm, bn in SWEEP_TILES)
        if torch.cuda.is_available():
            steps = 0
        elements = self.m * self.k + self.k * self.n + self.m * self.n + 3 * max(self.sizes(), default=0) ** 2
        return cost(data_bytes=elements * 8 * 4, flops=3 * 2 * self.m * self.n * self.k,
                    ops=steps * 150 + 11_000)

    def sizes(self) -> list[int]:
        return list(self.sweep_sizes)

    def check(self) -> None:
        gpu = torch.cuda.is_available()
        if self.dtype == "bfloat16" and not gpu:
            raise ConfigError("dtype", "bfloat16 gives wrong numbers in Triton's interpreter (allowed here: float16, float32)")
        for field, dim in (("block_m", self.m), ("block_n", self.n), ("block_k", self.k)):
            if getattr(self, field) > _pow2_at_least_16(dim):
                raise ConfigError(field, f"{getattr(self, field)} is larger than the matrix needs ({dim} rounds up to "
                                         f"{_pow2_at_least_16(dim)}; allowed: 16..{_pow2_at_least_16(dim)})")
        sizes = self.sizes()
        if gpu:
            return
        main = interpreter_steps(self.m, self.n, self.k, self.block_m, self.block_n, self.block_k)
        if main > INTERPRETER_STEPS // 2:
            raise too_costly(self, ("m", "n", "k"), f"{self.m}x{self.n}x{self.k} in {self.block_m}x{self.block_n}x"
                                                    f"{self.block_k} tiles is {main:,} program-steps, over the "
                                                    f"{INTERPRETER_STEPS // 2:,} Triton's interpreter runs in time; "
                                                    "larger tiles help too")
        sweep = sum(interpreter_steps(s, s, s, bm, bn, SWEEP_BLOCK_K) for s in sizes for bm, bn in SWEEP_TILES)
        if main + sweep > INTERPRETER_STEPS:
            raise ConfigError("sweep_sizes", f"the sweep is {sweep:,} program-steps in Triton's interpreter "
                                             f"(allowed: <= {INTERPRETER_STEPS - main:,} beside the main GEMM; e.g. 48,64)")


def _counted(a, b, block_m, block_n, block_k, group_m, num_warps=4, order=None):
    counters = torch.zeros(len(TENSORS), dtype=torch.int64, device=a.device)
    c = matmul(a, b, block_m, block_n, block_k, group_m, counters, num_warps, order=order)
    return c, dict(zip(TENSORS, counters.tolist()))


def run(config: GemmConfig, ctx) -> Result:
    """The chosen GEMM, seed 002's 5x5 example and the tile sweep, each counted in the kernel and checked; then the
    execution model on the chosen preset. One generator draws every input, in that order."""
    torch.set_num_threads(1)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, config.dtype)
    g = torch.Generator().manual_seed(config.seed)
    ctx.progress(0.05, "GEMM")
    metrics, tables, checks, recorded = chosen_gemm(config, g, device, dtype)
    elem = torch.empty((), dtype=dtype).element_size()
    ctx.progress(0.15, "seed 002's 5x5 example")
    for part_tables, part_checks in (seed_example(g, device, dtype), tile_sweep(config, g, device, dtype, ctx)):
        tables.update(part_tables)
        checks += part_checks
    ctx.progress(0.85, "execution model")
    model_tables, model_check = execution_model(config, recorded, elem)
    tables.update(model_tables)
    return Result(metrics=metrics, tables=tables, checks=checks + [model_check],
                  notes=["Counted bytes are the loads the program issues to global memory; on a GPU, L2 serves the "
                         "repeats of a band that other programs of the same wave also read, which GROUP_M ordering makes more likely."])


def chosen_gemm(config: GemmConfig, g: torch.Generator, device: str, dtype: torch.dtype):
    """The chosen GEMM with its loads counted and each tile's program id recorded: C against fp64 (within 2x
    torch.matmul's own error in the dtype), the counts against the closed form, intensity from the counts.
    Returns metrics, tables, checks and the recorded program ids."""
    M, N, K, bm, bn = config.m, config.n, config.k, config.block_m, config.block_n
    a64, b64 = torch.randn(M, K, generator=g, dtype=torch.float64), torch.randn(K, N, generator=g, dtype=torch.float64)
    a, b = a64.to(device, dtype), b64.to(device, dtype)
    elem = a.element_size()
    start = time.perf_counter()
    recorded = torch.full((-(-M // bm) * -(-N // bn),), -1, dtype=torch.int32, device=device)  # program id per tile
    c, counted = _counted(a, b, bm, bn, config.block_k, config.group_m, config.num_warps, order=recorded)
    metrics = {"device": device, "seconds": round(time.perf_counter() - start, 4)}
    exact = (a.double() @ b.double()).cpu()  # the inputs as rounded to dtype, multiplied exactly enough
    err = (c.double().cpu() - exact).abs().max().item()
    err_torch = (torch.matmul(a, b).double().cpu() - exact).abs().max().item()
    closed = closed_form_traffic(M, N, K, elem, bm, bn)
    checks = [Check(f"C vs fp64 matmul within 2x torch.matmul's own error in {config.dtype}", err,
                    2 * err_torch + 1e-6 * K ** 0.5, reference="torch.matmul (fp64, and in the same dtype)",
                    detail=f"torch.matmul in {config.dtype}: {err_torch:.3g}"),
              Check("bytes counted in the kernel equal the closed form for the tiling",
                    sum(abs(counted[t] - closed[t]) for t in TENSORS), 0, reference="A: M·K·⌈N/BN⌉, B: K·N·⌈M/BM⌉, C: M·N",
                    detail=f"{sum(counted.values()):,} bytes counted")]
    flops = 2 * M * N * K
    metrics.update({f"bytes_{t}": counted[t] for t in TENSORS})
    metrics["bytes_counted"] = sum(counted.values())
    metrics["flops"], metrics["intensity_flop_per_byte"] = flops, flops / metrics["bytes_counted"]
    metrics["loads_per_mac"] = (counted["A"] + counted["B"]) / elem / (M * N * K)
    tables = {"traffic": [{"tensor": t, "bytes counted": counted[t], "closed form": closed[t]} for t in TENSORS]}
    return metrics, tables, checks, recorded


def seed_example(g: torch.Generator, device: str, dtype: torch.dtype) -> tuple[dict, list[Check]]:
    """Seed 002's example: one row of A (5 elements) against five columns of B, on the kernel's own counters."""
    row, cols = torch.randn(1, 5, generator=g).to(device, dtype), torch.randn(5, 5, generator=g).to(device, dtype)
    elem = row.element_size()
    _, seed_count = _counted(row, cols, 16, 16, 16, 1)
    seed = tile_reuse(1, 5, 5)
    seed.update(counted_A_loads=seed_count["A"] // elem, counted_B_loads=seed_count["B"] // elem)
    return {"seed_5x5": [seed]}, [Check(
        "seed 002: the row loaded once (5), the columns five times (25), 25 multiply-adds",
        abs(seed["counted_A_loads"] - 5) + abs(seed["counted_B_loads"] - 25) + abs(seed["macs"] - 25), 0,
        reference="seed 002's count", detail=f"counted {seed['counted_A_loads']} + {seed['counted_B_loads']} loads")]


def tile_sweep(config: GemmConfig, g: torch.Generator, device: str, dtype: torch.dtype, ctx) -> tuple[dict, list[Check]]:
    """Intensity from the counters as the tile grows, each count against the closed form and loads per multiply-add
    against 1/BM + 1/BN; the same counts on each preset's fp16 tensor-core roofline (2 bytes per element)."""
    sweep, bad_counts, bad_ratio = [], 0, 0.0
    sizes = config.sizes()
    for i, size in enumerate(sizes):
        x, y = (torch.randn(size, size, generator=g).to(device, dtype) for _ in range(2))
        elem = x.element_size()
        for tm, tn in SWEEP_TILES:
            ctx.progress(0.2 + 0.6 * i / len(sizes), f"sweep {size}³, tile {tm}x{tn}")
            _, cnt = _counted(x, y, tm, tn, SWEEP_BLOCK_K, config.group_m)
            ref = closed_form_traffic(size, size, size, elem, tm, tn)
            bad_counts += sum(abs(cnt[t] - ref[t]) for t in TENSORS)
            loads_per_mac = (cnt["A"] + cnt["B"]) / elem / size ** 3
            if size % tm == 0 and size % tn == 0:  # the generalised seed count: 1/BM + 1/BN loads per multiply-add
                bad_ratio = max(bad_ratio, abs(loads_per_mac - (1 / tm + 1 / tn)))
            total = sum(cnt.values())
            sweep.append({"size": size, "tile": f"{tm}x{tn}", "block_m": tm, "block_n": tn, "bytes counted": total,
                          "intensity counted": 2 * size ** 3 / total, "loads_per_mac counted": loads_per_mac,
                          "intensity formula": 2 * size ** 3 / (elem * (size * size * (-(-size // tn) + -(-size // tm) + 1))),
                          "intensity large-K limit": 2 / (elem * (1 / tm + 1 / tn))})
    if not sweep:
        return {"sweep": sweep}, []
    elem = torch.empty((), dtype=dtype).element_size()
    tables = {"sweep": sweep,
              "roofline": [{"device": name, "size": r["size"], "tile": r["tile"], "intensity_fp16": r["intensity counted"] * elem / 2,
                            "attainable_flops_per_s": attainable(spec["peak_flops"]["fp16/bf16 tensor"], dram(name)[2],
                                                                 r["intensity counted"] * elem / 2)}
                           for name, spec in DEVICES.items() for r in sweep],
              "roofs": [{"device": name, "peak_flops": spec["peak_flops"]["fp16/bf16 tensor"], "bandwidth": dram(name)[2]}
                        for name, spec in DEVICES.items()]}
    tables["roof_lines"] = roof_lines(tables["roofs"], LINE_INTENSITIES)
    return tables, [Check("sweep: every count equals the closed form", bad_counts, 0, reference="tile geometry"),
                    Check("sweep: loads per multiply-add = 1/BLOCK_M + 1/BLOCK_N (the seed's count, generalised)",
                          bad_ratio, 1e-12, reference="(BM + BN)·K loads for BM·BN·K multiply-adds")]


def execution_model(config: GemmConfig, recorded: torch.Tensor, elem: int) -> tuple[dict, Check]:
    """The chosen GEMM on the chosen preset (model): its hierarchy, the program order the kernel recorded against
    the L2 model's, what one wave (a program per SM) touches for this GEMM and a large one where GROUP_M matters,
    and the tensor-core shapes."""
    M, N, K, bm, bn, bk = config.m, config.n, config.k, config.block_m, config.block_n, config.block_k
    h = gemm_hierarchy(M, N, K, bm, bn, bk, config.num_warps, config.device, elem)
    tiles_n = -(-N // bn)
    order = [{"program": int(pid), "tile_m": i // tiles_n, "tile_n": i % tiles_n} for i, pid in enumerate(recorded.tolist())]
    model = program_order(M, N, bm, bn, config.group_m)
    check = Check("the program order the kernel recorded is the order the L2 model assumes",
                  sum(model[r["program"]] != (r["tile_m"], r["tile_n"]) for r in order), 0, reference="program_order (Python)")
    tables = {"hierarchy": [{k: (list(v) if isinstance(v, tuple) else v) for k, v in h.items()}], "program_order": order,
              "wave_footprint": [{**r, "case": case, "group_m": gm}
                                 for case, (m_, n_, k_, tm, tn) in ((f"this GEMM ({M}x{N}x{K})", (M, N, K, bm, bn)),
                                                                    ("4096³ in 128x128 tiles", (4096, 4096, 4096, 128, 128)))
                                 for gm in sorted({1, config.group_m, 8})
                                 for r in wave_footprint(program_order(m_, n_, tm, tn, gm), h["sms"], tm, tn, k_, elem)],
              "tensor_core_shapes": [
                  {"level": "tensor core (per cycle)", "m x n x k": "x".join(map(str, TENSOR_CORE_SHAPE)), "FMAs": 64},
                  {"level": "warp WMMA instruction", "m x n x k": "x".join(map(str, WMMA_SHAPE)), "FMAs": 16 ** 3},
                  {"level": "one tl.dot of this program", "m x n x k": f"{bm}x{bn}x{bk}", "FMAs": bm * bn * bk}]}
    tables["largest_wave_footprint"] = largest_wave_footprint(tables["wave_footprint"])
    tables["hierarchy"][0].update(hierarchy_totals(tables["hierarchy"][0]))
    tables["warp_tiles"] = warp_tiles(tables["hierarchy"][0])
    return tables, check


def hierarchy_totals(h: dict) -> dict:
    """The launch's warps and threads in all (model): every program runs warps_per_program warps of threads_per_warp."""
    warps = h["programs"] * h["warps_per_program"]
    return {"warps": warps, "threads": warps * h["threads_per_warp"]}


def warp_tiles(h: dict) -> list[dict]:
    """One program's tile of C split among its warps (model): a warp_grid of warp_tile rectangles, row-major, each
    row as [row0, row1) x [col0, col1) in the program's tile."""
    (wm, wn), (tm, tn) = h["warp_grid"], h["warp_tile"]
    return [{"warp": i * wn + j, "row0": i * tm, "row1": (i + 1) * tm, "col0": j * tn, "col1": (j + 1) * tn}
            for i in range(wm) for j in range(wn)]


def _v3_to_v4(result: dict) -> None:
    """Runs stored before the bytes counted in all, the launch's warps and threads and the warp tiles were computed
    here (the page added and multiplied them)."""
    m, h = result["metrics"], result["tables"]["hierarchy"][0]
    m["bytes_counted"] = m["bytes_A"] + m["bytes_B"] + m["bytes_C"]
    h.update(hierarchy_totals(h))
    result["tables"]["warp_tiles"] = warp_tiles(h)


def largest_wave_footprint(rows: list[dict]) -> list[dict]:
    """Per case and GROUP_M, the most bytes any one wave touches: what L2 must hold for every wave's loads to hit."""
    largest: dict[tuple, int] = {}
    for r in rows:
        key = (r["case"], r["group_m"])
        largest[key] = max(largest.get(key, 0), r["bytes"])
    return [{"case": case, "group_m": gm, "bytes": b} for (case, gm), b in largest.items()]


RESULT = Schema(
    metrics=(
        "device", "seconds", "bytes_A", "bytes_B", "bytes_C", "bytes_counted", "flops", "intensity_flop_per_byte", "loads_per_mac",
    ),
    tables={
        "traffic": ("bytes counted", "closed form", "tensor"),
        "seed_5x5": ("A_loads", "B_loads", "counted_A_loads", "counted_B_loads", "k", "loads", "loads_per_mac",
                     "macs", "macs_per_load", "tile"),
        "sweep": ("block_m", "block_n", "bytes counted", "intensity counted", "intensity formula",
                  "intensity large-K limit", "loads_per_mac counted", "size", "tile"),
        "roofline": ("attainable_flops_per_s", "device", "intensity_fp16", "size", "tile"),
        "roofs": ("bandwidth", "device", "peak_flops"),
        "roof_lines": ("attainable_flops_per_s", "bandwidth", "device", "intensity", "peak_flops"),
        "hierarchy": ("accumulator_registers_per_thread", "concurrent_programs", "grid", "k_steps", "limited_by",
                      "macs_per_thread", "max_warps_per_sm", "outputs_per_thread", "programs", "programs_per_sm",
                      "shared_bytes_per_program", "sms", "tensor_core_ops_per_wmma", "threads_per_program",
                      "threads", "threads_per_warp", "useful_fraction", "warp_grid", "warp_tile", "warps",
                      "warps_per_program", "waves", "wmma_per_program", "wmma_per_warp"),
        "program_order": ("program", "tile_m", "tile_n"),
        "wave_footprint": ("A_bands", "B_bands", "bytes", "case", "group_m", "programs", "wave"),
        "tensor_core_shapes": ("FMAs", "level", "m x n x k"),
        "largest_wave_footprint": ("bytes", "case", "group_m"),
        "warp_tiles": ("col0", "col1", "row0", "row1", "warp"),
    },
    version=4, upgrades={1: lambda result: result["tables"].__setitem__(  # v1: the page took the largest
        "largest_wave_footprint", largest_wave_footprint(result["tables"]["wave_footprint"])),
                         2: lambda result: result["tables"].__setitem__(  # v2: the page drew min(peak, bw × intensity)
        "roof_lines", roof_lines(result["tables"]["roofs"], LINE_INTENSITIES)), 3: _v3_to_v4},
)

EXPERIMENT = define(__name__, GemmConfig,
                    "tiled Triton GEMM: error vs torch.matmul, bytes counted per tile shape vs the closed form, the execution hierarchy",
                    run_fn=run, schema=RESULT)
