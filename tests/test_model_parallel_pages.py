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
