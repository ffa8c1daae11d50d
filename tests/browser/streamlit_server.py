"""Start `streamlit run app.py` for a browser test and stop it (its whole process group) afterwards."""
import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from backend.comm.spawn import free_port, signal_on_parent_death
from tests.conftest import REPO, processes_in_group


def start(data_dir, *args: str, env: dict | None = None, host: str = "127.0.0.1") -> tuple[subprocess.Popen, str]:
    """`streamlit run app.py` on a free port of `host` (a loopback address; see --server.address in `args`), its
    own process group, ended with the process that started it; returns it and its URL once it answers."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "streamlit", "run", "app.py", "--server.headless", "true", "--server.port", str(port),
         "--browser.gatherUsageStats", "false", *args],
        cwd=REPO, env={**os.environ, "EXPLORER_DATA_DIR": str(data_dir), **(env or {})}, start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        # a pytest killed by a signal runs no fixture teardown: the server must not outlive it
        preexec_fn=lambda: signal_on_parent_death(signal.SIGTERM),
    )
    url = f"http://{host}:{port}"
    deadline = time.time() + 60
    while time.time() < deadline:
        try:
            if urllib.request.urlopen(f"{url}/_stcore/health", timeout=2).read() == b"ok":
                return proc, url
        except OSError:
            time.sleep(0.3)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    raise RuntimeError("streamlit did not start within 60 s")


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM its process group (SIGKILL after 15 s) and check nothing of it is left."""
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert processes_in_group(proc.pid) == []


@contextlib.contextmanager
def streamlit_app(data_dir, *args: str, env: dict | None = None):
    """The app's URL on loopback while it runs, with extra `streamlit run` arguments and environment."""
    try:
        proc, url = start(data_dir, *args, env=env)
    except RuntimeError as err:
        pytest.fail(str(err))
    try:
        yield url
    finally:
        stop(proc)
