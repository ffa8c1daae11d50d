"""The job runner and the job leader: runs queued in the store, each under its limits, none left "running".

    runner = JobRunner(store)
    run_id = runner.submit("comm.bandwidth", {"world_size": "4"}, owner="ana")   # ConfigError on bad input

submit() validates on the server, then (in one store transaction) returns an existing run with the
same digest (experiment, settings, code version) if one is queued, running or succeeded, else queues
a row. Every runner on the store (one per server process; any number of processes) claims queued
runs only while fewer than its cap of job runs are running in the store, so the cap holds across
processes. A claimed run is started as `python -m backend run NAME --run-id ID` in its own process
group with a free rendezvous port, its output appended to the run's log.txt.

A run does not wait for its leader's start-up: the runner keeps one leader warm (`Standby`, whose process is
backend.__main__.standby_main: torch, every
experiment and the ranks' fork server already imported), started only while a job slot is free, and hands it
the next claimed run's command line; a cold `python -m backend run` starts only when none is ready.

That process is the run's leader. `Leader` (used by the CLI and by torchrun's rank 0) writes its
heartbeat every half second, reads the cancel flag with it, holds the job to its time and memory
limits, and records a final state when it is stopped by a signal. So cancel works from any process,
a restarted server adopts the jobs of the last one (they keep running, heartbeating and obeying the
flag), and a leader that dies without a word is marked failed by the next reader of the store.
"""
from __future__ import annotations

import dataclasses
import faulthandler
import hashlib
import heapq
import json
import math
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Mapping

from backend import experiments, limits
from backend.config import Config, ConfigError
from backend.comm.spawn import free_port
from backend.store import FINAL, QueueFull, RunRecord, RunStore  # noqa: F401  (QueueFull: submit's refusal)

DEFAULT_MAX_JOBS = int(os.environ.get("EXPLORER_MAX_JOBS", 1))
# Runs one person may have queued at once (not counting running ones): a burst from one person delays another
# person's run by at most this many runs plus the ones running.
DEFAULT_MAX_QUEUED_PER_PERSON = int(os.environ.get("EXPLORER_MAX_QUEUED_PER_PERSON", 4))
WARM_LEADER = os.environ.get("EXPLORER_WARM_LEADER", "1") != "0"
BEAT_S = 0.5  # heartbeat and cancel poll period: cancel acts within a second
# A distributed run's leader holds its time limit this much later: spawn_ranks enforces the limit itself, first
# collecting each rank's stack, and the leader's clock is then only a backstop.
DIAGNOSIS_GRACE_S = 15.0
# The runner ends a run itself this long past its time limit, counted from its claim. The leader holds the limit
# from its own start, after its imports (seconds on a loaded machine; a cold leader imports torch), plus
# DIAGNOSIS_GRACE_S for a distributed run: the runner must not come first.
BACKSTOP_S = 60.0


class NotAllowed(PermissionError):
    """A user asked for something only the run's owner or an admin may do."""


@dataclasses.dataclass
class QueuePlace:
    """Where a queued run stands: the runs that start before it and when it should start."""
    running: int      # runs holding a job slot now
    ahead: int        # queued runs claimed before it (the queue is first come, first served)
    wait_s: float     # its expected wait: the runs ahead laid on the job slots by their cost estimates


class JobRunner:
    def __init__(self, store: RunStore | None = None, max_jobs: int = DEFAULT_MAX_JOBS,
                 timeout_s: float | None = None, poll_s: float = 0.1, warm: bool = WARM_LEADER,
                 backstop_s: float = BACKSTOP_S, max_queued_per_person: int = DEFAULT_MAX_QUEUED_PER_PERSON):
        self.store = store or RunStore()
        self.max_jobs, self.poll_s, self.warm, self.backstop_s = max_jobs, poll_s, warm, backstop_s
        self.max_queued_per_person = max_queued_per_person
        self._estimates: dict[str, float] = {}  # run id -> its Config's estimated seconds (settings never change)
        self.timeout_s = timeout_s or limits.time_budget()
        self._procs: dict[str, subprocess.Popen] = {}
        self._standby: Standby | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="job-dispatcher", daemon=True)
        self._thread.start()

    # --- public -----------------------------------------------------------------------------
    def submit(self, name: str, settings: Mapping[str, Any] | Config, *, timeout_s: float | None = None,
               owner: str = "") -> str:
        exp = experiments.get(name)
        config = exp.validate(settings) if isinstance(settings, Config) else exp.make_config(settings)
        version = experiments.code_version()
        digest = config.digest(exp.name, version)
        timeout_s = min(timeout_s or self.timeout_s, self.timeout_s)
        return self.store.submit(exp.name, config.to_dict(), digest, timeout_s=timeout_s,
                                 code_version=version, owner=owner, max_queued=self.max_queued_per_person)[0]

    def why_not_resumable(self, run_id: str) -> str | None:
        """None when `run_id` is a failed run with a complete, intact checkpoint; else the reason it cannot resume."""
        from backend.checkpoint.checkpointer import CheckpointError, resumable

        try:
            resumable(self.store, run_id)
        except CheckpointError as err:
            return str(err)
        return None

    def resume(self, parent_id: str, *, owner: str = "") -> str:
        """Queue a run that continues a failed run from its newest checkpoint: the parent's settings, its record's
        id stored as this run's parent (the ranks find the checkpoint folder from it, never from a path), submitted
        as any run is (validated, within the budget, in the person's queue). Two resumes of one parent are one run."""
        from backend.checkpoint.checkpointer import CheckpointError, resumable

        try:
            parent = resumable(self.store, parent_id)
        except CheckpointError as err:
            raise ConfigError("parent", str(err)) from None
        exp = experiments.get(parent.experiment)
        config = exp.make_config(parent.config)
        version = experiments.code_version()
        digest = hashlib.sha256(f"{config.digest(exp.name, version)} resumes {parent.id}".encode()).hexdigest()[:20]
        return self.store.submit(exp.name, config.to_dict(), digest, timeout_s=self.timeout_s, code_version=version,
                                 owner=owner, max_queued=self.max_queued_per_person, parent=parent.id)[0]

    def cancel(self, run_id: str, by: str = "", admin: bool = True) -> None:
        """Cancel a queued run at once; a running one is stopped by its leader within a second, whichever
        process started it. Only the run's owner or an admin may cancel."""
        rec = self.store.get(run_id)
        if rec and not admin and rec.owner and rec.owner != by:
            raise NotAllowed(f"run {run_id} was launched by {rec.owner}; only they or an admin can cancel it")
        self.store.request_cancel(run_id, by)

    def cancel_queued(self, owner: str) -> list[str]:
        """Cancel every run `owner` has queued (their own: nobody else's); returns the ids cancelled."""
        cancelled = []
        for run_id in self.store.queued_of(owner):
            if self.store.request_cancel(run_id, owner) == "queued":
                cancelled.append(run_id)
        return cancelled

    def place(self, run_id: str) -> QueuePlace | None:
        """A queued run's place: the running runs and the queued ones claimed before it (oldest first), and its
        expected wait, laying each of those on the earliest free of max_jobs slots for its estimated seconds (a
        running one for what its estimate has left). None once the run is no longer queued. Estimates are the
        budget's upper bounds, so the wait is one too."""
        active = self.queue()
        me = next((r for r in active if r.id == run_id), None)
        if me is None or me.status != "queued":
            return None
        now = time.time()
        running = [r for r in active if r.status == "running" and r.origin == "jobs"]  # CLI runs hold no job slot
        if self.max_jobs < 1:  # EXPLORER_MAX_JOBS=0: this server starts nothing (another process on the store may)
            return QueuePlace(running=len(running), ahead=len(ahead_of(me, active)), wait_s=math.inf)
        ahead = ahead_of(me, active)
        slots = sorted(max(0.0, self._estimate(r) - (now - (r.started or now))) for r in running)[:self.max_jobs]
        slots += [0.0] * (self.max_jobs - len(slots))
        heapq.heapify(slots)
        for r in ahead:
            heapq.heappush(slots, heapq.heappop(slots) + self._estimate(r))
        return QueuePlace(running=len(running), ahead=len(ahead), wait_s=slots[0])

    def _estimate(self, rec: RunRecord) -> float:
        if rec.id not in self._estimates:
            config = _config_of(rec)
            self._estimates[rec.id] = config.estimate().seconds if config else float(rec.timeout_s or self.timeout_s)
        return self._estimates[rec.id]

    def wait(self, run_id: str, timeout_s: float = 300) -> RunRecord:
        """Block until the run is final and, if this runner started it, its process group is gone."""
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            rec = self.store.get(run_id)
            if rec and rec.status in FINAL and run_id not in self._procs:  # final, and its processes reaped
                return rec
            time.sleep(self.poll_s)
        raise TimeoutError(f"run {run_id} not finished after {timeout_s} s")

    def queue(self) -> list[RunRecord]:
        return self.store.list(statuses=("queued", "running"))

    def close(self) -> None:
        """Stop dispatching and kill every job this runner started."""
        self._stop.set()
        self._thread.join(timeout=5)
        with self._lock:
            for run_id, proc in list(self._procs.items()):
                self.store.finish(run_id, "cancelled", error="job runner shut down")
                _kill_group(proc)
            self._procs.clear()
            if self._standby:
                _kill_group(self._standby.proc)
                self._standby = None

    # --- dispatcher ---------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._tick()
            except Exception as err:  # keep dispatching; one bad row must not stop the queue
                print(f"job dispatcher: {type(err).__name__}: {err}", file=sys.stderr)
            self._stop.wait(self.poll_s)

    def _tick(self) -> None:
        with self._lock:
            for run_id, proc in list(self._procs.items()):
                self._watch(run_id, proc)
            while len(self._procs) < self.max_jobs and (rec := self.store.claim_next(self.max_jobs)):
                self._procs[rec.id] = self._start(rec)
            # Warm the next leader only while a slot is free in the whole store: its imports (several seconds of
            # CPU) must not slow a running job down.
            if (self.warm and self._standby is None and len(self._procs) < self.max_jobs
                    and len(self.store.list(statuses=("running",))) < self.max_jobs):
                self._standby = Standby(self._env())

    def _env(self, **extra: str) -> dict[str, str]:
        return {**os.environ, "EXPLORER_DATA_DIR": str(self.store.root), "PYTHONUNBUFFERED": "1",
                "PYTHONPATH": os.pathsep.join(filter(None, [str(experiments.REPO_ROOT), os.environ.get("PYTHONPATH")])),
                **extra}

    def _start(self, rec: RunRecord) -> subprocess.Popen:
        port = free_port()
        log_path = self.store.run_dir(rec.id) / "log.txt"  # appended to: ranks write their stacks here too
        env = self._env(EXPLORER_PORT=str(port))
        args = ["run", rec.experiment, "--run-id", rec.id, "--config-json", json.dumps(rec.config),
                "--timeout", str(rec.timeout_s), "--json"]
        standby, self._standby = self._standby, None
        proc = standby.lead(args, env, log_path) if standby else None
        if proc is None:  # none warm (or its code is stale): a leader started cold
            with open(log_path, "ab") as log:
                proc = subprocess.Popen([sys.executable, "-m", "backend", *args], stdout=log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, env=env, cwd=experiments.REPO_ROOT,
                                        start_new_session=True)
        self.store.update(rec.id, pid=proc.pid, port=port)
        proc.record, proc.backstop_at = rec, time.monotonic() + (rec.timeout_s or self.timeout_s) + self.backstop_s
        return proc

    def _watch(self, run_id: str, proc: subprocess.Popen) -> None:
        """Beat for a leader still starting up; reap one that ended; backstop a leader that stopped obeying."""
        code = proc.poll()
        if code is not None:
            _kill_group(proc)  # the leader is gone; take any rank it left behind
            del self._procs[run_id]
            self.store.finish(run_id, "failed", error=f"job exited with code {code}: {log_tail(self.store, run_id)}")
            return
        try:
            cancel = self.store.beat(run_id)
            rec = self.store.get(run_id)
        except sqlite3.OperationalError as err:
            # A leader frozen in the middle of a write holds the store's lock: nothing can be recorded until it
            # is ended, so past its backstop (on this process's clock) it is ended first, then recorded.
            if "locked" not in str(err) or time.monotonic() < proc.backstop_at:
                raise
            _kill_group(proc)
            self.store.finish(run_id, "failed", error=limits.time_message(proc.record.timeout_s, _config_of(proc.record)))
            del self._procs[run_id]
            return
        if rec.status in FINAL:  # the leader recorded its end and is exiting
            return
        overdue = rec.started and time.time() - rec.started > (rec.timeout_s or self.timeout_s) + self.backstop_s
        if overdue or cancel:
            # The leader acts on both itself within a second; still running after that, it is stuck or
            # has not started yet (importing torch can take seconds), and the runner ends it instead.
            asked = getattr(proc, "cancel_seen", None) or time.monotonic()
            proc.cancel_seen = asked
            if overdue or time.monotonic() - asked > 1.0:
                # Record first: once the leader is dead, any reader would record it as simply gone.
                self.store.finish(run_id, "cancelled" if cancel else "failed",
                                  error="cancelled (its process group was killed)"
                                  if cancel else limits.time_message(rec.timeout_s, _config_of(rec)))
                _kill_group(proc)
                del self._procs[run_id]


class Standby:
    """A run's leader started before its run: `python -m backend standby` imports torch and every experiment,
    starts the ranks' fork server with every experiment's preload, and waits on stdin for one line, the command
    line of the run it will lead (then it is that run's leader: the same process group, log and limits as a
    cold one). A run then skips the leader's and the fork server's start-up, about 5 s of CPU. It ends at EOF,
    so a standby never outlives the server that started it; one started before the code changed is not used."""

    def __init__(self, env: dict[str, str]):
        self.version = experiments.code_version()
        command = [sys.executable, "-m", "backend", "standby", *experiments.every_preload()]
        self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     env=env, cwd=experiments.REPO_ROOT, start_new_session=True)

    def lead(self, args: list[str], env: dict[str, str], log_path: Path) -> subprocess.Popen | None:
        """Hand it a run (`python -m backend` arguments); None, and it is ended, if it can no longer take one."""
        if self.proc.poll() is None and experiments.code_version() == self.version:
            try:
                self.proc.stdin.write(json.dumps({"args": args, "env": env, "log": str(log_path)}).encode() + b"\n")
                self.proc.stdin.close()
                return self.proc
            except OSError:  # it died between the check and the write
                pass
        _kill_group(self.proc, wait_s=1.0)
        return None


class Leader:
    """What the process leading a run does beside running it: heartbeat, cancel, limits, last words.

    A thread beats every BEAT_S and, on a cancel flag, a passed deadline or the job's memory over the
    budget, records the final state, kills the job's processes and ends this one. SIGINT and SIGTERM
    do the same, so a CLI run stopped from the terminal or by a supervisor is never left "running".
    `grace_s` delays the deadline when the caller enforces the time limit itself (spawn_ranks, which
    first collects each rank's stack), so the leader's clock is then a backstop.
    """

    def __init__(self, store: RunStore, run_id: str, timeout_s: float, memory_bytes: int, log_path: Path,
                 grace_s: float = 0.0, config: Config | None = None):
        self.store, self.run_id, self.memory_bytes, self.log_path = store, run_id, memory_bytes, log_path
        self.timeout_s, self.config = timeout_s, config
        self.deadline = time.monotonic() + timeout_s + grace_s
        self._done = threading.Event()

    def start(self) -> "Leader":
        limits.limit_this_process(self.memory_bytes)
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)
        threading.Thread(target=self._loop, name="job-leader", daemon=True).start()
        return self

    def stop(self) -> None:
        self._done.set()

    def _on_signal(self, signum, frame) -> None:
        self.end("cancelled", f"stopped by {signal.Signals(signum).name} before it finished", 128 + signum)

    def _loop(self) -> None:
        while not self._done.wait(BEAT_S):
            if self.store.beat(self.run_id):
                rec = self.store.get(self.run_id)
                self.end("cancelled", rec.error if rec and rec.error else "cancelled", 1)
            if time.monotonic() > self.deadline:
                with open(self.log_path, "a") as log:
                    print(f"--- time limit: stack of the leader (pid {os.getpid()}) ---", file=log, flush=True)
                    faulthandler.dump_traceback(file=log, all_threads=True)
                self.end("failed", limits.time_message(self.timeout_s, self.config), 1)
            used = limits.tree_memory(os.getpid())
            if used > self.memory_bytes:
                self.end("failed", limits.memory_message(used, self.memory_bytes, self.config), 1)

    def end(self, status: str, message: str, code: int) -> None:
        """Record the final state (unless one is recorded), kill the job's processes, exit now."""
        self._done.set()
        self.store.finish(self.run_id, status, error=message)
        limits.kill_tree(os.getpid())
        print(f"run {self.run_id} {status}: {message}", file=sys.stderr, flush=True)
        os._exit(code)


def ahead_of(me: RunRecord, active: list[RunRecord]) -> list[RunRecord]:
    """The queued runs claimed before `me` (claim_next takes the oldest first), oldest first."""
    return sorted((r for r in active if r.status == "queued" and (r.created, r.id) < (me.created, me.id)),
                  key=lambda r: r.created)


def _config_of(rec: RunRecord) -> Config | None:
    """A stored run's Config (for messages that name its settings); None if it no longer validates."""
    try:
        return experiments.get(rec.experiment).make_config(rec.config)
    except ConfigError:  # an experiment renamed or a setting removed since: the message goes without names
        return None


def _kill_group(proc: subprocess.Popen, wait_s: float = 10.0) -> None:
    """SIGKILL the job's process group (leader, rank fork server, ranks) and wait until every member is gone."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    end = time.monotonic() + wait_s
    try:
        proc.wait(timeout=wait_s)
    except subprocess.TimeoutExpired:
        pass
    while limits.group_members(proc.pid) and time.monotonic() < end:
        time.sleep(0.02)


def log_tail(store: RunStore, run_id: str, lines: int = 15) -> str:
    path = Path(store.run_dir(run_id)) / "log.txt"
    if not path.exists():
        return ""
    text = path.read_text(errors="replace").strip().splitlines()
    text = [ln for ln in text if "FutureWarning" not in ln and "return func(" not in ln]
    return "\n".join(text[-lines:])
