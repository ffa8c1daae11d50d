"""The server's own time per script run, for bench/team_load.py: with EXPLORER_RENDER_LOG=PATH set, each full run of
app.py (and each time a run view notices its run ended) appends one JSON line: who, which page, when it began and
ended on this machine's clock, and the CPU time of the script's thread. The bench lays these beside the browser's
timings, so its JSON says which part of a render is the server's. Unset (the default): nothing is written."""
from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from typing import Callable, Iterator

_LOCK = threading.Lock()  # script threads of different sessions append to the one file


def path() -> str | None:
    return os.environ.get("EXPLORER_RENDER_LOG") or None


def write(event: dict) -> None:
    """Append one event (a JSON line) when the log is on."""
    target = path()
    if target is None:
        return
    with _LOCK, open(target, "a") as log:
        log.write(json.dumps(event) + "\n")


@contextlib.contextmanager
def script_run(describe: Callable[[], dict]) -> Iterator[None]:
    """Time one script run (wall and this thread's CPU), even when it ends by st.stop or st.rerun; `describe` is
    called at its end for who and what (the page and the run it showed)."""
    if path() is None:
        yield
        return
    t0, cpu0 = time.time(), time.thread_time()
    try:
        yield
    finally:
        t1, cpu = time.time(), time.thread_time() - cpu0
        try:
            what = describe()
        except Exception as err:  # a session closing as its script stops: still one line
            what = {"describe_error": f"{type(err).__name__}: {err}"}
        write({"event": "script", "t0": t0, "t1": t1, "cpu_s": cpu, **what})
