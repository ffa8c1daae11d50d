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

from backend.config import Config, ConfigError, setting, cost
from backend.experiments import define
from backend.kvcache.paged_decode import decode_paged
from backend.models.llama import ModelShape, TinyDecoder
from backend.result import Check, Result

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
    seed: int = setting(0, min=0, max=2**31 - 1, help="weights and prompts")

    cost_drivers = ("new_tokens", "prompt_len", "sequences", "num_blocks")

    def estimate(self):
        """Each decode step runs the paged kernel in Triton's interpreter over every block of every sequence and
        head, and a token-by-token reference over the whole context: a step's cost grows with the square of the
        context length. Calibrated on this 2-core box with 1.5x margin: 2 sequences x 6 tokens took 21 s of CPU,
        x 12 tokens 51 s (a linear per-step model gave 25 and 46 s, and its largest accepted run passed 120 s)."""
        lengths = range(self.prompt_len + 20, self.prompt_len + 21 + self.new_tokens)
        pool = self.num_blocks * self.block_size * self.n_kv_heads * 64 * 2 * 4 * 4
        return cost(data_bytes=2 * pool, seconds=5 + 0.0019 * self.sequences * (self.n_heads / 4) * sum(n * n for n in lengths))

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


def run(config: PagedDecodeConfig, ctx) -> Result:
    from kernels.paged_attention import paged_decode, paged_decode_reference

    torch.set_num_threads(1)
    torch.manual_seed(config.seed)
    model = TinyDecoder(_shape(config)).eval()
    g = torch.Generator().manual_seed(config.seed + 1)
    prompts = [torch.randint(0, 128, (config.prompt_len + 2 * i + (i % 2) * 5,), generator=g) for i in range(config.sequences)]
    ctx.progress(0.1, "paged decoding")
    tokens, logits, m, store, log = decode_paged(model, prompts, config.new_tokens, config.block_size, config.num_blocks, fork_and_swap=True)
    ctx.progress(0.6, "contiguous reference")
    worst = 0.0
    with torch.no_grad():
        for sid, toks in tokens.items():
            worst = max(worst, (model(torch.tensor(toks)) - logits[sid]).abs().max().item())
    ctx.progress(0.8, "block size 1")
    t1, l1, _, _, _ = decode_paged(model, prompts, config.new_tokens, 1, config.num_blocks * config.block_size)
    page_gap = max((l1[sid] - logits[sid]).abs().max().item() for sid in t1)
    same_tokens = all(t1[sid] == tokens[sid] for sid in t1)
    # The kernel against gather + SDPA on the final pool, every sequence at once, layer 0.
    seqs = sorted(m.seqs)
    width = max(len(m.seqs[s].table) for s in seqs)
    tables = torch.tensor([m.block_ids(s) + [0] * (width - len(m.seqs[s].table)) for s in seqs], dtype=torch.int32)
    lens = torch.tensor([m.seqs[s].num_tokens for s in seqs], dtype=torch.int32)
    q = torch.randn(len(seqs), config.n_heads, 16, generator=g)
    pool = store.layer(0)
    kernel_gap = (paged_decode(q, pool, tables, lens) - paged_decode_reference(q, pool, tables, lens)).abs().max().item()
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
    table_rows = [{"seq": s, "logical": i, "physical": b.id, "ref_count": b.ref_count, "tokens": b.num_tokens}
                  for s in seqs for i, b in enumerate(m.seqs[s].table)]
    return Result(
        metrics={"sequences": len(seqs), "block_size": config.block_size, "blocks_used": m.used_blocks(),
                 "cow_copies": m.stats.cow_copies, "swaps": m.stats.swaps_out, "kernel": "triton " + ("interpreter" if not torch.cuda.is_available() else "native")},
        tables={"block_tables": table_rows}, checks=checks, notes=log)


EXPERIMENT = define(__name__, PagedDecodeConfig,
         "tiny GQA decoder generating with its KV in a paged pool via a Triton kernel; equals a contiguous cache",
         run_fn=run)
