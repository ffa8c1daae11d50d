"""kvcache.paged_decode: the tiny decoder generates with its K and V stored in the paged pool.

Several sequences decode round-robin, so their blocks interleave in the pool. Prefill attends over
K/V gathered through the block table; every decode step runs the Triton paged-attention kernel
(kernels/paged_attention.py). Checked: logits equal those of the same model with a contiguous cache;
block size 16 equals block size 1; a forked sequence writes through copy-on-write without touching
its parent; a sequence swapped out to CPU memory and back decodes on unchanged; the kernel against
gather + SDPA on the final pool.
"""
from __future__ import annotations

import dataclasses

import torch

from backend.config import Config, ConfigError, setting
from backend.limits import cost
from backend.experiments import define
from backend.kvcache.paged_decode import decode_paged, reservation_waste, seed_copy_on_write
from backend.models.llama import ModelShape, TinyDecoder
from backend.result import Check, Result, Schema
from backend.serving.attention import paged_attention_reference

TOLERANCE = 1e-4  # fp32 logits, same maths in another summation order


@dataclasses.dataclass
class PagedDecodeConfig(Config):
    sequences: int = setting(2, min=1, max=8, help="sequences decoding together")
    prompt_len: int = setting(12, min=1, max=256, help="prompt length of the first sequence (others vary)")
    new_tokens: int = setting(6, min=1, max=128, help="tokens generated per sequence")
    block_size: int = setting(16, min=1, max=64, help="tokens per block (a power of two for the kernel)")
    num_blocks: int = setting(64, min=1, max=4096, help="blocks in the pool")
    n_heads: int = setting(4, min=1, max=16, help="query heads")
    n_kv_heads: int = setting(2, min=1, max=16, help="KV heads (GQA)")
    first_writer: str = setting("parent", choices=("parent", "child"),
                                help="after the fork, which of the two writes first, and so copies the shared partial block")
    seed: int = setting(0, min=0, max=2**31 - 1, help="weights and prompts")

    cost_drivers = ("new_tokens", "prompt_len", "sequences", "num_blocks")

    def estimate(self):
        """Each decode step runs the paged kernel in Triton's interpreter over every block of every sequence and
        head, and a token-by-token reference over the whole context: a step's cost grows with the square of the
        context length. At the defaults (2 sequences x 6 tokens) 4.9 s of CPU measured, 12.5 s at 12 tokens (bench/limits.py; 21 s before the
        kernel and reference got faster)."""
        lengths = range(self.prompt_len + 20, self.prompt_len + 21 + self.new_tokens)
        pool = self.num_blocks * self.block_size * self.n_kv_heads * 64 * 2 * 4 * 4
        return cost(data_bytes=2 * pool, seconds=1.5 + 0.0003 * self.sequences * (self.n_heads / 4) * sum(n * n for n in lengths))

    def check(self) -> None:
        if self.block_size & (self.block_size - 1):
            raise ConfigError("block_size", f"{self.block_size} is not a power of two (allowed: 1, 2, 4, ..., 64)")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError("n_kv_heads", f"{self.n_kv_heads} does not divide n_heads={self.n_heads}")
        longest = self.prompt_len + 2 * self.sequences + self.new_tokens
        need = (self.sequences + 1) * -(-longest // self.block_size)
        if need > self.num_blocks:
            raise ConfigError("num_blocks", f"{self.num_blocks} blocks cannot hold {self.sequences} sequences of up to "
                                            f"{longest} tokens and a fork (allowed: >= {need})")


def _shape(c: PagedDecodeConfig) -> ModelShape:
    return ModelShape(vocab=128, d_model=64, n_layers=2, n_heads=c.n_heads, n_kv_heads=c.n_kv_heads, d_head=16, variant="gqa")


SEED_MAX_LEN, SEED_TOKENS = 1024, 4        # seed 000: "我爱中国", 4 tokens in a cache reserved for 1,024
SEED_COW = {"from": 3, "to": 5}             # seed 000: "从页3复制到页5"
COW_BLOCK_SIZE = 4                          # the copy-on-write example's own page size (a picture-sized pool of 8)


def seed_checks(model, block_size: int, g) -> tuple[list[Check], dict]:
    """Seed 000's worked numbers, reproduced on real caches: the waste of a 1,024-slot reservation holding 4 tokens,
    and the copy of a shared page 3 to page 5 when one sharer writes."""
    waste = reservation_waste(model, torch.randint(0, model.shape.vocab, (SEED_TOKENS,), generator=g), SEED_MAX_LEN, block_size)
    contiguous_waste = 1 - waste["contiguous_used_bytes"] / waste["contiguous_bytes"]
    paged_waste = 1 - waste["paged_used_bytes"] / waste["paged_bytes"]
    cow = seed_copy_on_write(model, COW_BLOCK_SIZE)
    src, dst = cow["copies"][0] if cow["copies"] else (None, None)
    refs = cow["ref_counts"]
    wrong = (sum([src != SEED_COW["from"], dst != SEED_COW["to"], cow["parent_table"][-1] != SEED_COW["from"],
                  cow["child_table"][-1] != SEED_COW["to"], cow["parent_table"][:-1] != cow["child_table"][:-1],
                  refs[SEED_COW["from"]] != 1, refs[SEED_COW["to"]] != 1]) + sum(refs[b] != 2 for b in cow["parent_table"][:-1]))
    checks = [
        Check("seed 000: 4 tokens in a 1,024-slot reservation waste 1,020 slots", abs(contiguous_waste - (SEED_MAX_LEN - SEED_TOKENS) / SEED_MAX_LEN),
              1e-12, reference="seed 000's example: 1,024 slots reserved, 4 used",
              detail=f"{waste['contiguous_bytes']:,} B reserved, {waste['contiguous_used_bytes']:,} B hold K/V ({100 * contiguous_waste:.2f}% waste)"),
        Check("the same 4 tokens in pages hold ceil(4 / block_size) blocks", abs(waste["paged_reserved_slots"] - -(-SEED_TOKENS // block_size) * block_size),
              0, reference="ceil(4 / block_size) x block_size slots",
              detail=f"{waste['paged_blocks']} block(s): {waste['paged_bytes']:,} B, {100 * paged_waste:.1f}% of it empty"),
        Check("seed 000: a write to a shared page copies page 3 to page 5, only the writer's table changes", wrong, 0,
              reference="seed 000's example: page 3 copied to page 5, the other request still points at page 3",
              detail=f"copies {cow['copies']}; A {cow['parent_table']}, C {cow['child_table']}"),
        Check("the copy holds page 3's K/V; page 3 is unchanged by the write", max(cow["copy_gap"], cow["parent_gap"]), 0,
              reference="page 3's K/V read before the fork", detail="max |difference| over the copied slots and the parent's page"),
    ]
    rows = [{"allocator": "contiguous, 1,024 reserved", "slots_reserved": waste["contiguous_reserved_slots"], "slots_used": SEED_TOKENS,
             "bytes_reserved": waste["contiguous_bytes"], "bytes_used": waste["contiguous_used_bytes"], "waste": contiguous_waste},
            {"allocator": f"paged, block {block_size}", "slots_reserved": waste["paged_reserved_slots"], "slots_used": SEED_TOKENS,
             "bytes_reserved": waste["paged_bytes"], "bytes_used": waste["paged_used_bytes"], "waste": paged_waste}]
    cow_rows = [dict(r, when=snap["label"]) for snap in (cow["shared"], cow["after"]) for r in snap["tables"]]
    cow_pool = [dict(r, when=snap["label"]) for snap in (cow["shared"], cow["after"]) for r in snap["pool"]]
    return checks, {"seed_waste": with_empty_slots(rows), "seed_cow_tables": cow_rows, "seed_cow_pool": cow_pool,
                    "waste": {"contiguous": contiguous_waste, "paged": paged_waste}}


def thin(history: list[dict], keep: int = 24) -> list[dict]:
    """At most about `keep` snapshots for the page: the prefill, fork and swap ones, and decode steps evenly spaced
    (the last always), so a long run's result stays small."""
    steps = [i for i, h in enumerate(history) if h["label"].startswith("decode step")]
    chosen = {i for i, h in enumerate(history) if not h["label"].startswith("decode step")}
    room = max(1, keep - len(chosen))
    chosen |= set(steps[::-(-len(steps) // room)] + steps[-1:]) if steps else set()
    return [history[i] for i in sorted(chosen)]


def run(config: PagedDecodeConfig, ctx) -> Result:
    from kernels.paged_attention import paged_decode

    torch.set_num_threads(1)
    torch.manual_seed(config.seed)
    model = TinyDecoder(_shape(config)).eval()
    g = torch.Generator().manual_seed(config.seed + 1)
    prompts = [torch.randint(0, 128, (config.prompt_len + 2 * i + (i % 2) * 5,), generator=g) for i in range(config.sequences)]
    ctx.progress(0.1, "paged decoding")
    tokens, logits, m, store, log, history, swap = decode_paged(model, prompts, config.new_tokens, config.block_size,
                                                                config.num_blocks, fork_and_swap=True,
                                                                child_first=config.first_writer == "child")
    ctx.progress(0.6, "contiguous reference")
    gaps, final = [], []
    with torch.no_grad():
        for sid, toks in tokens.items():
            full = model(torch.tensor(toks))
            diff = (full - logits[sid]).abs().amax(dim=-1)
            gaps += [{"seq": sid, "position": p, "max_abs_diff": d} for p, d in enumerate(diff.tolist())]
            final += [{"seq": sid, "token": t, "paged": a, "contiguous": b}
                      for t, (a, b) in enumerate(zip(logits[sid][-1].tolist(), full[-1].tolist()))]
    worst = max(r["max_abs_diff"] for r in gaps)
    ctx.progress(0.8, "block size 1")
    t1, l1, *_ = decode_paged(model, prompts, config.new_tokens, 1, config.num_blocks * config.block_size)
    page_gap = max((l1[sid] - logits[sid]).abs().max().item() for sid in t1)
    same_tokens = all(t1[sid] == tokens[sid] for sid in t1)
    # The kernel against gather + SDPA on the final pool, every sequence at once, layer 0.
    seqs = sorted(m.seqs)
    width = max(len(m.seqs[s].table) for s in seqs)
    tables = torch.tensor([m.block_ids(s) + [0] * (width - len(m.seqs[s].table)) for s in seqs], dtype=torch.int32)
    lens = torch.tensor([m.seqs[s].num_tokens for s in seqs], dtype=torch.int32)
    q = torch.randn(len(seqs), config.n_heads, 16, generator=g)
    pool = store.layer(0)
    reference = paged_attention_reference(q, pool, tables, torch.arange(len(seqs)), lens.long() - 1)
    kernel_gap = (paged_decode(q, pool, tables, lens) - reference).abs().max().item()
    parent, child = m.seqs[0], m.seqs[config.sequences]
    shared = sum(1 for a, b in zip(parent.table, child.table) if a is b)
    fork_at = len(prompts[0])
    want_shared, want_copies = fork_at // config.block_size, int(fork_at % config.block_size != 0)
    checks = [
        Check("paged decoding (Triton kernel) equals the contiguous-cache model", worst, TOLERANCE,
              reference="the same model over the whole sequence, no cache", detail="max |logit difference|, all sequences"),
        Check("block size 16 equals block size 1", page_gap if same_tokens else float("inf"), TOLERANCE,
              reference="the same decode with one token per block", detail="same tokens generated" if same_tokens else "tokens differ"),
        Check("Triton paged decode equals gather + SDPA", kernel_gap, 1e-5, reference="torch scaled_dot_product_attention"),
        Check("the fork copied exactly the written block, sharing the full ones", abs(shared - want_shared) + abs(m.stats.cow_copies - want_copies),
              0, reference="copy-on-write: the shared partial block is copied once, full blocks stay shared",
              detail=f"{m.stats.cow_copies} copy-on-write, {shared} blocks still shared"),
    ]
    if swap is not None:
        checks.append(Check("swap out to CPU and back in: the sequence's K/V unchanged", swap["kv_gap"], 0,
                            reference="K/V gathered through the block table before the swap-out",
                            detail=f"blocks {swap['out']} out, {swap['in']} in"))
    ctx.progress(0.9, "seed 000's examples")
    seed, seed_tables = seed_checks(model, config.block_size, g)
    checks += seed
    history = thin(history)
    top = 1 + max([r["block"] for snap in history for r in snap["pool"] if r["ref_count"]] + [0])
    for snap in history:  # the pool's blocks past the highest ever used stay free throughout: not drawn
        snap["pool"] = snap["pool"][:top]
    table_rows = [{"seq": s, "logical": i, "physical": b.id, "ref_count": b.ref_count, "tokens": b.num_tokens}
                  for s in seqs for i, b in enumerate(m.seqs[s].table)]
    metrics = {"sequences": len(seqs), "block_size": config.block_size, "blocks_used": m.used_blocks(),
               "cow_copies": m.stats.cow_copies, "swaps": m.stats.swaps_out, "max_logit_diff": worst,
               "seed_waste.contiguous": seed_tables["waste"]["contiguous"], "seed_waste.paged": seed_tables["waste"]["paged"],
               "kernel": "triton " + ("interpreter" if not torch.cuda.is_available() else "native")}
    return Result(
        metrics=metrics, checks=checks, notes=log,
        tables={"block_tables": table_rows, "history": history, "blocks_held": blocks_held(history), "logit_gaps": gaps,
                "final_logits": final,
                "swap": [swap] if swap else [], "fork": [{"parent": 0, "child": config.sequences, "at_tokens": fork_at,
                                                          "shared_full_blocks": want_shared,
                                                          "copied_by": next((e["seq"] for e in m.events if e["op"] == "copy-on-write"), None)}],
                **{k: v for k, v in seed_tables.items() if k != "waste"}})


def with_empty_slots(rows: list[dict]) -> list[dict]:
    """Each allocator's reserved slots that hold no token: reserved minus used (the page draws the two as a bar)."""
    for r in rows:
        r["slots_empty"] = r["slots_reserved"] - r["slots_used"]
    return rows


def blocks_held(history: list[dict]) -> list[dict]:
    """How many blocks each sequence's table holds at each state of the history (a sequence swapped out holds none
    and has no row): the page's blocks-per-sequence curve."""
    rows = []
    for state, snap in enumerate(history):
        held: dict[int, int] = {}
        for entry in snap["tables"]:
            held[entry["seq"]] = held.get(entry["seq"], 0) + 1
        rows += [{"state": state, "label": snap["label"], "seq": seq, "blocks": n} for seq, n in sorted(held.items())]
    return rows


def _v2_to_v3(result: dict) -> None:
    """Version 2 -> 3: the blocks each sequence holds per state, from the stored history (the page counted them)."""
    result["tables"]["blocks_held"] = blocks_held(result["tables"]["history"])


RESULT = Schema(
    metrics=(
        "sequences", "block_size", "blocks_used", "cow_copies", "swaps", "max_logit_diff", "seed_waste.contiguous",
        "seed_waste.paged", "kernel",
    ),
    tables={
        "block_tables": ("logical", "physical", "ref_count", "seq", "tokens"),
        "history": ("label", "pool", "step", "swapped", "tables"),
        "blocks_held": ("state", "label", "seq", "blocks"),
        "logit_gaps": ("max_abs_diff", "position", "seq"),
        "final_logits": ("contiguous", "paged", "seq", "token"),
        "swap": ("in", "kv_gap", "out", "step"),
        "fork": ("at_tokens", "child", "copied_by", "parent", "shared_full_blocks"),
        "seed_waste": ("allocator", "bytes_reserved", "bytes_used", "slots_empty", "slots_reserved", "slots_used", "waste"),
        "seed_cow_tables": ("logical", "physical", "seq", "tokens", "when"),
        "seed_cow_pool": ("block", "owners", "ref_count", "tokens", "when"),
    },
    version=3, upgrades={1: lambda result: with_empty_slots(result["tables"]["seed_waste"]),  # v1: the page subtracted
                         2: _v2_to_v3},
)

EXPERIMENT = define(__name__, PagedDecodeConfig,
         "tiny GQA decoder generating with its KV in a paged pool via a Triton kernel; equals a contiguous cache",
         run_fn=run, schema=RESULT)
