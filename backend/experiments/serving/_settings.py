"""The settings both serving experiments share: the workload and the scheduler's knobs, with the
rules that keep every request servable (checked on the server, one message naming the field)."""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

from backend.config import Config, ConfigError, setting
from backend.kvcache.manager import admission_watermark
from backend.limits import cost
from backend.models.llama import TinyDecoder
from backend.serving.calibrate import Calibration, calibrate
from backend.serving.engine import tiny_llama
from backend.serving.scheduler import SchedulerConfig
from backend.serving.simulator import PREDICTION_DRAWS
from backend.serving.workload import WORKLOADS, Trace
from backend.uploads import load_trace

MAX_LEN = 256  # prompt + output tokens of the longest request a trace may hold
# Cost per request, measured on the loaded 2-core box at the defaults (with margin): the engine served 24 requests in
# 4.1 s of its thread's CPU time; the simulator 100,000 requests in 29 s of CPU at load 12 (wall clock up to 3x that).
REAL_REQUEST_S = 0.07  # CPU seconds a real request takes (bench/limits.py: ~0.05 measured)
SIMULATED_REQUEST_S = 0.4e-3  # CPU seconds a simulated request takes (serving.simulate: 13.4 s of CPU at 5,000, 15.6 s at 30,000)


@dataclasses.dataclass
class ServingSettings(Config):
    workload: str = setting("sharegpt", choices=tuple(WORKLOADS), help="ShareGPT-like lengths, or few-shot prompts sharing 4 prefixes of 96 tokens")
    trace: str = setting("synthetic", help="the requests served and simulated: 'synthetic' (the workload at the rate), or an "
                                           "uploaded CSV's hash, or a .csv in the data folder's traces/: arrival (ms), prompt_len, "
                                           "output_len[, prefix_id, prefix_len]; profiling and the load curve stay synthetic")
    rate: float = setting(8.0, min=0.1, max=10_000.0, help="requests arriving per second (Poisson)")
    policy: str = setting("chunked", choices=("chunked", "fcfs"), help="chunked prefill mixing decodes and prefill chunks under the token budget, or FCFS whole-prompt prefill steps")
    token_budget: int = setting(256, min=16, max=8192, help="tokens computed per step at most")
    max_batch: int = setting(16, min=1, max=1024, help="running requests at most")
    block_size: int = setting(16, min=1, max=64, help="tokens per KV block (a power of two, for the kernel)")
    num_blocks: int = setting(128, min=4, max=1_000_000, help="KV blocks in the pool")
    prefix_caching: bool = setting(False, help="reuse the KV of cached full prompt blocks")
    preemption: str = setting("recompute", choices=("recompute", "swap"), help="when blocks run out, drop the newest request's KV and recompute it later, or swap it to CPU memory")
    seed: int = setting(0, min=0, max=2**31 - 1, help="model weights and traces")
    profile_requests: int = setting(10, min=4, max=400, help="requests the real engine serves to fit the cost model (half at the rate, half at twice it)")
    held_out_requests: int = setting(12, min=2, max=400, help="requests the real engine serves (twice) to measure the simulator's fidelity")
    sweep_requests: int = setting(200, min=10, max=100_000, help="simulated requests per point of the load curve (and per knob)")

    def serving_cost(self, real: float, simulated: float, seconds: float = 0.0):
        """A run serving `real` requests with the tiny LLaMA and `simulating` more: its calibration (profile, and the
        held-out requests twice; the simulator on them once drawn and once per draw of its prediction) comes on top."""
        real += self.profile_requests + 2 * self.held_out_requests
        simulated += (1 + PREDICTION_DRAWS) * self.held_out_requests
        return cost(data_bytes=simulated * 4000 + real * 50_000,  # a simulated request: 3.3 kB measured at 175k
                    seconds=real * REAL_REQUEST_S + simulated * SIMULATED_REQUEST_S + seconds)

    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(self.block_size, self.num_blocks, self.max_batch, self.token_budget,
                               self.policy == "chunked", self.prefix_caching, self.preemption)

    def synthetic(self, n: int, seed: int, rate: float | None = None) -> Trace:
        return WORKLOADS[self.workload](n, rate or self.rate, seed, max_len=MAX_LEN)

    def requests(self, n: int, seed: int) -> Trace:
        """The first n requests of the uploaded trace, or n synthetic ones."""
        if self.trace == "synthetic":
            return self.synthetic(n, seed)
        return self.uploaded().head(n)

    def uploaded(self) -> Trace:
        """The uploaded trace (by content hash or a name in the data folder's traces/, never a path: backend/uploads.py)."""
        try:
            return load_trace(self.trace).with_arrival_unit(1e-3)
        except ValueError as err:
            raise ConfigError("trace", str(err)) from None

    def calibrate(self, progress=None) -> tuple[TinyDecoder, Calibration]:
        """The model, and the simulator calibrated against it on these settings (see calibrate.py)."""
        torch.set_num_threads(1)
        model = tiny_llama(self.seed)
        half = self.profile_requests // 2
        profiles = [self.synthetic(half, self.seed + 1000), self.synthetic(self.profile_requests - half, self.seed + 1001, 2 * self.rate)]
        return model, calibrate(model, self.scheduler_config(), profiles, self.requests(self.held_out_requests, self.seed), progress)

    def check(self) -> None:
        if self.block_size & (self.block_size - 1):
            raise ConfigError("block_size", f"{self.block_size} is not a power of two (allowed: 1, 2, 4, ..., 64)")
        if self.max_batch > self.token_budget:
            raise ConfigError("max_batch", f"{self.max_batch} running requests cannot all decode in a step of "
                                           f"token_budget={self.token_budget} (allowed: max_batch <= token_budget)")
        if self.policy == "fcfs" and self.token_budget < MAX_LEN:
            raise ConfigError("token_budget", f"{self.token_budget} is less than a whole prompt (with what a preempted request had "
                                              f"generated) may need under fcfs (allowed: >= {MAX_LEN}, or policy=chunked)")
        if self.trace != "synthetic":
            trace = self.uploaded()
            longest = int(np.argmax(trace.prompt_len + trace.output_len))
            total = int(trace.prompt_len[longest] + trace.output_len[longest])
            if total > MAX_LEN:
                raise ConfigError("trace", f"a request has {total} tokens, prompt and output (allowed: prompt_len + output_len <= {MAX_LEN}, "
                                           "the tiny model's context)")
        need = -(-MAX_LEN // self.block_size) + admission_watermark(self.num_blocks)
        if self.num_blocks < need:
            raise ConfigError("num_blocks", f"{self.num_blocks} blocks of {self.block_size} cannot hold a request of {MAX_LEN} "
                                            f"tokens beside the admission watermark (allowed: >= {need})")
