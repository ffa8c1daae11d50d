"""The model-parallel pages render empty and draw a finished run opened by ?run=ID."""
import pytest
from streamlit.testing.v1 import AppTest

from tests.conftest import REPO

PAGES = {"pages/tensor_parallel.py": ("parallel.tp", {}), "pages/expert_parallel.py": ("parallel.ep", {}),
         "pages/context_parallel.py": ("parallel.cp", {"seq": "64"}),
         "pages/mesh_parallel.py": ("parallel.mesh", {"world_size": "2", "pp": "1", "tp": "1", "cp": "2", "layers": "2", "steps": "2"}),
         "pages/mesh_parallel.py#moe": ("parallel.mesh", {"world_size": "2", "pp": "1", "tp": "1", "ep": "2", "experts": "2",
                                                          "layers": "2", "steps": "2"}),
         "pages/mesh_parallel.py#depth": ("parallel.mesh", {"world_size": "2", "pp": "2", "tp": "1", "layers": "2", "steps": "2",
                                                            "recompute": "selective", "compare_schedules": "true"}),
         "pages/mesh_parallel.py#bf16": ("parallel.mesh", {"world_size": "2", "pp": "1", "tp": "1", "layers": "2", "steps": "2",
                                                           "precision": "bf16_mixed", "dp_strategy": "zero1"})}


def _app(page, **params):
    at = AppTest.from_file(str(REPO / "app.py"), default_timeout=120)
    at.switch_page(page)
    for k, v in params.items():
        at.query_params[k] = v
    return at.run()


@pytest.mark.parametrize("page", PAGES)
def test_page_renders_empty_and_with_a_run(page):
    path = page.split("#")[0]
    at = _app(path)
    assert not at.exception, at.exception
    from backend import experiments, record
    from backend.store import RunStore

    name, settings = PAGES[page]
    exp = experiments.get(name)
    config = exp.make_config(settings)
    store = RunStore()
    rid = store.create(exp.name, config.to_dict(), "pages-mp", status="running")
    report = record.run_recorded(exp, config, experiments.RunContext(timeout_s=300), store, rid)
    assert report["passed"], [c for c in report["checks"] if not c["passed"]]
    at = _app(path, run=rid)
    assert not at.exception, at.exception
    assert any("checks against independent references passed" in s.value for s in at.success)
