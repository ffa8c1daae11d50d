"""kvcache.serve: continuous batching over a request trace, paged manager against a contiguous allocator
of the same memory. The serving scheduler runs the same trace on both; see backend/serving/allocator_sim.py
for what is measured."""
from __future__ import annotations

import dataclasses
import math

from backend.config import Config, ConfigError, setting
from backend.limits import cost
from backend.experiments import define
from backend.result import Check, Result, Schema
from backend.kvcache.manager import admission_watermark
from backend.serving.allocator_sim import simulate_contiguous, simulate_paged
from backend.serving.workload import Trace, sharegpt_system_prompts
from backend.uploads import load_trace

# CPU seconds of the two simulations, fitted per piece on this 2-core box (least squares over 7 settings, within 15%);
# cost() adds the load.
PAGED_STEP_S = 16e-6             # one busy step of the scheduler over the paged manager
PAGED_TOKEN_S = 2.1e-6           # one decoded token there (a grow when it opens or fills a block, prefix hashing)
PAGED_SAMPLE_BLOCK_S = 2e-9      # every 5 steps the sample sums every block's fill
PAGED_SNAPSHOT_BLOCK_S = 1.7e-6  # one block of one pool snapshot (invariants, the drawn pool, its JSON)
CONTIGUOUS_STEP_S = 32e-6        # one busy step over the contiguous allocator (more requests wait: more steps, fewer tokens each)
CONTIGUOUS_TOKEN_S = 0.4e-6
SERVE_MARGIN = 1.2


@dataclasses.dataclass
class ServeConfig(Config):
    trace: str = setting("synthetic", help="'synthetic' (ShareGPT-like), or an uploaded CSV's hash, or a .csv in the data "
                                           "folder's traces/: arrival,prompt_len,output_len[,prefix_id,prefix_len]")
    n_requests: int = setting(1000, min=1, max=10_000, help="requests in the synthetic trace")
    rate: float = setting(1.0, min=0.01, max=100.0, help="synthetic arrivals per scheduler step")
    block_size: int = setting(16, min=1, max=256, help="tokens per KV block")
    num_blocks: int = setting(2048, min=1, max=65_536, help="blocks in the pool (the contiguous buffer gets the same slots)")
    max_model_len: int = setting(2048, min=16, max=32_768, help="the contiguous allocator reserves this many slots per request")
    policy: str = setting("swap", choices=("swap", "recompute"), help="how a preempted sequence comes back")
    prefix_caching: bool = setting(True, help="share full blocks of identical prompt prefixes")
    seed: int = setting(0, min=0, max=2**31 - 1, help="synthetic trace")

    def requests(self) -> Trace:
        if self.trace == "synthetic":
            return sharegpt_system_prompts(self.n_requests, self.rate, self.seed, self.max_model_len)
        try:  # by content hash or a name in the data folder's traces/, never a path (see backend/uploads.py)
            return load_trace(self.trace)
        except ValueError as err:
            raise ConfigError("trace", str(err)) from None

    @property
    def cost_drivers(self) -> tuple[str, ...]:
        """An uploaded trace fixes its requests and arrivals (n_requests and rate do nothing then): of the settings,
        only the pool's size (sampled every 5 steps, drawn at every snapshot) drives its cost."""
        return ("n_requests", "num_blocks", "max_model_len") if self.trace == "synthetic" else ("num_blocks",)

    def estimate(self):
        """Two runs of the scheduler over the trace, one step at a time until the last request arrives and drains;
        a step with nothing running is skipped, so only busy steps cost (at most one per decoded token and request).
        The paged pool holds about its slots / mean length requests at once, the contiguous buffer one per
        max_model_len slots: the second drains the same tokens in more steps."""
        if self.trace == "synthetic":
            requests, span = self.n_requests, self.n_requests / self.rate
            mean_prompt, mean_output = 190.0, 230.0  # the synthetic log-normals' means (exp(5 + 0.8^2/2), exp(5 + 0.9^2/2))
            tokens, drain = requests * mean_output, min(self.max_model_len, 5500)  # ~4 sd up the output tail
            mean_total = mean_prompt + mean_output
        else:
            trace = self.requests()
            requests, span = len(trace), float(trace.arrival.max())
            tokens, drain = int(trace.output_len.sum()), int(trace.total.max())
            mean_total = float(trace.total.mean())
        slots = self.num_blocks * self.block_size
        busy = [min(max(span, tokens / max(1.0, held)) + drain, tokens + requests)  # busy steps, paged then contiguous
                for held in (slots / mean_total, slots // self.max_model_len)]
        snapshots = busy[0] / 20 if busy[0] < 1220 else 61 + 30 * math.log2(busy[0] / 1220)
        cpu = (busy[0] * (PAGED_STEP_S + self.num_blocks / 5 * PAGED_SAMPLE_BLOCK_S) + tokens * PAGED_TOKEN_S
               + snapshots * self.num_blocks * PAGED_SNAPSHOT_BLOCK_S + busy[1] * CONTIGUOUS_STEP_S + tokens * CONTIGUOUS_TOKEN_S)
        return cost(data_bytes=2 * busy[0] * 600 + requests * 3000 + self.num_blocks * 30 * 400,
                    seconds=SERVE_MARGIN * cpu)

    def check(self) -> None:
        capacity = self.num_blocks * self.block_size
        if self.max_model_len > capacity:
            raise ConfigError("num_blocks", f"{self.num_blocks} blocks of {self.block_size} hold {capacity} tokens, less than "
                                            f"max_model_len={self.max_model_len} (allowed: num_blocks >= {-(-self.max_model_len // self.block_size)})")
        trace = self.requests()
        longest = int(trace.total.max())
        if longest > self.max_model_len:
            raise ConfigError("max_model_len", f"{self.max_model_len} is shorter than the trace's longest request ({longest} tokens)")
        prompt = int(trace.prompt_len.max())  # admitted with room for its first output token, beside the watermark
        need = -(-(prompt + 1) // self.block_size) + admission_watermark(self.num_blocks)
        if need > self.num_blocks:
            raise ConfigError("num_blocks", f"{self.num_blocks} blocks of {self.block_size} can never admit the trace's longest prompt "
                                            f"({prompt} tokens) beside the admission watermark (allowed: num_blocks >= {need})")


def run(config: ServeConfig, ctx) -> Result:
    trace = config.requests()
    ctx.progress(0.05, f"paged: {len(trace)} requests")
    paged = simulate_paged(trace, config.block_size, config.num_blocks, config.policy, config.prefix_caching)
    ctx.progress(0.7, "contiguous")
    contiguous = simulate_contiguous(trace, config.num_blocks * config.block_size, config.max_model_len)
    waste = [{"allocator": name, "kind": kind, "share": share}
             for name, result in (("paged", paged), ("contiguous", contiguous)) for kind, share in result["waste"].items()]
    waste += [{"allocator": "paged", "kind": "token state", "share": paged["utilization"]},
              {"allocator": "contiguous", "kind": "token state", "share": contiguous["utilization"]}]
    series = [dict(s, allocator="paged") for s in paged["samples"]] + [dict(s, allocator="contiguous") for s in contiguous["samples"]]
    for s in series:
        s["utilization"] = s["filled_slots"] / s["allocated_slots"] if s["allocated_slots"] else None
    checks = [Check("paged: every sample's filled slots fit in its allocated blocks",
                    sum(1 for s in paged["samples"] if s["filled_slots"] > s["allocated_slots"]), 0,
                    reference="block accounting"),
              Check("paged: block-manager invariants held at every snapshot", paged["invariant_failures"], 0,
                    reference="ref counts = table entries; free xor used; no table points at a free block")]
    mean_len = float(trace.total.mean())
    model_util = 1 - (config.block_size - 1) / 2 / mean_len  # half a block wasted per sequence, on average
    metrics = {
        "requests": len(trace), "utilization.paged": round(paged["utilization"], 4),
        "utilization.contiguous": round(contiguous["utilization"], 4),
        "utilization.paged_model": round(model_util, 4),
        "max_running.paged": paged["max_running"], "max_running.contiguous": contiguous["max_running"],
        "concurrency_ratio": round(paged["max_running"] / max(1, contiguous["max_running"]), 2),
        "steps.paged": paged["steps"], "steps.contiguous": contiguous["steps"],
        "preemptions": paged["preemptions"], "swaps": paged["swaps"], "cow_copies": paged["cow_copies"],
        "evictions": paged["evictions"], "prefix_hit_rate": round(paged["prefix_hit_rate"], 4),
        "prefix_hit_tokens": paged["prefix_hit_tokens"],
    }
    notes = [f"Model: a sequence wastes (block_size-1)/2 slots of its last block on average; with mean length "
             f"{mean_len:.0f} tokens that predicts {100 * model_util:.1f}% utilisation (measured {100 * paged['utilization']:.1f}%)."]
    if config.prefix_caching and config.block_size > 64:
        notes.append(f"Shared system prompts are 64 tokens; a block of {config.block_size} is only hashed once full, so "
                     "a prefix shorter than one block is never a hit.")
    snapshots = [{"step": s["step"], "ref": [b["ref"] for b in s["pool"]], "fill": [b["fill"] for b in s["pool"]],
                  "state": [b["state"] for b in s["pool"]], "owner": [b["owner"] for b in s["pool"]], "tables": s["tables"]}
                 for s in paged["snapshots"]]
    blocks_by_state(snapshots)
    return Result(metrics=metrics, checks=checks, notes=notes,
                  tables={"waste": waste, "series": series, "snapshots": snapshots, "events": paged["events"][:500]})


def blocks_by_state(snapshots: list[dict]) -> None:
    """Each snapshot's pool counted by state: blocks in use, cached but free (reusable by a prefix hit), free."""
    for snap in snapshots:
        snap.update({"used": snap["state"].count("used"), "cached_free": snap["state"].count("cached, free"),
                     "free": snap["state"].count("free")})


RESULT = Schema(
    metrics=(
        "requests", "utilization.paged", "utilization.contiguous", "utilization.paged_model", "max_running.paged",
        "max_running.contiguous", "concurrency_ratio", "steps.paged", "steps.contiguous", "preemptions", "swaps",
        "cow_copies", "evictions", "prefix_hit_rate", "prefix_hit_tokens",
    ),
    tables={
        "waste": ("allocator", "kind", "share"),
        "series": ("allocated_slots", "allocator", "filled_slots", "fragmentation", "not_yet", "reserved_never",
                   "running", "step", "swapped", "utilization", "waiting"),
        "snapshots": ("fill", "owner", "ref", "state", "step", "tables", "used", "cached_free", "free"),
        "events": ("blocks", "op", "seq", "step"),
    },
    version=2, upgrades={1: lambda result: blocks_by_state(result["tables"]["snapshots"])},  # v1: the page counted
)

EXPERIMENT = define(__name__, ServeConfig,
         "continuous batching over a request trace: paged KV blocks against contiguous max-length reservations",
         run_fn=run, schema=RESULT)
