"""No import circles among the project's own modules (issue #32): every import, at the top of a file or inside a
function, read from the source with ast and resolved to the repo's files; a strongly connected group of two or more
files is a circle. networkx finds the groups; the test of the test builds a circle and sees it found."""
from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("backend", "kernels", "pages")


def _module_file(name: str) -> Path | None:
    """The repo file a dotted module name is: a module, or a package's __init__.py."""
    base = ROOT.joinpath(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _imported(path: Path, tree: ast.AST) -> set[Path]:
    """The repo files `path` imports: `import a.b`, `from a.b import c` (c a module or a name of a.b), relative ones."""
    out: set[Path] = set()
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            names = [f"{base}.{a.name}" if _module_file(f"{base}.{a.name}") else base for a in node.names]
        else:
            continue
        for name in names:
            if name.split(".")[0] in PACKAGES and (target := _module_file(name)) and target != path:
                out.add(target)
    return out


def import_graph(files: dict[Path, str]) -> nx.DiGraph:
    graph = nx.DiGraph()
    for path, source in files.items():
        graph.add_node(path)
        for target in _imported(path, ast.parse(source)):
            graph.add_edge(path, target)
    return graph


def circles(graph: nx.DiGraph) -> list[list[str]]:
    return [sorted(str(p.relative_to(ROOT)) for p in group)
            for group in nx.strongly_connected_components(graph) if len(group) > 1]


def _project_files() -> dict[Path, str]:
    return {p: p.read_text() for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}


def test_the_project_has_no_import_circles():
    assert circles(import_graph(_project_files())) == []


def test_a_circle_is_found_when_one_file_imports_back():
    """The rule broken: mesh_dp imports mesh_train back (mesh_train imports mesh_dp); the test sees the circle."""
    files = _project_files()
    mesh_dp = ROOT / "backend/parallel/mesh_dp.py"
    files[mesh_dp] += "\n\ndef _back():\n    from backend.parallel.mesh_train import train_rank\n"
    assert ["backend/parallel/mesh_dp.py", "backend/parallel/mesh_train.py"] in circles(import_graph(files))
