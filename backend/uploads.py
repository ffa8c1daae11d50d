"""Request traces a user gives the server, kept in the run store under their content hash.

A trace reaches a run in one of three ways, and never as a path from a link:
- uploaded (the page's file uploader, or the CLI's --trace-file): checked, then stored as
  <data dir>/traces/uploads/<sha256>.csv; the run's `trace` setting is that hash;
- placed by the server's admin in <data dir>/traces/ and named by its file name (no folders);
- "synthetic", generated from the run's seed.
Every read is capped (bytes, rows, arrival times) before anything is parsed, so neither a large file
nor a trace whose last request arrives at step 9,000,000 can make the server grow without bound.
"""
from __future__ import annotations

import hashlib
import re
import tempfile
from pathlib import Path

from backend.serving.workload import Trace, read_csv
from backend.store import data_dir

MAX_BYTES = 1 << 20       # 1 MiB: ~50,000 short rows, more than MAX_ROWS needs
MAX_ROWS = 10_000         # as many requests as the synthetic trace allows
MAX_ARRIVAL = 100_000     # scheduler steps; the simulation runs at least this long
HASH = re.compile(r"[0-9a-f]{64}")
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}\.csv")
ALLOWED = "'synthetic', an uploaded trace's hash (64 hex digits), or the name of a .csv in the data folder's traces/"


def traces_dir(root: Path | None = None) -> Path:
    return Path(root or data_dir()) / "traces"


def check_size(data: bytes, what: str = "the file") -> None:
    """The one upload cap (traces here, model configs in backend/plan/models.py): ValueError past MAX_BYTES."""
    if len(data) > MAX_BYTES:
        raise ValueError(f"{what} has {len(data):,} bytes (allowed: at most {MAX_BYTES:,})")


def store(data: bytes, folder: Path, suffix: str) -> str:
    """Keep checked upload bytes as <folder>/<sha256><suffix> (written once, atomically); returns the hash."""
    digest = hashlib.sha256(data).hexdigest()
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / f"{digest}{suffix}"
    if not target.exists():
        with tempfile.NamedTemporaryFile("wb", dir=folder, delete=False, suffix=".tmp") as f:
            f.write(data)
        Path(f.name).replace(target)
    return digest


def parse_trace(data: bytes) -> Trace:
    """A trace from CSV bytes (UTF-8, with or without a byte-order mark), within the caps."""
    check_size(data)
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise ValueError(f"the file is not UTF-8 text (byte {err.start})") from None
    rows = sum(1 for line in text.splitlines() if line.strip()) - 1  # minus the header
    if rows > MAX_ROWS:
        raise ValueError(f"the file has {rows:,} rows (allowed: at most {MAX_ROWS:,})")
    try:
        trace = read_csv(text)
    except ValueError as err:
        raise ValueError(str(err).removeprefix("trace: ")) from None
    late = int(trace.arrival.max())
    if late > MAX_ARRIVAL:
        raise ValueError(f"a request arrives at step {late:,} (allowed: arrival <= {MAX_ARRIVAL:,})")
    return trace


def save_trace(data: bytes, root: Path | None = None) -> str:
    """Check an uploaded trace and store it under its content hash; returns the hash (the run's `trace`)."""
    parse_trace(data)
    return store(data, traces_dir(root) / "uploads", ".csv")


def read_capped(path: Path) -> bytes:
    """At most MAX_BYTES + 1 bytes of a file: enough to refuse a large one without reading it all."""
    with open(path, "rb") as f:
        return f.read(MAX_BYTES + 1)


def load_trace(name: str, root: Path | None = None) -> Trace:
    """The stored trace named by hash or by file name; ValueError naming what is allowed."""
    if HASH.fullmatch(name):
        path = traces_dir(root) / "uploads" / f"{name}.csv"
        missing = "no uploaded trace has this hash on this server; upload the file again"
    elif NAME.fullmatch(name):
        path = traces_dir(root) / name
        missing = f"no trace of this name in {traces_dir(root)}"
    else:
        raise ValueError(f"{name[:80]!r} is not a trace name (allowed: {ALLOWED})")
    if not path.is_file():
        raise ValueError(missing)
    return parse_trace(read_capped(path))
