"""The real engine: each scheduler step is one forward of the tiny LLaMA over the whole batch.

The batch's tokens (prefill chunks and decode tokens of every request, back to back) go through the
model as one (N, d) matrix: embedding, then per layer RMSNorm, Q/K/V projections with RoPE at each
token's own position, K and V written into the paged pool at the slots the manager booked, attention
over the block tables, the output projection and the SwiGLU MLP; logits only for the rows that
sample, greedy. The weights are TinyDecoder's, so the model's own forward is an independent reference:
every logits row the engine sampled from must equal one causal forward of the request's whole sequence
without any KV cache (`logits_error`), and its tokens must equal `greedy_alone` (the model decoding one
request with its contiguous cache).
"""
from __future__ import annotations

import math
import time

import numpy as np
import torch

from backend.attention.rope import apply_rope, rope_angles
from backend.kvcache.tensor_store import KVTensorStore
from backend.models.llama import ModelShape, TinyDecoder
from backend.serving.attention import TorchPagedAttention
from backend.serving.scheduler import Scheduler, SchedulerConfig, Step, scored_prefill_pairs
from backend.serving.simulator import DRIFT_LAG

MODEL_SHAPE = ModelShape(vocab=256, d_model=128, n_layers=4, n_heads=8, n_kv_heads=2, d_head=16, d_ff=384, variant="gqa")


def tiny_llama(seed: int = 0, shape: ModelShape = MODEL_SHAPE) -> TinyDecoder:
    torch.manual_seed(seed)
    return TinyDecoder(shape).eval()


def forward_batch(model: TinyDecoder, store: KVTensorStore, tokens, pos, slots, rows, attention):
    """Logits (len(rows), vocab) of the batch rows `rows`; writes every token's K and V into the store.
    `attention(q, layer_pool)` attends over the block tables (built once per step)."""
    x = model.embed(tokens)
    n = len(tokens)
    cos, sin = rope_angles(pos, model.shape.d_head, dtype=x.dtype)
    for layer, block in enumerate(model.blocks):
        a = block.attn
        h = block.attn_norm(x)
        q = apply_rope(a.wq(h).view(n, a.n_heads, a.d_head).transpose(0, 1), cos, sin).transpose(0, 1)
        k = apply_rope(a.wk(h).view(n, a.n_kv_heads, a.d_head).transpose(0, 1), cos, sin).transpose(0, 1)
        store.write(layer, slots, k, a.wv(h).view(n, a.n_kv_heads, a.d_head))
        x = x + a.wo(attention(q, store.layer(layer)).reshape(n, -1))
        x = x + block.ffn(block.ffn_norm(x))
    return model.head(model.norm(x[rows]))


class ModelExecutor:
    """Runs a step for real; its time is what the step took (the scheduler measures it)."""
    measured = True

    def __init__(self, model: TinyDecoder, config: SchedulerConfig, attention=TorchPagedAttention):
        s = model.shape
        self.model, self.attention = model, attention
        self.store = KVTensorStore(s.n_layers, config.num_blocks, config.block_size, s.n_kv_heads, s.d_head,
                                   dtype=model.embed.weight.dtype)
        self.warm_up(config.block_size)

    @torch.no_grad()
    def warm_up(self, bs: int) -> None:
        """One throwaway step (a prefill chunk and a decode), so the first measured step does not pay for torch's
        first calls. It writes K/V into blocks 0 and 1, which any request writes again before reading."""
        tables, seq, pos = torch.tensor([[0], [1]]), torch.tensor([0, 0, 1]), torch.tensor([0, 1, min(bs - 1, 3)])
        forward_batch(self.model, self.store, torch.zeros(3, dtype=torch.long), pos, tables[seq, 0] * bs + pos,
                      torch.tensor([1, 2]), self.attention(tables, seq, pos, bs))

    @torch.no_grad()
    def swap_seconds_per_block(self, blocks: int = 8, repeats: int = 15) -> float:
        """What one KV block's copy to CPU memory, or back, takes: the median over `repeats` round trips of
        `blocks` blocks through this pool's own store (on this thread's CPU clock, like a step). The copies are
        those `execute` makes for a swap (on a GPU they would cross PCIe; here they stay in RAM)."""
        ids, times = list(range(min(blocks, self.store.kv.shape[1]))), []
        for _ in range(repeats):
            start = time.thread_time()
            self.store.swap_out(-1, ids)
            self.store.swap_in(-1, ids)
            times.append(time.thread_time() - start)
        return float(np.median(times)) / (2 * len(ids))

    @torch.no_grad()
    def designed_steps(self, config: SchedulerConfig, repeats: int = 20) -> dict | None:
        """Steps the profiles cannot tell apart, measured one by one: in a trace's steps decode tokens and the KV
        blocks they read rise together, and so do a chunk's tokens and the pairs its attention scores, so a fit to
        those steps may trade one cost for the other (fits to single runs put a KV block at 5-120 µs). Here they
        move on their own: decode batches of 1-16 requests with 1-8 blocks each, and one prefill chunk of 16-256
        tokens after 0 or 256 cached ones, each timed `repeats` times on this thread's CPU clock through the same
        forward and attention as a step, the shapes taken in turn in every round (a shape's repeats back to back
        met one moment of the machine's drift, and with 5 of them a shape's mean was off by about 9%). Their
        features are a StepLog table's (the step leaves the pool's contents meaningless: each call writes K/V
        before it reads them)."""
        bs, pool = config.block_size, self.store.kv.shape[1]
        shapes = [(b, n, 0, 0) for b in (1, 4, 8, 16) for n in (1, 4, 8) if b <= config.max_batch and b * n <= pool]
        shapes += [(0, 0, chunk, cached) for chunk in (16, 64, 128, 256) for cached in (0, 256)
                   if chunk <= config.token_budget and -(-(chunk + cached) // bs) <= pool]
        if not shapes:  # a pool or budget too small for any of them
            return None
        steps = []
        for decodes, blocks, chunk, cached in shapes:
            if decodes:  # request i holds blocks i*blocks .. and decodes its last slot
                tables = torch.arange(decodes * blocks).view(decodes, blocks)
                seq, pos = torch.arange(decodes), torch.full((decodes,), blocks * bs - 1)
                kv, pairs = decodes * blocks, 0
            else:
                width = -(-(chunk + cached) // bs)
                tables, seq, pos = torch.arange(width)[None], torch.zeros(chunk, dtype=torch.long), torch.arange(cached, cached + chunk)
                kv, pairs = width, scored_prefill_pairs(np.array([chunk]), np.array([chunk + cached]), bs)
            slots = tables[seq, pos // bs] * bs + pos % bs
            sampled = torch.arange(len(tables)) if decodes else torch.tensor([chunk - 1])
            steps.append(((chunk, decodes, kv, pairs), (tables, seq, pos, slots, sampled)))
        rows = []
        for _ in range(repeats):
            for row, (tables, seq, pos, slots, sampled) in steps:
                start = time.thread_time()
                forward_batch(self.model, self.store, torch.zeros(len(seq), dtype=torch.long), pos, slots, sampled,
                              self.attention(tables, seq, pos, bs)).argmax(-1)
                rows.append((*row, time.thread_time() - start))
        return dict(zip(("prefill_tokens", "decode_tokens", "kv_blocks", "prefill_pairs", "time"), np.array(rows, dtype=np.float64).T))

    @torch.no_grad()
    def execute(self, step: Step, sched: Scheduler):
        for op, rid, block_ids in step.block_ops:
            (self.store.swap_out if op == "swap_out" else self.store.swap_in)(rid, block_ids)
        if not len(step.rids):  # a step that only moved KV
            return None, np.zeros(0, np.int64)
        bs = sched.config.block_size
        ids = [sched.m.block_ids(int(r)) for r in step.rids]
        width = max(map(len, ids))
        tables = torch.tensor([t + [0] * (width - len(t)) for t in ids], dtype=torch.long)
        takes = torch.from_numpy(step.takes)
        seq = torch.repeat_interleave(torch.arange(len(ids)), takes)
        offsets = torch.arange(len(seq)) - (torch.cumsum(takes, 0) - takes)[seq]
        pos = torch.from_numpy(step.starts)[seq] + offsets
        slots = tables[seq, pos // bs] * bs + pos % bs
        tokens = torch.tensor([sched.token(int(step.rids[s]), int(p)) for s, p in zip(seq.tolist(), pos.tolist())])
        rows = (torch.cumsum(takes, 0) - 1)[torch.from_numpy(step.samples)]
        logits = forward_batch(self.model, self.store, tokens, pos, slots, rows, self.attention(tables, seq, pos, bs))
        if sched.record_batches:  # kept by reference, no copy: the step's time is not changed
            sched.sampled_logits.append((step.rids[step.samples], logits))
        return None, logits.argmax(-1).numpy()


def serve(model: TinyDecoder, trace, config: SchedulerConfig, attention=TorchPagedAttention,
          record_batches: bool = False, progress=None) -> Scheduler:
    return Scheduler(trace, config, record_batches).run(ModelExecutor(model, config, attention), progress)


PACE_BURST = 2 * DRIFT_LAG  # rounds a pacing engine steps in a row: its drift's autocorrelation is measured within them


def work_done(sched: Scheduler) -> float:
    """The share of its trace's tokens an engine has computed (the last output token of each is sampled, not computed)."""
    t = sched.trace
    return float(sched.computed.sum()) / float((t.prompt_len + t.output_len - 1).sum())


def serve_interleaved(model: TinyDecoder, runs: list[tuple], progress=None, start_round: list[int] | None = None,
                      pace_with: list[int | None] | None = None) -> list[Scheduler]:
    """Several engines, each with its own trace, config and KV pool, stepped in turn: one step of each, then
    the next round. Each measures only its own steps (its thread's CPU time while it runs), so every engine
    sees the same machine: on a shared one, the speed drifts by tens of percent over seconds (other people's
    work in the caches and memory bus), and runs made one after the other would each get a different machine.
    runs: (trace, config, record_batches) per engine; start_round: the round each engine joins (0: at once).
    pace_with: per engine, None, or the engine it keeps pace with: it steps in bursts of PACE_BURST rounds,
    each begun only while it is not ahead of that engine in work_done, so a short run's steps are spread over
    a longer one's rounds and meet the machine of all of them (run at once, they met only its first quarter).
    Each engine's `rounds`: the round of each of its steps."""
    scheds = [Scheduler(trace, config, record) for trace, config, record in runs]
    pace_with = pace_with or [None] * len(runs)
    waiting = sorted(zip(start_round or [0] * len(runs), range(len(runs))))
    live, rounds, total = {}, 0, sum(len(s.trace) for s in scheds)
    burst_left = [0] * len(runs)
    for s in scheds:
        s.rounds = []
    while live or waiting:
        while waiting and waiting[0][0] <= rounds:
            i = waiting.pop(0)[1]
            live[i] = scheds[i].steps(ModelExecutor(model, scheds[i].config))
        for i, it in list(live.items()):
            lead = pace_with[i]
            if lead is not None and not burst_left[i]:
                if lead in live and work_done(scheds[i]) > work_done(scheds[lead]):
                    continue  # ahead of its lead: sits this round out
                burst_left[i] = PACE_BURST
            burst_left[i] -= 1
            if next(it, None) is None:
                del live[i]
            else:
                scheds[i].rounds.append(rounds)
        rounds += 1
        if progress and rounds % 200 == 0:
            progress(sum(s.finished for s in scheds) / total)
    return scheds


@torch.no_grad()
def greedy_alone(model: TinyDecoder, prompt: list[int], new_tokens: int) -> list[int]:
    """The reference: one request, the model's own contiguous KV cache, greedy."""
    caches = model.new_caches(len(prompt) + new_tokens)
    logits, out = model(torch.tensor(prompt), 0, caches), []
    for i in range(new_tokens):
        out.append(int(logits[-1].argmax()))
        if i + 1 < new_tokens:
            logits = model(torch.tensor(out[-1:]), len(prompt) + i, caches)
    return out


@torch.no_grad()
def logits_error(model: TinyDecoder, sched: Scheduler) -> tuple[float, int]:
    """(largest |engine logits - recomputed logits|, rows compared) over every row the engine sampled from (a run
    served with record_batches). The reference recomputes each request from scratch: one causal forward of its
    prompt and the tokens it was served (the last one excepted, which nothing reads), no KV cache, no paging;
    row prompt_len - 1 + i is what the engine's i-th sample saw. A wrong KV slot, block table, position or
    a stale cache after a preemption shows up as an error far above float32's ~1e-6."""
    got: dict[int, list[torch.Tensor]] = {}
    for rids, logits in sched.sampled_logits:
        for rid, row in zip(rids.tolist(), logits):
            got.setdefault(rid, []).append(row)
    worst, rows = 0.0, 0
    for rid in range(len(sched.trace)):  # every request, each output token sampled from one recorded row
        served, prompt, out = got.get(rid, []), sched.trace.prompt(rid), sched.outputs.get(rid, [])
        if not served or len(served) != len(out) or len(out) != int(sched.trace.output_len[rid]):
            return math.inf, rows
        want = model(torch.tensor(prompt + out[:-1]))[len(prompt) - 1:]
        worst = max(worst, (torch.stack(served) - want).abs().max().item())
        rows += len(served)
    return worst, rows


def token_mismatches(model: TinyDecoder, sched: Scheduler) -> list[int]:
    """Requests whose served tokens differ from decoding them alone."""
    trace = sched.trace
    return [rid for rid in range(len(trace))
            if sched.outputs.get(rid) != greedy_alone(model, trace.prompt(rid), int(trace.output_len[rid]))]
