"""The run store: one SQLite database (WAL mode) in the data folder, shared by everyone on a server.

A row per run: id, experiment, config, config digest, status, timings, progress, result and trace
paths, error text, code version, rendezvous port. Result and trace bodies live as JSON files in
runs/<id>/ beside the database; rows only point at them. WAL plus short transactions means a
writer killed mid-write loses at most its own uncommitted change.

Status moves queued -> running -> succeeded | failed | cancelled (or queued -> cancelled).

The store is also the one queue of every process that uses it (servers, CLI runs, torchrun):
- the concurrency cap is a lease: a runner claims a queued run only while fewer than `cap` job
  runs are running, counted in the same write transaction (claim_next);
- dedupe is atomic: look-up and insert happen in one transaction, and a unique index on the digest
  of live job runs makes a second live row impossible (submit);
- a running row carries a heartbeat written by its leader every half second (from the moment a runner
  claims it, or a CLI or torchrun leader creates it with its pid); any reader that finds a running
  row whose heartbeat is older than STALE_S, or whose process on this host is gone, marks it failed
  with that reason (_reap), so nothing stays "running" and dedupe never returns a dead run. (A row
  created as running without a pid, by a script that runs an experiment in-process, is not watched.)
- cancel is a flag in the row; the run's leader reads it with each heartbeat (request_cancel, beat).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import socket
import sqlite3
import time
import uuid
from pathlib import Path
from typing import Any, Iterator

RUN_ID = re.compile(r"[0-9a-f]{12}")  # what _insert makes; anything else from a link is not a run id


def is_run_id(text: str) -> bool:
    return bool(RUN_ID.fullmatch(text))

FINAL = ("succeeded", "failed", "cancelled")
ACTIVE = ("queued", "running")
STALE_S = 10.0  # a running row whose heartbeat is older than this has lost its leader
HOST = socket.gethostname()

SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    id TEXT PRIMARY KEY,
    experiment TEXT NOT NULL,
    config TEXT NOT NULL,
    digest TEXT NOT NULL,
    status TEXT NOT NULL,
    created REAL NOT NULL,
    started REAL,
    finished REAL,
    timeout_s REAL,
    progress REAL DEFAULT 0,
    progress_msg TEXT DEFAULT '',
    cancel_requested INTEGER DEFAULT 0,
    pid INTEGER,
    port INTEGER,
    result_path TEXT,
    trace_path TEXT,
    error TEXT,
    code_version TEXT,
    origin TEXT,
    heartbeat REAL,
    host TEXT,
    owner TEXT,
    parent TEXT
);
CREATE INDEX IF NOT EXISTS runs_digest ON runs(digest);
CREATE INDEX IF NOT EXISTS runs_status ON runs(status);
CREATE INDEX IF NOT EXISTS runs_experiment ON runs(experiment, created);
"""
NEW_COLUMNS = {"heartbeat": "REAL", "host": "TEXT", "owner": "TEXT", "parent": "TEXT"}  # added to stores made before them
# At most one live (queued or running) job-queue run per digest: what makes dedupe atomic.
LIVE_INDEX = ("CREATE UNIQUE INDEX IF NOT EXISTS runs_live_digest ON runs(digest)"
              " WHERE status IN ('queued','running') AND origin='jobs'")


class QueueFull(RuntimeError):
    """A person already has as many runs queued as EXPLORER_MAX_QUEUED_PER_PERSON allows."""

    def __init__(self, owner: str, queued: int, cap: int):
        super().__init__(f"{owner or 'you'} already ha{'ve' if not owner else 's'} {queued} run(s) queued, the most one "
                         f"person may (EXPLORER_MAX_QUEUED_PER_PERSON = {cap}): wait for one to start, or cancel one")
        self.owner, self.queued, self.cap = owner, queued, cap


def data_dir() -> Path:
    """EXPLORER_DATA_DIR, else $XDG_CACHE_HOME/llm-systems-explorer, else ~/.cache/llm-systems-explorer."""
    env = os.environ.get("EXPLORER_DATA_DIR")
    if env:
        return Path(env).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "llm-systems-explorer"


PARTIAL = "partial.json"  # a run's results so far, in its folder


@dataclasses.dataclass
class RunRecord:
    id: str
    experiment: str
    config: dict[str, Any]
    digest: str
    status: str
    created: float
    started: float | None
    finished: float | None
    timeout_s: float | None
    progress: float
    progress_msg: str
    cancel_requested: int
    pid: int | None
    port: int | None
    result_path: str | None
    trace_path: str | None
    error: str | None
    code_version: str | None
    origin: str | None
    heartbeat: float | None
    host: str | None
    owner: str | None
    parent: str | None = None  # the failed run this one resumes from its checkpoints (JobRunner.resume)

    @property
    def duration_s(self) -> float | None:
        if self.started is None:
            return None
        return (self.finished or time.time()) - self.started

    def result(self) -> dict[str, Any] | None:
        if self.result_path and Path(self.result_path).exists():
            return json.loads(Path(self.result_path).read_text())
        return None

    def has_trace(self) -> bool:
        return bool(self.trace_path) and Path(self.trace_path).exists()

    def trace_bytes(self) -> bytes | None:
        if self.trace_path and Path(self.trace_path).exists():
            return Path(self.trace_path).read_bytes()
        return None


class RunStore:
    def __init__(self, root: Path | str | None = None):
        self.root = Path(root) if root else data_dir()
        self.root.mkdir(parents=True, exist_ok=True)
        self.path = self.root / "runs.sqlite"
        self._use_write_ahead_log()
        with self._transaction() as db:  # one writer at a time: many processes may open a new store at once
            for statement in SCHEMA.split(";"):
                db.execute(statement)
            have = {row["name"] for row in db.execute("PRAGMA table_info(runs)")}
            for name, kind in NEW_COLUMNS.items():
                if name not in have:
                    db.execute(f"ALTER TABLE runs ADD COLUMN {name} {kind}")
            # Stores from before atomic dedupe may hold twin live rows: keep the newest of each.
            db.execute("UPDATE runs SET status='failed', finished=?, error='duplicate of a newer identical run'"
                       " WHERE origin='jobs' AND status IN ('queued','running') AND EXISTS (SELECT 1 FROM runs AS newer"
                       " WHERE newer.digest=runs.digest AND newer.origin='jobs' AND newer.status IN ('queued','running')"
                       " AND newer.created > runs.created)", (time.time(),))
            db.execute(LIVE_INDEX)

    def _use_write_ahead_log(self, patience_s: float = 30.0) -> None:
        """Readers never wait for the writer. Switching a new database to WAL upgrades a shared lock to an exclusive
        one, for which SQLite does not wait (waiting could deadlock): two processes opening a new store at once (the
        ranks of a torchrun) got "database is locked" at once. So the switch is retried here."""
        deadline = time.monotonic() + patience_s
        while True:
            try:
                with self._connect() as db:
                    if db.execute("PRAGMA journal_mode").fetchone()[0] != "wal":
                        db.execute("PRAGMA journal_mode=WAL")
                return
            except sqlite3.OperationalError as err:
                if "locked" not in str(err) or time.monotonic() > deadline:
                    raise
                time.sleep(0.02)

    @contextlib.contextmanager
    def _connect(self) -> Iterator[sqlite3.Connection]:
        """A short-lived autocommit connection; each statement is its own transaction unless BEGIN."""
        db = sqlite3.connect(self.path, timeout=30, isolation_level=None)
        try:
            db.execute("PRAGMA busy_timeout=30000")
            db.execute("PRAGMA synchronous=NORMAL")
            db.row_factory = sqlite3.Row
            yield db
        finally:
            db.close()

    def run_dir(self, run_id: str) -> Path:
        path = self.root / "runs" / run_id
        path.mkdir(parents=True, exist_ok=True)
        return path

    def write_partial(self, run_id: str, partial: dict) -> None:
        """What a run has computed so far (metrics, tables, a note), replaced as it goes: kept if the run fails,
        is stopped by its time or memory limit or is cancelled, and dropped when it succeeds."""
        path = self.run_dir(run_id) / PARTIAL
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(partial, default=str))
        tmp.replace(path)

    def partial(self, run_id: str) -> dict | None:
        path = self.root / "runs" / run_id / PARTIAL
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            return None

    def drop_partial(self, run_id: str) -> None:
        (self.root / "runs" / run_id / PARTIAL).unlink(missing_ok=True)

    def create(self, experiment: str, config: dict, digest: str, *, status: str = "queued",
               timeout_s: float | None = None, code_version: str = "", origin: str = "", owner: str = "",
               pid: int | None = None) -> str:
        with self._connect() as db:
            return self._insert(db, experiment, config, digest, status, timeout_s, code_version, origin, owner, pid)

    @staticmethod
    def _insert(db, experiment, config, digest, status, timeout_s, code_version, origin, owner, pid, parent=None) -> str:
        run_id = uuid.uuid4().hex[:12]
        now = time.time()
        running = status == "running"
        watched = running and pid is not None  # a leader that will beat; other callers keep their own rows
        db.execute(
            "INSERT INTO runs (id, experiment, config, digest, status, created, started, timeout_s, code_version,"
            " origin, owner, pid, host, heartbeat, parent) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
            (run_id, experiment, json.dumps(config, sort_keys=True), digest, status, now, now if running else None,
             timeout_s, code_version, origin, owner, pid, HOST if watched else None, now if watched else None, parent),
        )
        return run_id

    def submit(self, experiment: str, config: dict, digest: str, *, timeout_s: float, code_version: str,
               owner: str = "", max_queued: int | None = None, parent: str | None = None) -> tuple[str, bool]:
        """Queue a job-queue run unless a live or succeeded run has the same digest: (run id, created?).
        Look-up and insert are one write transaction, so simultaneous identical submissions make one run, and
        an owner with `max_queued` runs already queued gets QueueFull instead of another (one person's burst
        cannot push everyone else's runs back by more than that)."""
        with self._transaction() as db:
            self._reap(db, db.execute("SELECT * FROM runs WHERE digest=? AND status='running'", (digest,)).fetchall())
            row = db.execute(
                "SELECT id FROM runs WHERE digest=? AND status IN ('queued','running','succeeded') ORDER BY created DESC LIMIT 1",
                (digest,),
            ).fetchone()
            if row:
                return row["id"], False
            if max_queued is not None:
                queued = db.execute("SELECT COUNT(*) FROM runs WHERE status='queued' AND origin='jobs' AND owner=?",
                                    (owner,)).fetchone()[0]
                if queued >= max_queued:
                    raise QueueFull(owner, queued, max_queued)
            return self._insert(db, experiment, config, digest, "queued", timeout_s, code_version, "jobs", owner, None,
                                parent), True

    def queued_of(self, owner: str) -> list[str]:
        """The ids of an owner's queued job-queue runs, oldest first."""
        with self._connect() as db:
            return [r["id"] for r in db.execute("SELECT id FROM runs WHERE status='queued' AND origin='jobs' AND owner=?"
                                                " ORDER BY created", (owner,))]

    def update(self, run_id: str, **fields) -> None:
        if not fields:
            return
        cols = ", ".join(f"{k}=?" for k in fields)
        with self._connect() as db:
            db.execute(f"UPDATE runs SET {cols} WHERE id=?", (*fields.values(), run_id))

    def finish(self, run_id: str, status: str, *, error: str | None = None, **fields) -> None:
        """Move a run to a final state, unless it is already final (first writer wins)."""
        assert status in FINAL
        cols = ", ".join(f"{k}=?" for k in fields)
        extra = (", " + cols) if cols else ""
        with self._connect() as db:
            db.execute(
                f"UPDATE runs SET status=?, error=?, finished=?{extra} WHERE id=? AND status NOT IN ('succeeded','failed','cancelled')",
                (status, error, time.time(), *fields.values(), run_id),
            )

    def get(self, run_id: str) -> RunRecord | None:
        with self._connect() as db:
            row = db.execute("SELECT * FROM runs WHERE id=?", (run_id,)).fetchone()
            if row and self._reap(db, [row]):
                row = db.execute("SELECT * FROM runs WHERE id=?", (run_id,)).fetchone()
        return _record(row) if row else None

    def list(self, *, experiment: str | tuple[str, ...] | None = None, statuses: tuple[str, ...] | None = None,
             limit: int = 500) -> list[RunRecord]:
        """Runs newest first; `experiment` one name or several (an experiment's name and its old names)."""
        query, args = "SELECT * FROM runs WHERE 1=1", []
        if experiment:
            names = (experiment,) if isinstance(experiment, str) else tuple(experiment)
            query += f" AND experiment IN ({','.join('?' * len(names))})"
            args.extend(names)
        if statuses:
            query += f" AND status IN ({','.join('?' * len(statuses))})"
            args.extend(statuses)
        query += " ORDER BY created DESC LIMIT ?"
        args.append(limit)
        with self._connect() as db:
            self._reap(db, db.execute("SELECT * FROM runs WHERE status='running'").fetchall())
            return [_record(r) for r in db.execute(query, args).fetchall()]

    def counts(self) -> dict[str, int]:
        """Runs per experiment, counted by the database (the Overview's figures), without loading any record."""
        with self._connect() as db:
            return dict(db.execute("SELECT experiment, COUNT(*) FROM runs GROUP BY experiment").fetchall())

    # --- liveness --------------------------------------------------------------------------------
    def beat(self, run_id: str) -> bool:
        """The leader's heartbeat; returns whether a cancel was requested (the leader then stops the run)."""
        with self._connect() as db:
            db.execute("UPDATE runs SET heartbeat=? WHERE id=? AND status='running'", (time.time(), run_id))
            row = db.execute("SELECT cancel_requested FROM runs WHERE id=?", (run_id,)).fetchone()
        return bool(row and row["cancel_requested"])

    def request_cancel(self, run_id: str, by: str = "") -> str | None:
        """Cancel a queued run at once, or flag a running one for its leader; returns the status it had."""
        message = f"cancelled by {by}" if by else "cancelled"
        with self._transaction() as db:
            row = db.execute("SELECT status FROM runs WHERE id=?", (run_id,)).fetchone()
            if row is None:
                return None
            if row["status"] == "queued":
                db.execute("UPDATE runs SET status='cancelled', error=?, finished=? WHERE id=?",
                           (message + " before it started", time.time(), run_id))
            elif row["status"] == "running":
                db.execute("UPDATE runs SET cancel_requested=1, error=? WHERE id=?", (message, run_id))  # for the leader
            return row["status"]

    @staticmethod
    def _reap(db: sqlite3.Connection, rows) -> int:
        """Mark failed each running row among `rows` whose leader is gone; returns how many. Readers reap in
        passing: if the store stays locked (a leader frozen in the middle of a write holds the lock until the job
        runner ends it), the rows are left for a later reader instead of failing the read."""
        now, reaped = time.time(), 0
        for row in rows:
            if row["status"] != "running":
                continue
            reason = _death(row, now)
            if reason:
                try:
                    reaped += db.execute(
                        "UPDATE runs SET status='failed', error=?, finished=? WHERE id=? AND status='running'",
                        (reason, now, row["id"])).rowcount
                except sqlite3.OperationalError as err:
                    if "locked" not in str(err) or db.in_transaction:  # inside a caller's transaction: its own
                        raise
        return reaped

    def claim_next(self, cap: int) -> RunRecord | None:
        """Take the oldest queued run and mark it running, if fewer than `cap` job-queue runs are running in
        this store (whichever process started them). One write transaction, so the cap holds across processes."""
        with self._transaction() as db:
            running = db.execute("SELECT * FROM runs WHERE status='running' AND origin='jobs'").fetchall()
            if len(running) - self._reap(db, running) >= cap:
                return None
            row = db.execute("SELECT * FROM runs WHERE status='queued' ORDER BY created LIMIT 1").fetchone()
            if row is None:
                return None
            now = time.time()
            db.execute("UPDATE runs SET status='running', started=?, heartbeat=?, host=? WHERE id=?",
                       (now, now, HOST, row["id"]))
            row = db.execute("SELECT * FROM runs WHERE id=?", (row["id"],)).fetchone()
        return _record(row)

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        """One write transaction: taken at BEGIN, so no other process writes between our read and our write."""
        with self._connect() as db:
            db.execute("BEGIN IMMEDIATE")
            try:
                yield db
            except BaseException:
                db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")

    def check_integrity(self) -> str:
        with self._connect() as db:
            return db.execute("PRAGMA integrity_check").fetchone()[0]


def _death(row: sqlite3.Row, now: float) -> str | None:
    """Why a running row's leader is gone, or None while it lives."""
    if row["host"] == HOST and row["pid"] and not pid_alive(row["pid"]):
        return f"the process running this job (pid {row['pid']}) is gone without recording a final state"
    beat = row["heartbeat"]
    if beat is not None and now - beat > STALE_S:
        return (f"no heartbeat from the process running this job for {now - beat:.0f} s (limit {STALE_S:g} s); "
                "it was killed or its machine stopped")
    return None


def pid_alive(pid: int) -> bool:
    """Whether a process exists and is not a zombie (a zombie has ended; its parent has not reaped it yet)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _record(row: sqlite3.Row) -> RunRecord:
    d = dict(row)
    d["config"] = json.loads(d["config"])
    return RunRecord(**d)
