"""The server's budget per run, and how a running job is held to it.

Two numbers bound every run, whoever starts it (page, CLI, torchrun):
- memory: EXPLORER_RUN_MEMORY_GIB (default 4), for all the job's processes together;
- time:   EXPLORER_JOB_TIMEOUT_S (default 120 s), wall clock from start to result.
Each Config's estimate() predicts both from its settings with `cost()` below (CPU seconds measured on a
2-core CPU, times a stated load factor; bench/limits.py measures every experiment at its largest accepted settings
and at its defaults, and tests/test_limits.py holds each estimate within 1x-3x of those measurements), and `check_budget()` refuses a run predicted to pass them, naming
the setting that drives the cost (the Config's `cost_drivers`, most influential first) and the largest
value of it that fits. The limits further below stop a run that passes them anyway.

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

import contextvars
import dataclasses
import math
import os
import resource
import signal
from pathlib import Path

from backend.config import Config, ConfigError

GIB = 1 << 30
MiB = 1 << 20
# The cost model. Every time constant is CPU seconds of the run's process tree (leader and ranks), measured on this
# 2-core box; CPU seconds do not depend on the load, wall seconds do. Load assumption: a run's wall time is taken as
# LOAD_FACTOR times its CPU time, i.e. it shares the 2 cores with about one other busy process (more load stretches
# it further). bench/limits.py measures each estimate against the run's CPU seconds and peak memory.
LOAD_FACTOR = 1.5
PROCESS_BYTES = 300 * MiB   # anonymous memory of a process with torch and the experiments imported: 150-250 MiB measured
LEADER_S = 0.5              # the leader's own work around its run (store rows, artifacts, exit): 0.4-0.5 s measured
FORK_SERVER_S = 1.0         # the ranks' fork server importing torch and the backend once per run
RANK_START_S = 0.3          # one rank forked from it, joining the gloo group (comm.selftest: 1.3 s at 2 ranks, 3.4 s at 8)
FLOPS = 5e9                 # dense floating-point operations per CPU second (float64 and small matrices: 3-10e9 measured;
                            # 1024-wide float32 products reach 6e10)
BYTES_PER_S = 2e9           # bytes per CPU second a tensor copy or elementwise op moves (1.6e9 for a plain copy measured)
OP_S = 25e-6                # one Python-level step: a few small torch ops (~3 us of CPU each measured) and the interpreter
WAIT_CPU = 0.25             # CPU seconds per second a run waits on purpose (ranks polling in gloo): 0.19-0.24 measured
SLEEP_CPU = 0.05            # the same for a sleep on a rank's comm thread while the rest waits on its futures: 0.02 measured
MESSAGE_S = 0.45e-3         # one send or receive of a ring step, 8 ranks on the 2 cores (each a wake-up): 0.39 ms measured
DYNAMO_IMPORT_S = 1.5       # a process's first torch.optim step imports torch._dynamo: 1.1-1.5 s of CPU measured
_SEARCHING = contextvars.ContextVar("searching_for_a_fit", default=False)  # a fit search must not search again


def memory_budget() -> int:
    """Bytes one run may use, all its processes together."""
    return int(float(os.environ.get("EXPLORER_RUN_MEMORY_GIB", 4)) * GIB)


def time_budget() -> float:
    """Seconds one run may take."""
    return float(os.environ.get("EXPLORER_JOB_TIMEOUT_S", 120))


def check_timeout(value: float | None) -> float:
    """A run's time limit from --timeout: the server's budget by default, never more."""
    budget = time_budget()
    if value is None:
        return budget
    if not 1 <= value <= budget:
        raise ConfigError("timeout", f"{value:g} is out of range (allowed: 1..{budget:g} seconds, "
                                     "the server's EXPLORER_JOB_TIMEOUT_S)")
    return value


# --- the cost model and the budget search ---------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Estimate:
    memory_bytes: int
    seconds: float       # wall seconds under the load assumption (LOAD_FACTOR), waits included
    wait_s: float = 0.0  # of which the run waits on purpose, using no CPU


def cost(*, data_bytes: float = 0, flops: float = 0, moved_bytes: float = 0, ops: float = 0, ranks: int = 0,
         seconds: float = 0) -> Estimate:
    """A run's estimate from its work: the bytes it holds at its peak (beyond its processes' own), the
    floating-point operations it computes, the bytes it copies or sends, the Python-level steps it takes,
    the ranks it spawns besides its leader (and their fork server), any fixed CPU seconds (a compiler, a probe),
    all CPU seconds of the process tree, taken LOAD_FACTOR times as wall time."""
    start = (FORK_SERVER_S + RANK_START_S * ranks) if ranks else 0.0
    processes = 1 + ranks + (1 if ranks else 0)  # the leader, its ranks and the fork server they come from
    cpu = LEADER_S + start + flops / FLOPS + moved_bytes / BYTES_PER_S + ops * OP_S + seconds
    return Estimate(int(processes * PROCESS_BYTES + data_bytes), LOAD_FACTOR * cpu)


def plus_cpu(estimate: Estimate, cpu_s: float) -> Estimate:
    """`estimate` plus `cpu_s` more CPU seconds of work (taken LOAD_FACTOR times as wall time, as cost() does)."""
    return Estimate(estimate.memory_bytes, estimate.seconds + LOAD_FACTOR * cpu_s, estimate.wait_s)


def with_wait(estimate: Estimate, wait_s: float, cpu_per_s: float = WAIT_CPU) -> Estimate:
    """`estimate` plus `wait_s` seconds its run waits on purpose (a simulated network delay, a straggler): wall time,
    during which the other ranks burn `cpu_per_s` CPU seconds a second (WAIT_CPU polling in gloo; SLEEP_CPU when
    they wait on futures while one thread sleeps)."""
    return Estimate(estimate.memory_bytes, estimate.seconds + wait_s + LOAD_FACTOR * cpu_per_s * wait_s, estimate.wait_s + wait_s)


def fits(config: Config, **change) -> bool:
    """Whether `config`, with `change` applied, keeps its rules and is predicted within the budget."""
    candidate = dataclasses.replace(config, **change)
    try:
        candidate.check()
    except ConfigError:
        return False
    est = candidate.estimate()
    return est.memory_bytes <= memory_budget() and est.seconds <= time_budget()


def check_budget(config: Config) -> None:
    """Refuse a run predicted to pass the server's memory or time budget, naming the setting to lower."""
    if fits(config):
        return
    est = config.estimate()
    need = (f"needs about {est.memory_bytes / GIB:.1f} GiB and {est.seconds:.0f} s, over the server's "
            f"budget of {memory_budget() / GIB:g} GiB (EXPLORER_RUN_MEMORY_GIB) and "
            f"{time_budget():g} s (EXPLORER_JOB_TIMEOUT_S) per run")
    if not config.cost_drivers:
        raise ConfigError("settings", f"this run {need}")
    raise too_costly(config, config.cost_drivers, f"this run {need}")


def too_costly(config: Config, drivers: tuple[str, ...], what: str) -> ConfigError:
    """The refusal of a run that costs too much (the server's budget, or a cost rule in check() such as an
    interpreter's step count): names the first of `drivers` that can be lowered to fit and its largest fitting
    value; if no single one is enough, how far the first may go with the other settings back at their defaults."""
    if _SEARCHING.get():
        return ConfigError(drivers[0], what)
    token = _SEARCHING.set(True)
    try:
        for name in drivers:
            best = _largest_fitting(config, name)
            if best is not None:
                return ConfigError(name, f"{getattr(config, name)!r}: {what} (allowed with the other settings as they "
                                         f"are: {name} = {best})")
        name = drivers[0]
        defaults = {f.name: f.default for f in config.fields() if f.name != name and getattr(config, f.name) != f.default}
        best = _largest_fitting(dataclasses.replace(config, **defaults), name)
        hint = (f"allowed: {name} = {best} with " + ", ".join(f"{k} = {v}" for k, v in defaults.items())
                if best is not None else f"lower {', '.join(drivers)}")
        return ConfigError(name, f"{getattr(config, name)!r}: {what}, and no single setting brings it within ({hint})")
    finally:
        _SEARCHING.reset(token)


def _largest_fitting(config: Config, name: str):
    """The largest value of one setting (others unchanged) that fits the budget, or None. Assumes the cost
    grows with the value; a choice setting gives its first choice that fits."""
    f = config.field_of(name)
    t, m, value = config.field_type(f), f.metadata, getattr(config, name)
    if m.get("choices") or t is bool:
        options = m.get("choices") or (False, True)
        return next((c for c in options if c != value and fits(config, **{name: c})), None)
    if t in (str, tuple):  # a name or a list: no order to search along
        return None
    low = m.get("min") if m.get("min") is not None else (1 if t is int else 0.0)
    while low < value and not fits(config, **{name: low}):  # the smallest values may break a cross-field rule
        low = low * 2 if low > 0 else 1
    if low >= value:
        return None
    high = value  # low fits, high does not
    if t is int:
        while high - low > 1:
            mid = (low + high) // 2
            low, high = (mid, high) if fits(config, **{name: mid}) else (low, mid)
        return low
    for _ in range(40):
        mid = (low + high) / 2
        low, high = (mid, high) if fits(config, **{name: mid}) else (low, mid)
    if low <= 0:
        return low
    step = 10.0 ** (math.floor(math.log10(low)) - 2)
    return math.floor(low / step) * step  # 3 significant digits, rounded down so that it still fits


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
