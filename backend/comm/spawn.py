"""Spawn one process per rank on this machine, with a free port, a timeout, and clean failure.

Every rank runs `rank_fn(rank, world_size, config, ctx)` inside a gloo process group and sends its
payload (plain Python data) back over a queue. The parent waits for all payloads. If any rank
raises, dies or the timeout passes, every rank is killed and the error of the rank that started it
is raised, with every rank's whole traceback appended to the run's log.txt. At the timeout each
rank first dumps its Python stack (faulthandler, on SIGUSR1) into the log, and the error names the
ranks that had not reached the collective the others wait in. Ranks ask the kernel to kill them
when their leader dies (a pidfd watch), so no rank outlives its run, even after `kill -9`. Ranks are forked
from a fork server that imported torch once, not started afresh.
"""
from __future__ import annotations

import ctypes
import dataclasses
import datetime
import faulthandler
import os
import queue
import random
import re
import select
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

import torch.multiprocessing as mp


class RankFailed(RuntimeError):
    def __init__(self, rank: int, detail: str):
        last = detail.strip().splitlines()[-1] if detail.strip() else detail
        super().__init__(f"rank {rank} failed: {last}")
        self.rank, self.detail = rank, detail


class RunTimeout(TimeoutError):
    pass


def free_port() -> int:
    """A TCP port free right now on loopback; never a fixed one. Drawn below the kernel's ephemeral range: the port
    is bound later, by rank 0, and in between any process's outgoing connection (gloo opens many) may be handed an
    ephemeral number, never one from below the range."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral_low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 0
    candidates = random.sample(range(10000, ephemeral_low), 64) if ephemeral_low > 10000 + 64 else []
    for port in candidates + [0]:  # 0: the OS picks (no such range known, or all 64 taken)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise OSError("no free TCP port on loopback")


def signal_on_parent_death(sig: int = signal.SIGKILL) -> None:
    """Have the kernel send this process `sig` when its parent ends (Linux's PR_SET_PDEATHSIG; elsewhere nothing).
    Safe in a subprocess's preexec_fn."""
    if sys.platform.startswith("linux"):
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, sig)


def die_with_leader(leader_pid: int) -> None:
    """End this rank when the run's leader ends, even by `kill -9`. A rank's parent is the fork server, which
    stays up while any rank holds its pipe, so the parent-death signal alone would wait for it; a thread watching
    the leader's pidfd ends the rank at once, and the fork server follows when its last rank is gone."""
    signal_on_parent_death()
    try:
        leader = os.pidfd_open(leader_pid)
    except ProcessLookupError:  # the leader ended before this rank started
        os._exit(1)

    def watch() -> None:
        select.select([leader], [], [])  # readable once the leader has exited
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="die-with-leader", daemon=True).start()


def rank_processes(preload: tuple[str, ...] = ()):
    """Where ranks come from: a fork server that imported torch and the backend once (per leader process), so a
    rank starts in a fork instead of importing torch again (about 2.5 s of CPU per rank saved). `preload` names
    the heavier modules a run's ranks import (torch.distributed.pipelining takes 2.6 s): imported once here, not
    once per rank. It counts when the fork server starts, i.e. for the first distributed run of a process."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "backend.experiments", *preload])
    return ctx


def start_fork_server(preload: tuple[str, ...]) -> None:
    """Start the ranks' fork server now with `preload` (rank_processes), so it imports on the other core while this
    process goes on, and every later run's ranks fork from it."""
    import multiprocessing.forkserver

    rank_processes(preload)
    multiprocessing.forkserver.ensure_running()


def output_to(path) -> None:
    """Point this process's stdout and stderr (file descriptors 1 and 2) at the end of `path`."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def run_log(ctx) -> Path | None:
    """The run's log.txt in the store, or None for an unrecorded run (then stderr is its log)."""
    if ctx.run_id and ctx.store_root:
        return Path(ctx.store_root) / "runs" / ctx.run_id / "log.txt"
    return None


def append_log(ctx, text: str) -> None:
    path = run_log(ctx)
    if path is None:
        print(text, file=sys.stderr, flush=True)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as log:
        log.write(text.rstrip("\n") + "\n")


_rendezvous_listener: socket.socket | None = None


def init_rank(rank: int, world_size: int, port: int, timeout_s: float, backend: str = "gloo") -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # ranks share 2 cores; more threads only fight
    timeout = datetime.timedelta(seconds=timeout_s)
    # The rendezvous store listens on loopback only. Given an address, TCPStore still binds every interface;
    # handed a socket that already listens (master_listen_fd), it serves on that one. Gloo's own connections
    # follow GLOO_SOCKET_IFNAME.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    global _rendezvous_listener  # kept open for the life of the rank: the store serves on it
    listener = None
    if rank == 0:
        listener = _rendezvous_listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", port))
        listener.listen(128)
    store = dist.TCPStore("127.0.0.1", port, world_size, rank == 0, timeout=timeout,
                          master_listen_fd=listener.fileno() if listener else None)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)


def _rank_entry(rank_fn, rank, world_size, port, config, ctx, results, leader_pid, stack_path, environ) -> None:
    die_with_leader(leader_pid)
    os.environ.clear()  # the leader's environment now, not the fork server's from when it started
    os.environ.update(environ)
    log = run_log(ctx)
    if log:  # the leader's log, not the fork server's output (a warm leader's fork server started before its run)
        output_to(log)
    import torch.distributed as dist

    stack_file = open(stack_path, "w")
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)

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


def spawn_ranks(rank_fn, world_size: int, config, ctx, preload: tuple[str, ...] = (), restarts: int = 0) -> list:
    """Run rank_fn on world_size fresh processes; return their payloads in rank order. Payloads must be plain
    data (numbers, lists, numpy arrays): a torch tensor would travel as a shared-memory handle that dies with its rank.
    When a rank fails, every rank is ended and, up to `restarts` times, all are started again (ctx.attempt counts
    the restarts; the rank function resumes from its checkpoint), all within the one time limit, as torchrun's
    --max-restarts does."""
    deadline = time.monotonic() + ctx.timeout_s  # start-up counts: the first start waits for the fork server's imports
    for attempt in range(restarts + 1):
        try:
            return _spawn_once(rank_fn, world_size, config, dataclasses.replace(ctx, attempt=attempt), preload,
                               deadline, ctx.port if attempt == 0 else None)
        except RankFailed as err:
            if attempt == restarts:
                raise
            append_log(ctx, f"--- attempt {attempt} ended: {err}; restarting all {world_size} ranks "
                            f"({restarts - attempt} restart(s) left) ---")


def _spawn_once(rank_fn, world_size: int, config, ctx, preload, deadline: float, port: int | None) -> list:
    port = port or free_port()
    mp_ctx = rank_processes(preload)
    results = mp_ctx.Queue()
    # Where each rank's faulthandler writes its stack; a rank creates its file once it is past start-up.
    stacks = run_log(ctx).parent / "stacks" if run_log(ctx) else Path(tempfile.mkdtemp(prefix="explorer-stacks-"))
    stacks.mkdir(parents=True, exist_ok=True)
    procs = [
        mp_ctx.Process(target=_rank_entry, daemon=True, args=(
            rank_fn, r, world_size, port, config, ctx, results, os.getpid(), stacks / f"rank{r}.txt", dict(os.environ)))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    payloads: dict[int, object] = {}
    try:
        while len(payloads) < world_size:
            try:
                kind, rank, data = results.get(timeout=0.1)
            except queue.Empty:
                if any(r not in payloads and p.exitcode not in (None, 0) for r, p in enumerate(procs)):
                    raise _root_cause(results, procs, {}, ctx)
                if time.monotonic() > deadline:
                    raise _timeout(procs, payloads, stacks, ctx, config)
                continue
            if kind == "err":
                raise _root_cause(results, procs, {rank: data}, ctx)
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
        for f in stacks.iterdir():
            f.unlink()
        stacks.rmdir()
    return [payloads[r] for r in range(world_size)]


def _timeout(procs, payloads: dict, stacks: Path, ctx, config=None, grace_s: float = 5.0) -> RunTimeout:
    """Ask every unfinished rank for its Python stack, log them, and name the ranks that had not reached
    the collective the others are blocked in (a rank blocked in one is waiting for those)."""
    pending = [r for r, p in enumerate(procs) if r not in payloads and p.is_alive()]
    for r in pending:
        os.kill(procs[r].pid, signal.SIGUSR1)  # before the rank registered its handler, this ends it: fine

    def dump(r: int) -> str:
        path = stacks / f"rank{r}.txt"
        return path.read_text() if path.exists() else ""

    end = time.monotonic() + grace_s
    while time.monotonic() < end and not all(_main_stack(dump(r)) for r in pending if procs[r].is_alive()):
        time.sleep(0.05)
    waiting, elsewhere, starting = {}, [], []
    for r in pending:
        frames = _main_stack(dump(r))
        append_log(ctx, f"--- rank {r}: Python stack at the {ctx.timeout_s:g} s time limit ---\n"
                        + (dump(r) or "(none: the rank had not started its run)"))
        if not frames:
            starting.append(r)
        elif collective := _collective(frames):
            waiting[r] = collective
        else:
            elsewhere.append(r)
    blocked = ", ".join(f"rank {r} in {name}" for r, name in waiting.items())
    behind = elsewhere + starting
    if waiting and behind:
        what = f"ranks {behind} had not reached the collective the others wait in ({blocked})"
    elif waiting:
        what = f"every unfinished rank was blocked in a collective ({blocked})"
    elif elsewhere:
        what = f"ranks {elsewhere} were still computing"
    else:
        what = f"ranks {starting} had not started their run (process start-up alone took the time)"
    from backend.limits import time_message

    said = time_message(ctx.timeout_s, config, hang=what) if waiting else f"{time_message(ctx.timeout_s, config)}: {what}"
    return RunTimeout(f"{said}; each rank's stack is in the run's log.txt")


def _main_stack(dump: str) -> list[str]:
    """The main thread's frames from a faulthandler dump, innermost first: the block that holds the rank's
    entry point (faulthandler lists every thread, the main one not necessarily first)."""
    for block in re.split(r"\n(?=(?:Current thread|Thread) 0x)", dump):
        if " in _rank_entry" in block:
            return [ln.strip() for ln in block.splitlines()[1:] if ln.strip().startswith("File ")]
    return []


# Frames that mean "blocked in communication": torch.distributed, or this package's send/recv layer.
_COMM_FILES = ("torch/distributed/distributed_c10d.py", "backend/comm/p2p.py")


def _collective(frames: list[str]) -> str | None:
    """The outermost communication call on a stack (e.g. 'all_reduce'), or None if the rank was elsewhere."""
    names = [ln.rsplit(" in ", 1)[1] for ln in frames if any(f in ln for f in _COMM_FILES)]
    return names[-1] if names else None


# A rank whose peer vanished fails inside gloo's transport; that error is a consequence, not a cause.
_PEER_LOST = ("gloo/transport", "Connection closed by peer", "Connection reset by peer", "Broken pipe")


def _root_cause(results, procs, errors: dict[int, str], ctx, grace_s: float = 1.0) -> RankFailed:
    """Collect what every rank says for a moment, then blame the rank most likely to have started it:
    one that died without a word, else one whose error is not a lost peer, else the first to report.
    Every rank's whole traceback goes to the run's log."""
    end = time.monotonic() + grace_s
    while time.monotonic() < end:
        try:
            kind, r, data = results.get(timeout=0.05)
        except queue.Empty:
            continue
        if kind == "err":
            errors.setdefault(r, data)
    for r, tb in sorted(errors.items()):
        append_log(ctx, f"--- rank {r} failed ---\n{tb}")
    silent = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in errors]
    if silent:
        code = procs[silent[0]].exitcode
        how = signal.Signals(-code).name if code < 0 else f"exit code {code}"
        return RankFailed(silent[0], f"process ended with {how} without reporting an error")
    causes = [r for r, tb in errors.items() if not any(m in tb for m in _PEER_LOST)]
    rank = causes[0] if causes else next(iter(errors))
    return RankFailed(rank, errors[rank])
