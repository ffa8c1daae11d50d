"""Spawn one process per rank on this machine, with a free port, a timeout, and clean failure.

Every rank runs `rank_fn(rank, world_size, config, ctx)` inside a gloo process group and sends its
payload (plain Python data) back over a queue. The parent waits for all payloads. If any rank
raises, dies or the timeout passes, every rank is killed and the error of the first rank that
failed is raised. Ranks also ask the kernel to kill them if the parent dies, so no rank outlives
its run.
"""
from __future__ import annotations

import ctypes
import datetime
import os
import queue
import signal
import socket
import sys
import time
import traceback

import torch.multiprocessing as mp


class RankFailed(RuntimeError):
    def __init__(self, rank: int, detail: str):
        last = detail.strip().splitlines()[-1] if detail.strip() else detail
        super().__init__(f"rank {rank} failed: {last}")
        self.rank, self.detail = rank, detail


class RunTimeout(TimeoutError):
    pass


def free_port() -> int:
    """A TCP port free right now on loopback (the OS picks it); never a fixed one."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def init_rank(rank: int, world_size: int, port: int, timeout_s: float, backend: str = "gloo") -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # ranks share 2 cores; more threads only fight
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def _rank_entry(rank_fn, rank, world_size, port, config, ctx, results) -> None:
    _die_with_parent()
    import torch.distributed as dist

    code = 0
    try:
        init_rank(rank, world_size, port, ctx.timeout_s, ctx.dist_backend)
        payload = rank_fn(rank, world_size, config, ctx)
        results.put(("ok", rank, payload))
    except BaseException:
        results.put(("err", rank, traceback.format_exc()))
        code = 1
    finally:
        results.close()
        results.join_thread()  # flush the payload before exiting
        if code == 0 and dist.is_initialized():
            dist.destroy_process_group()
    # Skip interpreter teardown after a failure: peers may be gone and gloo can block in its destructor.
    os._exit(code)


def spawn_ranks(rank_fn, world_size: int, config, ctx) -> list:
    """Run rank_fn on world_size fresh processes; return their payloads in rank order. Payloads must be plain
    data (numbers, lists, numpy arrays): a torch tensor would travel as a shared-memory handle that dies with its rank."""
    port = ctx.port or free_port()
    mp_ctx = mp.get_context("spawn")
    results = mp_ctx.Queue()
    procs = [
        mp_ctx.Process(target=_rank_entry, args=(rank_fn, r, world_size, port, config, ctx, results), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    payloads: dict[int, object] = {}
    deadline = time.monotonic() + ctx.timeout_s
    try:
        while len(payloads) < world_size:
            try:
                kind, rank, data = results.get(timeout=0.1)
            except queue.Empty:
                if any(r not in payloads and p.exitcode not in (None, 0) for r, p in enumerate(procs)):
                    raise _root_cause(results, procs, {})
                if time.monotonic() > deadline:
                    missing = [r for r in range(world_size) if r not in payloads]
                    raise RunTimeout(f"ranks {missing} did not finish within the {ctx.timeout_s:g} s timeout")
                continue
            if kind == "err":
                raise _root_cause(results, procs, {rank: data})
            payloads[rank] = data
        for p in procs:
            p.join(timeout=10)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=5)
        results.close()
        results.cancel_join_thread()
    return [payloads[r] for r in range(world_size)]


# A rank whose peer vanished fails inside gloo's transport; that error is a consequence, not a cause.
_PEER_LOST = ("gloo/transport", "Connection closed by peer", "Connection reset by peer", "Broken pipe")


def _root_cause(results, procs, errors: dict[int, str], grace_s: float = 1.0) -> RankFailed:
    """Collect what every rank says for a moment, then blame the rank most likely to have started it:
    one that died without a word, else one whose error is not a lost peer, else the first to report."""
    end = time.monotonic() + grace_s
    while time.monotonic() < end:
        try:
            kind, r, data = results.get(timeout=0.05)
        except queue.Empty:
            continue
        if kind == "err":
            errors.setdefault(r, data)
    silent = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in errors]
    if silent:
        code = procs[silent[0]].exitcode
        how = signal.Signals(-code).name if code < 0 else f"exit code {code}"
        return RankFailed(silent[0], f"process ended with {how} without reporting an error")
    causes = [r for r, tb in errors.items() if not any(m in tb for m in _PEER_LOST)]
    rank = causes[0] if causes else next(iter(errors))
    return RankFailed(rank, errors[rank])
