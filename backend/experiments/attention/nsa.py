"""attention.nsa: native sparse attention's three gated branches, checked against masked dense attention, and
the KV bytes each query reads as the sequence grows.

Checks: the output equals a dense attention (torch SDPA over every key) that applies the same masks, within
fp32 round-off; the blocks selected and their importance equal the paper's eqs. 8-11 computed one query at a
time in float64 (backend/attention/nsa_reference.py); every query's selection holds the first block and its
local blocks and nothing after it; the KV rows
the gathers read equal the closed form per branch; with every block selected, the selected branch is full
causal attention (SDPA with is_causal). Measured: KV bytes per query (counted from the gather indices) for
a sweep of sequence lengths beside full attention's.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from backend.attention import nsa_reference
from backend.attention.nsa import (BRANCHES, closed_form_rows, kv_bytes_per_query, make_params, masked_dense_reference,
                                   nsa_attention)
from backend.config import Config, ConfigError, setting
from backend.limits import cost, too_costly
from backend.experiments import define
from backend.result import Check, Result, Schema


TRITON_INTERPRETER_STEPS = 256  # (query, group, block) steps of the selected-block kernel in Triton's interpreter
GATHER_BUDGET = 2 ** 26         # elements of one gathered K (or V) tensor: groups x N x keys per query x d
REFERENCE_DOTS = 150_000        # q·K_cmp products the per-query float64 selection reference makes (~1 s): beyond, every k-th query
IMPORTANCE_TOL = 1e-5           # fp32 sums of at most heads x l/d probabilities against float64


@dataclasses.dataclass
class NSAConfig(Config):
    seq_len: int = setting(512, min=64, max=2048, help="sequence length N of the checked run (the reference is dense, N²)")
    head_dim: int = setting(32, choices=(16, 32, 64), help="head dimension d")
    heads: int = setting(4, min=1, max=16, help="query heads")
    kv_heads: int = setting(1, choices=(1, 2, 4), help="KV heads (GQA groups; a group shares one selection)")
    cmp_block: int = setting(16, choices=(8, 16, 32), help="tokens per compressed block (l)")
    cmp_stride: int = setting(8, choices=(4, 8, 16), help="tokens between compressed blocks (d in the paper)")
    sel_block: int = setting(32, choices=(16, 32, 64), help="tokens per selection block (l')")
    top_n: int = setting(4, min=2, max=32, help="selected blocks per query (n, with the first and the local blocks)")
    local_blocks: int = setting(2, min=1, max=4, help="latest blocks always selected: the query's own and those before it (the paper: 2)")
    window: int = setting(64, min=1, max=2048, help="sliding-window tokens")
    impl: str = setting("torch", choices=("torch", "triton"), help="selected branch: gathered in PyTorch, or the Triton kernel")
    sweep_sizes: tuple[int, ...] = setting([512, 1024, 2048, 4096], item_range=(64, 8192),
                                            help="sequence lengths for KV bytes per query (empty: none)")
    seed: int = setting(0, min=0, max=2**31 - 1, help="inputs and weights")

    def sizes(self) -> list[int]:
        return list(self.sweep_sizes)

    cost_drivers = ("seq_len", "heads", "top_n", "window", "sweep_sizes")

    def estimate(self):
        """Three NSA passes (as set; every block selected, the largest; each sweep size on one group) each hold their
        gathered K and V and the scores of every head over its keys, in fp32; the masked dense reference holds N²
        scores per head; the heat map and the selection table are Python rows; the Triton kernel ~10 ms a step; the
        float64 selection reference one Python q·K_cmp product at a time (about four to an op: 1.2 s for 64k measured)."""
        n, d, per_group = self.seq_len, self.head_dim, self.heads // self.kv_heads

        def pass_bytes(length: int, groups: int, top_n: int) -> int:
            keys = min(top_n * self.sel_block, length) + min(self.window, length) + length // self.cmp_stride
            return 4 * (2 * groups * length * keys * d + 3 * groups * per_group * length * keys)

        main = [pass_bytes(n, self.kv_heads, self.top_n), pass_bytes(n, self.kv_heads, -(-n // self.sel_block))]
        sweep = [pass_bytes(length, 1, self.top_n) for length in self.sizes()]
        passes = main + sweep
        programs = n * self.kv_heads * self.top_n if self.impl == "triton" else 0
        dense = 4 * 4 * self.heads * n * n
        # the bytes above bound what the passes hold; their work is far less than one flop per held element times d
        # (measured: 1.6 s of CPU at N = 512, 5.5 s at N = 2,048, bench/limits.py), hence the 1/8 and the 3/4
        # the sweep's one-group passes hold about a quarter of their count at once (0.44 GiB peak at the defaults)
        return cost(data_bytes=3 * max(main) // 2 + max(sweep, default=0) // 4 + dense, flops=(sum(passes) * d // 2 + dense * d // 4) / 8,
                    moved_bytes=3 * (sum(passes) + dense) / 4,
                    ops=n * 30 + 64 * n // self.sel_block + programs * 100 + 5000
                    + min(REFERENCE_DOTS, n * self.heads * (n // self.cmp_stride) // 2) // 4)

    def gathered(self, n: int, groups: int) -> int:
        """Elements of the selected and window gathers of K (V is the same again) for n queries."""
        return groups * n * (min(self.top_n * self.sel_block, n) + min(self.window, n)) * self.head_dim

    def check(self) -> None:
        programs = self.seq_len * self.kv_heads * self.top_n
        if self.impl == "triton" and not torch.cuda.is_available() and programs > TRITON_INTERPRETER_STEPS:
            raise ConfigError("seq_len", f"the Triton kernel in the interpreter: seq_len·kv_heads·top_n = {programs:,} block steps is "
                                         f"too slow (allowed: <= {TRITON_INTERPRETER_STEPS}, e.g. seq_len 64 with top_n 4)")
        if self.top_n < 1 + self.local_blocks:
            raise ConfigError("top_n", f"{self.top_n} cannot hold the first block and {self.local_blocks} local blocks "
                                       f"(allowed: {1 + self.local_blocks}..32, or fewer local_blocks)")
        if self.heads % self.kv_heads:
            raise ConfigError("kv_heads", f"{self.kv_heads} does not divide heads={self.heads} (allowed: a divisor of heads)")
        if self.cmp_stride > self.cmp_block:
            raise ConfigError("cmp_stride", f"{self.cmp_stride} skips tokens between blocks of {self.cmp_block} (allowed: <= cmp_block)")
        if self.sel_block % self.cmp_stride:
            raise ConfigError("sel_block", f"{self.sel_block} is not a multiple of cmp_stride={self.cmp_stride} (allowed: multiples)")
        sizes = self.sizes()
        if self.gathered(self.seq_len, self.kv_heads) > GATHER_BUDGET:
            raise too_costly(self, ("seq_len", "top_n", "window"),
                             f"gathers {self.gathered(self.seq_len, self.kv_heads):,} K elements with these kv_heads, top_n, "
                             f"sel_block, window and head_dim, over the {GATHER_BUDGET:,} a run may gather")
        if sizes and self.gathered(max(sizes), 1) > GATHER_BUDGET:
            raise ConfigError("sweep_sizes", f"N={max(sizes)} gathers {self.gathered(max(sizes), 1):,} K elements per group "
                                             f"(allowed: <= {GATHER_BUDGET:,}; use shorter sizes or fewer selected tokens)")


def reference_queries(n: int, heads: int, cmp_stride: int) -> list[int]:
    """The queries the float64 selection reference checks: all of them, or every k-th (the last always) when their
    q·K_cmp products (heads x visible compressed blocks, about n/(2 d) per query) would pass REFERENCE_DOTS."""
    step = max(1, -(-n * heads * (n // cmp_stride) // 2 // REFERENCE_DOTS))
    return sorted(set(range(0, n, step)) | {n - 1})


def run(config: NSAConfig, ctx) -> Result:
    """NSA on random inputs against dense attention with the same masks, its selection against the paper's
    definitions in float64 and its reads against the closed form; then KV bytes per query over the sizes."""
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(config.seed)
    params = make_params(config.head_dim, config.cmp_block, g)
    q, k, v = _inputs(config, g, config.seq_len, config.kv_heads)
    ctx.progress(0.05, "NSA")
    counters = torch.zeros(2, dtype=torch.int64) if config.impl == "triton" else None
    out, chosen = nsa_attention(q, k, v, params, **_geometry(config), local_blocks=config.local_blocks,
                                selected_counters=counters)
    ctx.progress(0.25, "masked dense reference")
    ref = masked_dense_reference(q, k, v, chosen, config.sel_block, config.window)
    checks = [Check("NSA equals dense attention with the same masks (fp32 round-off)", (out - ref).abs().max().item(), 1e-5,
                    reference="torch SDPA over every key with boolean masks, same gates")]
    ctx.progress(0.3, "selection, one query at a time in float64")
    checks += selection_checks(config, q, k, params, chosen)
    checks += read_checks(config, chosen, counters, q.element_size())
    ctx.progress(0.4, "every block selected vs full causal attention")
    checks.append(every_block_check(config, q, k, v, params))
    sweep = bytes_sweep(config, g, params, ctx)
    n_sel = -(-config.seq_len // config.sel_block)
    gates = chosen["gates"].mean((0, 1))
    bytes_now = kv_bytes_per_query(chosen["kv_rows_read"], config.head_dim, q.element_size())
    return Result(
        metrics={**{f"kv_bytes_per_query.{k_}": v_ for k_, v_ in bytes_now.items()},
                 **{f"gate_mean.{b}": float(gates[i]) for i, b in enumerate(BRANCHES)},
                 "selection_blocks": n_sel, "compressed_blocks": chosen["kc"].shape[1],
                 "nsa_over_full_last": bytes_now["nsa_last"] / bytes_now["full_last"]},  # the share NSA reads
        tables={"sweep": sweep, **selection_tables(config, chosen)},
        checks=checks,
        notes=["KV bytes are counted from the rows the gathers index, per query and KV head (K and V, fp32); full attention reads every "
               "earlier token. The weights of φ and the gate are random: the structure, not a trained model."])


def _geometry(config: NSAConfig) -> dict:
    return dict(cmp_block=config.cmp_block, cmp_stride=config.cmp_stride, sel_block=config.sel_block,
                top_n=config.top_n, window=config.window)


def _inputs(config: NSAConfig, g: torch.Generator, length: int, groups: int):
    """Random q (the group's heads), k and v for `groups` KV groups of `length` tokens."""
    H, G, d = config.heads, config.kv_heads, config.head_dim
    return (torch.randn(groups * (H // G), length, d, generator=g),
            torch.randn(groups, length, d, generator=g), torch.randn(groups, length, d, generator=g))


def selection_checks(config: NSAConfig, q, k, params, chosen: dict) -> list[Check]:
    """The importance and the blocks chosen against a per-query float64 loop over the paper's definitions (every
    query, or a sample when there are too many)."""
    n = config.seq_len
    queries = reference_queries(n, config.heads, config.cmp_stride)
    reference = nsa_reference.select(q, k, params, config.cmp_block, config.cmp_stride, config.sel_block, config.top_n,
                                     config.local_blocks, queries)
    importance_err, differ = nsa_reference.selection_differences(chosen["blocks"], chosen["real"], chosen["importance"], reference,
                                                                 tie=IMPORTANCE_TOL)
    sampled = f"{len(queries)} of {n} queries" + ("" if len(queries) == n else f" (every {queries[1]}th)")
    return [Check("selection-block importance equals the paper's eq. 9 over eq. 8's p_cmp, summed over the group's heads",
                  importance_err, IMPORTANCE_TOL, reference="per-query loop in float64 over the definitions (nsa_reference)",
                  detail=sampled),
            Check("the blocks chosen equal the paper's: the first and local blocks, then the top p_slc (eq. 11)", differ, 0,
                  reference="per-query loop in float64, sorted p_slc", detail=f"{sampled}; queries whose blocks differ beyond a "
                                                                              f"{IMPORTANCE_TOL:g} tie")]


def read_checks(config: NSAConfig, chosen: dict, counters, elem: int) -> list[Check]:
    """The forced blocks held by every query (and none after it), the KV rows the gathers read against the closed
    form, and, for the Triton kernel, the bytes it counted."""
    n, local = config.seq_len, config.local_blocks
    t = torch.arange(n)
    blocks, real = chosen["blocks"], chosen["real"]
    first = (blocks == 0) & real
    behind = (t // config.sel_block)[None, :, None] - blocks
    local_held = ((behind >= 0) & (behind < local) & real).sum(-1)
    after = ((blocks * config.sel_block > t[None, :, None]) & real).sum().item()
    closed = closed_form_rows(n, **_geometry(config))
    checks = [Check(f"every query's selection holds the first block and its {local} latest, and none after it",
                    (local_held != (t // config.sel_block + 1).clamp(max=local)[None]).sum().item() + (~first.any(-1)).sum().item()
                    + after, 0, reference="block geometry"),
              Check("KV rows the gathers read equal the closed form per branch",
                    sum((chosen["kv_rows_read"][b] - closed[b][None]).abs().sum().item() for b in BRANCHES), 0,
                    reference="block geometry")]
    if counters is not None:
        closed_bytes = closed["selected"].sum().item() * config.kv_heads * config.head_dim * elem
        checks.append(Check("bytes of K and V the Triton kernel counted equal the closed form",
                            abs(counters[0].item() - closed_bytes) + abs(counters[1].item() - closed_bytes), 0,
                            reference="block geometry", detail=f"{counters.sum().item():,} bytes counted"))
    return checks


def every_block_check(config: NSAConfig, q, k, v, params) -> Check:
    """With every block selected, the selected branch must be full causal attention (torch's SDPA)."""
    H, G = config.heads, config.kv_heads
    n_sel = -(-config.seq_len // config.sel_block)
    _, everything = nsa_attention(q, k, v, params, **{**_geometry(config), "top_n": n_sel}, local_blocks=config.local_blocks)
    full = F.scaled_dot_product_attention(q, k.repeat_interleave(H // G, 0), v.repeat_interleave(H // G, 0), is_causal=True)
    return Check("with every block selected, the selected branch is full causal attention",
                 (everything["branch_outputs"]["selected"] - full).abs().max().item(), 1e-5,
                 reference="torch SDPA, is_causal=True")


def bytes_sweep(config: NSAConfig, g: torch.Generator, params, ctx) -> list[dict]:
    """KV bytes per query counted at each sweep length, on one KV group (every group reads alike)."""
    sweep = []
    for i, length in enumerate(config.sizes()):
        ctx.progress(0.5 + 0.45 * i / max(1, len(config.sizes())), f"KV bytes per query at N={length}")
        q, k, v = _inputs(config, g, length, 1)
        _, c = nsa_attention(q, k, v, params, **_geometry(config), local_blocks=config.local_blocks)
        counted = kv_bytes_per_query(c["kv_rows_read"], config.head_dim, q.element_size())
        sweep.append({"seq_len": length, **counted, "nsa_over_full_last": counted["nsa_last"] / counted["full_last"]})
    return sweep


def selection_tables(config: NSAConfig, chosen: dict) -> dict:
    """For the page: group 0's importance at every stride-th query (a heat map) and every query's chosen blocks."""
    n = config.seq_len
    n_sel = -(-n // config.sel_block)
    blocks, real = chosen["blocks"], chosen["real"]
    stride = max(1, n // 64)
    importance = [{"query": int(tq), "sel_block": j, "importance": float(chosen["importance"][0, tq, j]),
                   "selected": bool(((blocks[0, tq] == j) & real[0, tq]).any())}
                  for tq in range(0, n, stride) for j in range(n_sel) if j * config.sel_block <= tq]
    selection = [{"query": tq, "blocks": sorted(int(b) for b, r in zip(blocks[0, tq], real[0, tq]) if r),
                  "compressed_visible": int(chosen["cmp_visible"][0, tq].sum())} for tq in range(n)]
    with_read_spans(selection, config.sel_block, config.window)
    return {"importance": importance, "selection": with_spans(selection, config.cmp_block, config.cmp_stride)}


def with_spans(selection: list[dict], cmp_block: int, cmp_stride: int) -> list[dict]:
    """Each query's compressed branch as a span of keys: its c visible compressed keys summarise tokens 0 up to the
    last one's end, (c − 1)·stride + block (0 where none is visible yet)."""
    for row in selection:
        c = row["compressed_visible"]
        row["compressed_end"] = (c - 1) * cmp_stride + cmp_block if c else 0
    return selection


def with_read_spans(selection: list[dict], sel_block: int, window: int) -> list[dict]:
    """Each query's selected blocks and window as spans of keys [start, end): block b covers b·l' up to the query
    itself (causal), the window the last `window` tokens up to it."""
    for row in selection:
        t = row["query"]
        row["selected_spans"] = [[b * sel_block, min((b + 1) * sel_block, t + 1)] for b in row["blocks"]]
        row["window_start"], row["window_end"] = max(0, t - window + 1), t + 1
    return selection


def _v1_share(result: dict) -> None:
    """Version 1 -> 2: the last query's share of full attention's bytes (the page divided them before)."""
    m = result["metrics"]
    m["nsa_over_full_last"] = m["kv_bytes_per_query.nsa_last"] / m["kv_bytes_per_query.full_last"]


def _v2_spans(result: dict) -> None:
    """Version 2 -> 3: each query's compressed span (the page multiplied it out before)."""
    with_spans(result["tables"]["selection"], result["config"]["cmp_block"], result["config"]["cmp_stride"])


def _v3_read_spans(result: dict) -> None:
    """Version 3 -> 4: each query's selected and window spans (the page multiplied them out before)."""
    with_read_spans(result["tables"]["selection"], result["config"]["sel_block"], result["config"]["window"])


RESULT = Schema(
    metrics=(
        "kv_bytes_per_query.compressed_mean", "kv_bytes_per_query.compressed_last",
        "kv_bytes_per_query.selected_mean", "kv_bytes_per_query.selected_last", "kv_bytes_per_query.window_mean",
        "kv_bytes_per_query.window_last", "kv_bytes_per_query.nsa_mean", "kv_bytes_per_query.nsa_last",
        "kv_bytes_per_query.full_mean", "kv_bytes_per_query.full_last", "gate_mean.compressed", "gate_mean.selected",
        "gate_mean.window", "selection_blocks", "compressed_blocks", "nsa_over_full_last",
    ),
    tables={
        "sweep": ("compressed_last", "compressed_mean", "full_last", "full_mean", "nsa_last", "nsa_mean",
                  "nsa_over_full_last", "selected_last", "selected_mean", "seq_len", "window_last", "window_mean"),
        "importance": ("importance", "query", "sel_block", "selected"),
        "selection": ("blocks", "compressed_end", "compressed_visible", "query", "selected_spans", "window_start",
                      "window_end"),
    },
    version=4, upgrades={1: _v1_share, 2: _v2_spans, 3: _v3_read_spans},
)

EXPERIMENT = define(__name__, NSAConfig,
                    "native sparse attention (compressed, selected, window; gated) vs masked dense SDPA; KV bytes per query",
                    run_fn=run, schema=RESULT)
