"""AppTest: the GPU execution, native sparse attention, memory hierarchy (both views) and FlashAttention pages draw a
real run opened by ?run=ID without an exception."""
import pytest

from tests.sweep import open_page, recorded


@pytest.mark.parametrize("page, name, settings", [
    ("pages/gpu_execution.py", "hardware.gemm", {"m": 40, "n": 33, "k": 20, "block_m": 16, "block_n": 16, "block_k": 16, "sweep_sizes": "32"}),
    ("pages/nsa.py", "attention.nsa", {"seq_len": 128, "sweep_sizes": "128,256"}),
    ("pages/memory_hierarchy.py", "hardware.latency", {"max_mib": 16, "steps": 20000}),
    ("pages/flash_attention.py", "attention.flash", {"seq_len": 40, "heads": 1, "block_m": 16, "block_n": 16}),
])
def test_page_draws_a_run(page, name, settings):
    rid = recorded(name, {k: str(v) for k, v in settings.items()})
    at = open_page(page, default_timeout=90, run=rid)
    assert not at.exception, at.exception
    assert any("checks against independent references passed" in s.value for s in at.success)


@pytest.mark.parametrize("page", ["pages/gpu_execution.py", "pages/nsa.py", "pages/memory_hierarchy.py"])
def test_page_renders_without_a_run(page):
    at = open_page(page, default_timeout=90)
    assert not at.exception, at.exception
