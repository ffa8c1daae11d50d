import os
import signal
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
# Every test session gets its own run store unless one is given, and each pytest-xdist worker its own folder in it
# (tests that count a store's runs must not see the other worker's).
os.environ.setdefault("EXPLORER_DATA_DIR", tempfile.mkdtemp(prefix="explorer-test-"))
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["EXPLORER_DATA_DIR"] = os.path.join(os.environ["EXPLORER_DATA_DIR"], os.environ["PYTEST_XDIST_WORKER"])
os.environ.setdefault("PYTHONWARNINGS", "ignore::FutureWarning")
# Pages open on their defaults' run (started on a first visit); tests that draw pages start the runs they need.
os.environ.setdefault("EXPLORER_OPEN_ON_DEFAULT_RUN", "0")

from backend.limits import group_members as processes_in_group  # noqa: E402,F401  (the tests' name for it)


@pytest.fixture
def store(tmp_path):
    from backend.store import RunStore

    return RunStore(tmp_path / "data")


@pytest.fixture
def runner(store):
    from backend.jobs import JobRunner

    r = JobRunner(store, max_jobs=2, timeout_s=60)
    yield r
    r.close()
