"""The model-parallel pages render empty and draw a finished run opened by ?run=ID."""
import pytest

from tests.sweep import open_page, recorded

PAGES = {"pages/tensor_parallel.py": ("parallel.tp", {}), "pages/expert_parallel.py": ("parallel.ep", {}),
         "pages/context_parallel.py": ("parallel.cp", {"seq": "64"}),
         "pages/mesh_parallel.py": ("parallel.mesh", {"world_size": "2", "pp": "1", "tp": "1", "cp": "2", "layers": "2", "steps": "2"}),
         "pages/mesh_parallel.py#moe": ("parallel.mesh", {"world_size": "2", "pp": "1", "tp": "1", "ep": "2", "experts": "2",
                                                          "layers": "2", "steps": "2"}),
         "pages/mesh_parallel.py#depth": ("parallel.mesh", {"world_size": "2", "pp": "2", "tp": "1", "layers": "2", "steps": "2",
                                                            "recompute": "selective", "compare_schedules": "true"}),
         "pages/mesh_parallel.py#bf16": ("parallel.mesh", {"world_size": "2", "pp": "1", "tp": "1", "layers": "2", "steps": "2",
                                                           "precision": "bf16_mixed", "dp_strategy": "zero1"})}


@pytest.mark.parametrize("page", PAGES)
def test_page_renders_empty_and_with_a_run(page):
    path = page.split("#")[0]
    at = open_page(path, default_timeout=120)
    assert not at.exception, at.exception
    rid = recorded(*PAGES[page], timeout_s=300)
    at = open_page(path, default_timeout=120, run=rid)
    assert not at.exception, at.exception
    assert any("checks against independent references passed" in s.value for s in at.success)


FOLDS = ("Model, data and training", "DDP, offload and loss scaling", "Checkpoints and failures")


def _folds(at) -> dict:
    return {e.label: e.proto.expanded for e in at.expander if e.label in FOLDS}


def _fold_of(at, key: str) -> str | None:
    """The heading of the fold holding the widget `key`, or None for one in the form's first rows."""
    for e in at.expander:
        if e.label in FOLDS and any(w.key == key for kind in (e.number_input, e.selectbox, e.checkbox) for w in kind):
            return e.label
    return None


def test_the_compose_form_shows_the_mesh_first_and_opens_a_fold_holding_a_change():
    """Compose parallelism's 42 settings: the mesh, schedule, dp strategy, recompute and precision first; the model's
    shape, DDP's knobs and checkpoints folded away, closed, until a link or run sets one of them."""
    at = open_page("pages/mesh_parallel.py")
    assert not at.exception, at.exception
    assert _folds(at) == dict.fromkeys(FOLDS, False)
    assert [_fold_of(at, f"parallel.mesh.{k}") for k in ("tp", "schedule", "dp_strategy", "precision", "steps", "bucket_kb", "kill_rank")] \
        == [None, None, None, None, *FOLDS]
    at = open_page("pages/mesh_parallel.py", steps="5", checkpoint_every="1")
    assert not at.error, at.error
    assert _folds(at) == {FOLDS[0]: True, FOLDS[1]: False, FOLDS[2]: True}
    assert at.number_input(key="parallel.mesh.steps").value == 5

