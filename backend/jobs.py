"""The job runner: every run a subprocess in its own process group, queued behind a concurrency cap.

    runner = JobRunner(store)
    run_id = runner.submit("comm.bandwidth", {"world_size": "4"})   # ConfigError on bad input

submit() validates on the server, then returns an existing run with the same digest (experiment,
settings, code version) if one is queued, running or succeeded, so a second person asking gets the
stored run. Otherwise it queues a row. A dispatcher thread starts queued runs while fewer than
`max_jobs` run: `python -m backend run NAME --run-id ID` with start_new_session=True (its own
process group, which its ranks inherit), a free rendezvous port, and stdout/stderr to the run's
log. A run that outlives its timeout, or whose cancel was requested (from any process: the flag
lives in the store), has its whole group killed. A child that ends without recording a final
state is marked failed with the tail of its log.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Mapping

from backend import experiments
from backend.config import Config
from backend.comm.spawn import free_port
from backend.store import FINAL, RunRecord, RunStore

DEFAULT_TIMEOUT_S = float(os.environ.get("EXPLORER_JOB_TIMEOUT_S", 120))
DEFAULT_MAX_JOBS = int(os.environ.get("EXPLORER_MAX_JOBS", 1))


class JobRunner:
    def __init__(self, store: RunStore | None = None, max_jobs: int = DEFAULT_MAX_JOBS,
                 timeout_s: float = DEFAULT_TIMEOUT_S, poll_s: float = 0.1):
        self.store = store or RunStore()
        self.max_jobs, self.timeout_s, self.poll_s = max_jobs, timeout_s, poll_s
        self._procs: dict[str, subprocess.Popen] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._reap_orphans()
        self._thread = threading.Thread(target=self._loop, name="job-dispatcher", daemon=True)
        self._thread.start()

    # --- public -----------------------------------------------------------------------------
    def submit(self, name: str, settings: Mapping[str, Any] | Config, *, timeout_s: float | None = None,
               reuse: bool = True) -> str:
        exp = experiments.get(name)
        config = settings.validate() if isinstance(settings, Config) else exp.make_config(settings)
        version = experiments.code_version()
        digest = config.digest(exp.name, version)
        if reuse and (existing := self.store.find_reusable(digest)):
            return existing.id
        return self.store.create(exp.name, config.to_dict(), digest, status="queued",
                                 timeout_s=timeout_s or self.timeout_s, code_version=version, origin="jobs")

    def cancel(self, run_id: str) -> None:
        """Cancel a queued run at once; a running one is killed by the dispatcher that owns it."""
        if self._is_queued(run_id):
            self.store.finish(run_id, "cancelled", error="cancelled before it started")
        self.store.update(run_id, cancel_requested=1)

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
        """Stop dispatching and kill every running job's process group."""
        self._stop.set()
        self._thread.join(timeout=5)
        with self._lock:
            for run_id, proc in list(self._procs.items()):
                _kill_group(proc)
                self.store.finish(run_id, "cancelled", error="job runner shut down")
            self._procs.clear()

    # --- dispatcher ---------------------------------------------------------------------------
    def _is_queued(self, run_id: str) -> bool:
        rec = self.store.get(run_id)
        return bool(rec and rec.status == "queued")

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
            while len(self._procs) < self.max_jobs and (rec := self.store.claim_next()):
                self._procs[rec.id] = self._start(rec)

    def _start(self, rec: RunRecord) -> subprocess.Popen:
        port = free_port()
        log = open(self.store.run_dir(rec.id) / "log.txt", "wb")
        env = {**os.environ, "EXPLORER_PORT": str(port), "EXPLORER_DATA_DIR": str(self.store.root),
               "PYTHONPATH": os.pathsep.join(filter(None, [str(experiments.REPO_ROOT), os.environ.get("PYTHONPATH")])),
               "PYTHONUNBUFFERED": "1"}
        cmd = [sys.executable, "-m", "backend", "run", rec.experiment, "--run-id", rec.id,
               "--config-json", json.dumps(rec.config), "--timeout", str(rec.timeout_s), "--json"]
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env, cwd=experiments.REPO_ROOT, start_new_session=True)
        log.close()
        self.store.update(rec.id, pid=proc.pid, port=port)
        return proc

    def _watch(self, run_id: str, proc: subprocess.Popen) -> None:
        rec = self.store.get(run_id)
        code = proc.poll()
        if code is not None:
            _kill_group(proc)  # the leader is gone; take any rank it left behind
            del self._procs[run_id]
            self.store.finish(run_id, "failed", error=f"job exited with code {code}: {_log_tail(self.store, run_id)}")
            return
        # The inner launcher has the same timeout; this is the backstop for a stuck leader (+grace).
        if rec.started and time.time() - rec.started > (rec.timeout_s or self.timeout_s) + 10:
            _kill_group(proc)
            del self._procs[run_id]
            self.store.finish(run_id, "failed", error=f"timed out after {rec.timeout_s:g} s; process group killed")
        elif rec.cancel_requested:
            _kill_group(proc)
            del self._procs[run_id]
            self.store.finish(run_id, "cancelled", error="cancelled by user")

    def _reap_orphans(self) -> None:
        """Runs left 'running' by a process that died (a server restart, a killed CLI): mark them failed.
        A row with no pid yet is only reaped once it is older than its timeout, as its starter may be alive."""
        for rec in self.store.list(statuses=("running",)):
            if rec.pid is not None and not _alive(rec.pid):
                self.store.finish(rec.id, "failed", error="the process running this job stopped")
            elif rec.pid is None and time.time() - rec.created > (rec.timeout_s or self.timeout_s) + 60:
                self.store.finish(rec.id, "failed", error="the process running this job never started it")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def _log_tail(store: RunStore, run_id: str, lines: int = 15) -> str:
    path = Path(store.run_dir(run_id)) / "log.txt"
    if not path.exists():
        return ""
    text = path.read_text(errors="replace").strip().splitlines()
    text = [ln for ln in text if "FutureWarning" not in ln and "return func(" not in ln]
    return "\n".join(text[-lines:])
