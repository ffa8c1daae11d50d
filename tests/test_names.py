"""One name per topic: experiments renamed keep their old names as aliases, in the CLI, in links and in stored runs."""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from backend import experiments
from backend.config import ConfigError
from backend.store import RunStore
from pages.catalog import SECTIONS
from tests.conftest import REPO
from tests.sweep import open_page, recorded

OLD, NEW, PAGE = "moe.routing", "models.moe_routing", "pages/moe_routing.py"  # the cheapest renamed experiment
SMALL = {"tokens": "64", "bias_steps": "2"}


# --- the table ------------------------------------------------------------------------------------------------
def test_every_old_name_leads_to_a_registered_experiment_without_a_circle():
    registered = {e.name for e in experiments.all_experiments()}
    assert experiments.ALIASES, "the renames of one name per topic are in the table"
    for old, now in experiments.ALIASES.items():
        assert old not in registered and experiments.canonical(old) in registered, (old, now)
    experiments.check_aliases()


def test_a_broken_alias_table_is_refused(monkeypatch):
    monkeypatch.setattr(experiments, "ALIASES", {"a.old": "b.old", "b.old": "a.old"})
    with pytest.raises(ValueError, match="circle"):
        experiments.canonical("a.old")
    monkeypatch.setattr(experiments, "ALIASES", {"gone.away": "no.such"})
    with pytest.raises(ValueError, match="not an experiment"):
        experiments.check_aliases()
    monkeypatch.setattr(experiments, "ALIASES", {"comm.selftest": "comm.collectives"})
    with pytest.raises(ValueError, match="also a registered experiment"):
        experiments.check_aliases()


def test_one_name_per_topic():
    """No experiment module is named `run`, and each page's experiments share one group (its topic)."""
    names = [e.name for e in experiments.all_experiments()]
    assert not [n for n in names if n.endswith(".run")], names
    libraries = {p.name for p in (REPO / "backend").iterdir() if (p / "__init__.py").exists()}
    groups = {n.split(".")[0] for n in names}
    assert groups <= libraries, f"groups without a library folder of that name: {sorted(groups - libraries)}"
    for topics in SECTIONS.values():
        for topic in topics:
            assert len({n.split(".")[0] for n in topic.experiments}) <= 1, topic


# --- an old name still runs -----------------------------------------------------------------------------------
def test_an_old_name_runs_in_python_and_in_the_cli():
    assert experiments.get(OLD) is experiments.get(NEW)
    out = subprocess.run([sys.executable, "-m", "backend", "run", OLD, "--json", *sum((["--set", f"{k}={v}"] for k, v in SMALL.items()), [])],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["status"] == "succeeded" and report["experiment"] == NEW, out.stderr[-2000:]
    assert RunStore().get(report["run_id"]).experiment == NEW  # recorded under its name now


def test_an_old_name_is_unknown_without_its_alias(monkeypatch):
    monkeypatch.setattr(experiments, "ALIASES", {})
    with pytest.raises(ConfigError, match="unknown experiment"):
        experiments.get(OLD)


# --- an old stored run still opens ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def old_run():
    """A run stored as a server before the rename left it: the old name in its store row and in result.json."""
    rid = recorded(OLD, SMALL, stored_as=OLD)
    path = Path(RunStore().get(rid).result_path)
    path.write_text(json.dumps({**json.loads(path.read_text()), "experiment": OLD}))
    return rid


def test_an_old_stored_run_opens_on_its_page_under_the_new_name(old_run):
    at = open_page(PAGE, run=old_run)
    assert not at.exception, at.exception
    assert not [w.value for w in at.warning if "is a run of" in w.value]
    assert any(old_run in s.value and NEW in s.value for s in at.subheader), [s.value for s in at.subheader]
    assert any("checks against independent references passed" in s.value for s in at.success)
    assert RunStore().get(old_run).experiment == OLD  # read as the new name, never rewritten


def test_an_old_stored_run_is_listed_and_linked_under_the_new_name(old_run):
    from pages import ui

    assert ui.page_of(OLD) == ui.page_of(NEW) == "moe_routing"
    assert experiments.spellings(NEW) == (NEW, OLD)
    assert old_run in [r.id for r in RunStore().list(experiment=experiments.spellings(NEW))]
    at = open_page("pages/runs.py")
    at.selectbox[0].set_value(NEW).run()
    assert not at.exception, at.exception
    assert old_run in list(at.dataframe[0].value["run"])


def test_an_old_stored_run_is_refused_when_the_page_ignores_old_names(old_run, monkeypatch):
    monkeypatch.setattr(experiments, "canonical", lambda name: name)  # the rule broken: stored names taken literally
    at = open_page(PAGE, run=old_run)
    assert any(f"is a run of {OLD}" in w.value.replace("\\", "") for w in at.warning), [w.value for w in at.warning]


def test_old_runs_count_for_the_new_name_on_the_overview(old_run, monkeypatch):
    from pages import ui

    monkeypatch.setattr(ui, "store", lambda: RunStore())
    stored = RunStore().counts()
    counts = ui.run_counts()
    assert OLD not in counts and counts[NEW] == stored.get(NEW, 0) + stored[OLD] >= 1


# --- the registry's modules ------------------------------------------------------------------------------------
def test_a_module_without_an_experiment_is_refused_unless_its_name_marks_a_shared_part(tmp_path, monkeypatch):
    """Every module under backend/experiments/ defines an experiment, except `_name.py` parts a group shares."""
    (tmp_path / "_shared.py").write_text("X = 1\n")
    monkeypatch.setattr(experiments, "__path__", [str(tmp_path)])
    monkeypatch.setattr(experiments, "_REGISTRY", {})
    monkeypatch.setattr(experiments, "ALIASES", {})
    experiments._load_all.cache_clear()
    try:
        experiments._load_all()  # the shared part alone: accepted
        (tmp_path / "stray.py").write_text("X = 1\n")
        experiments._load_all.cache_clear()
        with pytest.raises(ValueError, match="stray defines no EXPERIMENT"):
            experiments._load_all()
    finally:
        for name in ("backend.experiments._shared", "backend.experiments.stray"):
            sys.modules.pop(name, None)
        monkeypatch.undo()
        experiments._load_all.cache_clear()
    assert {"serving.engine", "plan.training"} <= {e.name for e in experiments.all_experiments()}


# --- README's "Where things live" against the tree -------------------------------------------------------------
def _readme_tree(text: str) -> str:
    """The layout block of README's "Where things live" (from app.py to the closing fence)."""
    block = text[text.index("app.py              router"):]
    return block[:block.index("```")]


def stale_layout(text: str) -> list[str]:
    """Library modules the layout block does not name, and .py files it names that are nowhere in the tree."""
    block = _readme_tree(text)
    modules = [p for p in (REPO / "backend").rglob("*.py") if p.name != "__init__.py" and "experiments" not in p.parts]
    unnamed = [str(p.relative_to(REPO)) for p in modules if p.name not in block]
    files = {p.name for d in ("backend", "pages", "kernels", "tests") for p in (REPO / d).rglob("*.py")} | {"app.py"}
    gone = [n for n in set(re.findall(r"(?<![\w*])(\w+\.py)\b", block)) if n not in files and n != "_name.py"]
    return sorted(unnamed) + [f"{n} (named, not in the tree)" for n in sorted(gone)]


def test_the_readmes_layout_names_every_library_module_and_nothing_gone():
    assert stale_layout((REPO / "README.md").read_text()) == []


def test_a_stale_layout_is_found():
    text = (REPO / "README.md").read_text()
    assert stale_layout(text.replace("token_split.py", "token_splitting.py")) == [
        "backend/parallel/token_split.py", "token_splitting.py (named, not in the tree)"]
