"""Pages only draw: a page imports the frame (pages/ui.py and its siblings) and other pages' views, never a library
module or an experiment module of backend/ or kernels/; what it shows comes from the run's result."""
import ast
import shutil
import sys

import pytest

from tests.conftest import REPO

# The frame: what every page builds on; these alone may import the registry, the store, the runner and the config.
FRAME = {"__init__", "ui", "run_view", "live_view", "server", "form", "timeline", "units", "markup", "catalog", "tables", "sign_in", "navigation_guard"}
# Pages that still import library or experiment modules, each with what it imports today. The list only shrinks: a page
# that no longer does must leave it (test_pending_pages_are_still_pending says so).
PENDING: dict[str, set[str]] = {}


def backend_imports(source: str) -> set[str]:
    """Modules of backend/ or kernels/ a source imports, anywhere in it (a function's own import included)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return {m for m in found if m.split(".")[0] in ("backend", "kernels") and not m.endswith(".schema")}  # result schemas: named keys


def _pages() -> dict[str, set[str]]:
    return {p.stem: backend_imports(p.read_text()) for p in sorted((REPO / "pages").glob("*.py")) if p.stem not in FRAME}


def test_pages_import_only_the_frame():
    offenders = {page: sorted(mods) for page, mods in _pages().items() if mods and page not in PENDING}
    assert not offenders, f"pages importing backend/kernels modules (draw from the run's result instead): {offenders}"


def test_pending_pages_are_still_pending():
    pages = _pages()
    for page, allowed in PENDING.items():
        assert pages.get(page), f"pages/{page}.py imports no backend module any more: take it off PENDING"
        assert pages[page] <= allowed, f"pages/{page}.py imports more than it did: {sorted(pages[page] - allowed)}"


def test_an_injected_library_import_fails_the_rule(monkeypatch, tmp_path):
    """The rule on today's pages, with one page given a library import it draws through: the rule names both."""
    shutil.copytree(REPO / "pages", tmp_path / "pages")
    page = tmp_path / "pages" / "kv_cache.py"
    page.write_text("from backend.hardware.roofline import attainable\n" + page.read_text())
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    with pytest.raises(AssertionError, match=r"'kv_cache': \['backend.hardware.roofline'\]"):
        test_pages_import_only_the_frame()


@pytest.mark.parametrize("source, found", [
    ("from backend.hardware.devices import DEVICES", {"backend.hardware.devices"}),
    ("def f():\n    from backend import experiments\n", {"backend"}),
    ("import kernels.matmul as mm", {"kernels.matmul"}),
    ("from pages import ui, units\nimport pandas as pd", set()),
    ("from backend.serving.schema import BIGGER_RUN", set()),
])
def test_the_import_rule_sees_every_form_of_import(source, found):
    """The checker fails a page that computes through a library: every spelling of an import is seen."""
    assert backend_imports(source) == found
