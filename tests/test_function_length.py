"""No function of 80 lines or more outside tests (issue #32, "experiments read as their measurement"): a combine
reads as measure -> check -> describe, a walk as its per-action handlers. Counted with ast, from the `def` line to
the last line of the body (docstring and comments included), for functions, methods and nested functions alike."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIMIT = 80  # lines: a function this long or longer fails
SCANNED = ("backend", "kernels", "pages", "bench", "app.py")


def long_functions(paths, limit: int = LIMIT) -> list[tuple[str, str, int]]:
    """(file, function name, lines) of every function of `limit` lines or more in the given .py files."""
    found = []
    for path in paths:
        for node in ast.walk(ast.parse(Path(path).read_text(), filename=str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines >= limit:
                    found.append((str(path), node.name, lines))
    return found


def scanned_files() -> list[Path]:
    files = []
    for name in SCANNED:
        path = ROOT / name
        files += [path] if path.is_file() else sorted(path.rglob("*.py"))
    return files


def test_no_function_of_80_lines_or_more_outside_tests():
    files = scanned_files()
    assert len(files) > 50 and any(f.parts[-2:] == ("parallel", "pipeline.py") for f in files)  # the scan sees the tree
    found = long_functions(files)
    assert not found, "split these into pieces with one job each: " + "; ".join(
        f"{Path(p).relative_to(ROOT)} {name} ({n} lines)" for p, name, n in found)


def _function(name: str, lines: int, indent: str = "") -> str:
    """Source of a function of exactly `lines` lines (the def line, then lines - 1 statements)."""
    body = "".join(f"{indent}    x{i} = {i}\n" for i in range(lines - 1))
    return f"{indent}def {name}():\n{body}"


def test_a_synthetic_80_line_function_is_caught_and_a_79_line_one_is_not(tmp_path):
    src = (_function("eighty", 80) + "\n\n" + _function("seventy_nine", 79) + "\n\n"
           + "class Walk:\n" + _function("method_of_eighty", 80, "    ") + "\n\n"
           + "def outer():\n" + _function("nested_of_ninety", 90, "    ") + "    return nested_of_ninety\n")
    path = tmp_path / "synthetic.py"
    path.write_text(src)
    assert len(src.splitlines()) == 80 + 2 + 79 + 2 + 1 + 80 + 2 + 1 + 90 + 1  # the lines as written, counted as text
    found = {name: n for _, name, n in long_functions([path])}
    assert found == {"eighty": 80, "method_of_eighty": 80, "nested_of_ninety": 90, "outer": 92}


def test_the_scan_fails_when_a_long_function_is_added_to_the_tree(tmp_path, monkeypatch):
    """The tree test itself fails on a long function in a scanned folder (here a copy of the tree's layout)."""
    (tmp_path / "backend").mkdir()
    (tmp_path / "backend" / "long.py").write_text(_function("report_generator", 85))
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    assert [(Path(p).name, name, n) for p, name, n in long_functions(scanned_files())] == [("long.py", "report_generator", 85)]
