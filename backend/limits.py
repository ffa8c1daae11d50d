"""The server's budget per run, and how a running job is held to it.

Two numbers bound every run, whoever starts it (page, CLI, torchrun):
- memory: EXPLORER_RUN_MEMORY_GIB (default 4), for all the job's processes together;
- time:   EXPLORER_JOB_TIMEOUT_S (default 120 s), wall clock from start to result.
Config.estimate() predicts both from the settings and validate() refuses a run predicted to pass
them; the limits below stop a run that passes them anyway.

Memory is held two ways. Each process gets RLIMIT_DATA = the job's whole budget (a process can never
use more than its job may), so an allocation past it fails at once with MemoryError or torch's
"can't allocate memory". RLIMIT_AS was tried first and rejected: it counts address space that is
reserved, not used (glibc's 64 MiB arena per thread, CUDA's terabyte reservations), so it breaks
runs that use little memory; RLIMIT_DATA counts private writable memory, which is what grows. The
job's leader also sums the resident anonymous memory of the whole process tree twice a second and
stops the job when the sum passes the budget, since 8 ranks under 4 GiB each can still use 32 GiB.
cgroup v2 memory.max would be the stronger tool, but it needs a delegated, writable cgroup, which
servers in containers (this one included: cgroup v1, read-only) rarely have. On a machine with a
CUDA device the rlimit is left off (the driver maps large writable regions of its own) and the
leader's poll alone holds the job.
"""
from __future__ import annotations

import os
import resource
import signal
from pathlib import Path

GIB = 1 << 30


def memory_budget() -> int:
    """Bytes one run may use, all its processes together."""
    return int(float(os.environ.get("EXPLORER_RUN_MEMORY_GIB", 4)) * GIB)


def time_budget() -> float:
    """Seconds one run may take."""
    return float(os.environ.get("EXPLORER_JOB_TIMEOUT_S", 120))


def check_timeout(value: float | None) -> float:
    """A run's time limit from --timeout: the server's budget by default, never more."""
    from backend.config import ConfigError

    budget = time_budget()
    if value is None:
        return budget
    if not 1 <= value <= budget:
        raise ConfigError("timeout", f"{value:g} is out of range (allowed: 1..{budget:g} seconds, "
                                     "the server's EXPLORER_JOB_TIMEOUT_S)")
    return value


def limit_this_process(memory_bytes: int) -> None:
    """Cap this process's private writable memory; inherited by every process it starts."""
    import torch

    if torch.cuda.is_available():
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    cap = memory_bytes if hard == resource.RLIM_INFINITY else min(memory_bytes, hard)
    resource.setrlimit(resource.RLIMIT_DATA, (cap, hard))


def is_out_of_memory(text: str) -> bool:
    """Whether an error (message or traceback) is an allocation refused by the memory limit."""
    return "MemoryError" in text or "can't allocate memory" in text or "Cannot allocate memory" in text


def memory_message(used: int | None = None, limit: int | None = None, config=None) -> str:
    used_text = f"the job used {used / GIB:.2f} GiB, " if used else "an allocation failed: "
    return (f"memory limit: {used_text}over the {(limit or memory_budget()) / GIB:g} GiB a run may use "
            f"(EXPLORER_RUN_MEMORY_GIB); {_lower(config)}, or ask the server's admin to raise the limit")


def time_message(timeout_s: float, config=None, hang: str = "") -> str:
    """Why a run hit its time limit and what helps. `hang`: which ranks wait in a collective that others never
    reach; a hang never ends, so neither smaller settings nor a higher limit help: the collectives must match."""
    head = f"time limit: not finished within {timeout_s:g} s (--timeout, at most EXPLORER_JOB_TIMEOUT_S)"
    if hang:
        cause = ("this run's fault = 'hang' does it on purpose: choose fault = none"
                 if getattr(config, "fault", None) == "hang" else
                 "make every rank call the same collectives in the same order (one called on some ranks only, or a "
                 "mismatched send/recv, waits forever)")
        return f"{head}: a hang: {hang}; smaller settings or a higher limit do not end a hang: {cause}"
    return f"{head}; {_lower(config)}, or ask the server's admin to raise the limit"


def _lower(config) -> str:
    """Which settings to lower (the run's Config names them), else a general word."""
    return config.lower_hint() if config is not None else "choose smaller settings"


# --- the process tree of a job --------------------------------------------------------------------
def _stat(pid: int) -> tuple[str, int, int] | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return fields[0], int(fields[1]), int(fields[2])  # state, parent pid, process group


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a live process so far (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of process group `pgid`."""
    return [int(e.name) for e in Path("/proc").iterdir()
            if e.name.isdigit() and (st := _stat(int(e.name))) and st[0] != "Z" and st[2] == pgid]


def descendants(root: int) -> list[int]:
    """Live processes below `root` (children, their children, ...)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (st := _stat(int(entry.name))) and st[0] != "Z":
            children.setdefault(st[1], []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def tree_memory(root: int) -> int:
    """Resident anonymous bytes of `root` and every process below it (file-backed pages, such as the
    shared libraries every rank maps, are not counted: they are shared and reclaimable)."""
    total = 0
    for pid in [root, *descendants(root)]:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith(("RssAnon:", "RssShmem:")):
                    total += int(line.split()[1]) * 1024
        except OSError:
            continue
    return total


def kill_tree(root: int) -> None:
    """SIGKILL every process below `root` (not root itself)."""
    for pid in descendants(root):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
