"""AppTest: the hardware.decode view (GPU memory hierarchy page), the numerics.int8 view (number formats page) and the
short views the serving, KV-cache and speculative pages draw from the latest runs, with and without a run."""
import sys

import pytest
from streamlit.testing.v1 import AppTest

from tests.sweep import open_page, recorded

DECODE = {"d_model": 256, "n_layers": 1, "context": 8, "batch_sizes": "1,4"}
INT8 = {"steps": 20, "new_tokens": 8, "gemm_k": 256}


def _short_views():
    """A script drawing every short view from the store's latest runs."""
    from pages import decode_view, int8_view

    for focus in ("batching", "kv", "verify"):
        decode_view.short(focus)
    int8_view.kv_short()


def _draw_short_views() -> AppTest:
    """AppTest.from_function leaves its generated script as this process's __main__; multiprocessing's later ranks
    would re-run that file (it only works inside AppTest) and die at start-up, so the real __main__ is put back."""
    main = sys.modules["__main__"]
    try:
        return AppTest.from_function(_short_views, default_timeout=60).run()
    finally:
        sys.modules["__main__"] = main


def test_short_views_without_runs_link_to_their_pages():
    at = _draw_short_views()
    assert not at.exception, at.exception
    text = " ".join(c.value for c in at.caption)
    if "No run of hardware.decode" in text:  # the store may already hold runs from other tests of this worker
        assert "memory_hierarchy" in text


@pytest.mark.parametrize("page, name, settings", [
    ("pages/memory_hierarchy.py", "hardware.decode", DECODE),
    ("pages/number_formats.py", "numerics.int8", INT8),
])
def test_page_draws_a_run(page, name, settings):
    rid = recorded(name, settings)
    at = open_page(page, default_timeout=90, run=rid)
    assert not at.exception, at.exception
    assert any("checks against independent references passed" in s.value for s in at.success)
    assert len(at.get("vega_lite_chart")) >= 2


def test_short_views_draw_the_latest_runs():
    recorded("hardware.decode", DECODE)
    recorded("numerics.int8", INT8)
    at = _draw_short_views()
    assert not at.exception, at.exception
    assert len(at.get("vega_lite_chart")) == 4  # three decode views and the INT8 cache
    assert any("checks γ draft tokens" in c.value for c in at.caption)
