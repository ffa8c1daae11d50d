"""The import rules issue #32 set: the modules below import in one direction only (no circles), read from the source
with Python's own parser, every import counted wherever it stands (a function's lazy import too)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.conftest import REPO

# (module, what it must never import): the import circles that issue #32 took apart, each kept apart.
NEVER = [
    ("backend/jobs.py", "backend.__main__"),            # the standby process is the CLI's (backend.__main__.standby_main)
    ("pages/form.py", "pages.ui"),                      # the form takes the store's root from its page
    ("backend/experiments/__init__.py", "backend.record"),  # the registry finds and runs; recording is backend.record's
    ("backend/config.py", "backend.limits"),            # the settings know nothing of the run-cost model built on them
    ("backend/models/moe.py", "backend.models.llama"),  # moe builds its experts from backend.models.layers
]


def imported(path: Path, skip_function: str | None = None) -> set[str]:
    """Every module `path` imports, at the top or inside a function (not counting the function named `skip_function`);
    `from a import b` counts as both a and a.b (b may be a module)."""
    tree = ast.parse(path.read_text())
    skipped = {id(n) for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name == skip_function
               for n in ast.walk(f)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return found


@pytest.mark.parametrize("module, forbidden", NEVER)
def test_no_import_runs_back(module, forbidden):
    assert forbidden not in imported(REPO / module), f"{module} imports {forbidden}"


def test_the_reader_sees_a_lazy_import_and_a_from_import(tmp_path):
    """The rule fails when it is broken: a lazy import inside a function, and `from backend import record`."""
    bad = tmp_path / "bad.py"
    bad.write_text("import os\n\ndef f():\n    from backend.__main__ import main\n    from backend import record\n")
    found = imported(bad)
    assert "backend.__main__" in found and "backend.record" in found
    assert "backend.__main__" not in imported(bad, skip_function="f")
