"""The run store: one SQLite database (WAL mode) in the data folder, shared by everyone on a server.

A row per run: id, experiment, config, config digest, status, timings, progress, result and trace
paths, error text, code version, rendezvous port. Result and trace bodies live as JSON files in
runs/<id>/ beside the database; rows only point at them. WAL plus short transactions means a
writer killed mid-write loses at most its own uncommitted change.

Status moves queued -> running -> succeeded | failed | cancelled (or queued -> cancelled).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sqlite3
import time
import uuid
from pathlib import Path
from typing import Any, Iterator

FINAL = ("succeeded", "failed", "cancelled")
ACTIVE = ("queued", "running")

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
    origin TEXT
);
CREATE INDEX IF NOT EXISTS runs_digest ON runs(digest);
CREATE INDEX IF NOT EXISTS runs_status ON runs(status);
CREATE INDEX IF NOT EXISTS runs_experiment ON runs(experiment, created);
"""


def data_dir() -> Path:
    """EXPLORER_DATA_DIR, else $XDG_CACHE_HOME/llm-systems-explorer, else ~/.cache/llm-systems-explorer."""
    env = os.environ.get("EXPLORER_DATA_DIR")
    if env:
        return Path(env).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "llm-systems-explorer"


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

    @property
    def duration_s(self) -> float | None:
        if self.started is None:
            return None
        return (self.finished or time.time()) - self.started

    def result(self) -> dict[str, Any] | None:
        if self.result_path and Path(self.result_path).exists():
            return json.loads(Path(self.result_path).read_text())
        return None

    def trace_bytes(self) -> bytes | None:
        if self.trace_path and Path(self.trace_path).exists():
            return Path(self.trace_path).read_bytes()
        return None


class RunStore:
    def __init__(self, root: Path | str | None = None):
        self.root = Path(root) if root else data_dir()
        self.root.mkdir(parents=True, exist_ok=True)
        self.path = self.root / "runs.sqlite"
        with self._connect() as db:
            db.execute("PRAGMA journal_mode=WAL")
            db.executescript(SCHEMA)

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

    def create(self, experiment: str, config: dict, digest: str, *, status: str = "queued",
               timeout_s: float | None = None, code_version: str = "", origin: str = "") -> str:
        run_id = uuid.uuid4().hex[:12]
        now = time.time()
        with self._connect() as db:
            db.execute(
                "INSERT INTO runs (id, experiment, config, digest, status, created, started, timeout_s, code_version, origin)"
                " VALUES (?,?,?,?,?,?,?,?,?,?)",
                (run_id, experiment, json.dumps(config, sort_keys=True), digest, status, now,
                 now if status == "running" else None, timeout_s, code_version, origin),
            )
        return run_id

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
        return _record(row) if row else None

    def find_reusable(self, digest: str) -> RunRecord | None:
        """A run with the same digest that is queued, running or succeeded (newest first)."""
        with self._connect() as db:
            row = db.execute(
                "SELECT * FROM runs WHERE digest=? AND status IN ('queued','running','succeeded') ORDER BY created DESC LIMIT 1",
                (digest,),
            ).fetchone()
        return _record(row) if row else None

    def list(self, *, experiment: str | None = None, statuses: tuple[str, ...] | None = None, limit: int = 500) -> list[RunRecord]:
        query, args = "SELECT * FROM runs WHERE 1=1", []
        if experiment:
            query += " AND experiment=?"
            args.append(experiment)
        if statuses:
            query += f" AND status IN ({','.join('?' * len(statuses))})"
            args.extend(statuses)
        query += " ORDER BY created DESC LIMIT ?"
        args.append(limit)
        with self._connect() as db:
            return [_record(r) for r in db.execute(query, args).fetchall()]

    def claim_next(self) -> RunRecord | None:
        """Atomically take the oldest queued run and mark it running (safe across processes)."""
        with self._connect() as db:
            db.execute("BEGIN IMMEDIATE")
            try:
                row = db.execute("SELECT * FROM runs WHERE status='queued' ORDER BY created LIMIT 1").fetchone()
                if row is None:
                    db.execute("COMMIT")
                    return None
                db.execute("UPDATE runs SET status='running', started=? WHERE id=?", (time.time(), row["id"]))
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
        return self.get(row["id"])

    def check_integrity(self) -> str:
        with self._connect() as db:
            return db.execute("PRAGMA integrity_check").fetchone()[0]


def _record(row: sqlite3.Row) -> RunRecord:
    d = dict(row)
    d["config"] = json.loads(d["config"])
    return RunRecord(**d)
