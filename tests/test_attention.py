"""MHA/MQA/GQA/MLA: cache bytes equal the formulas, absorbed MLA equals naive, cached decode equals
recomputation, RoPE's relative-position property, and bad inputs."""
import pytest
import torch

from backend import experiments
from backend.experiments.attention.kv_cache import KVCacheConfig, measure_variant
from backend.attention.rope import apply_rope, relative_position_error, rope_angles
from backend.config import ConfigError
from backend.models.llama import ModelShape, TinyDecoder

SMALL = KVCacheConfig(n_heads=4, n_kv_heads=2, d_head=8, d_c=12, d_rope=4, n_layers=2, context=12)


@pytest.mark.parametrize("variant, elements", [
    ("mha", 2 * 4 * 8), ("gqa", 2 * 2 * 8), ("mqa", 2 * 8), ("mla", 12 + 4),
])
def test_cache_bytes_equal_the_formula(variant, elements):
    m = measure_variant(SMALL, variant)
    assert m["bytes_per_token_per_layer"] == elements * 4  # fp32
    assert m["decode_error"] < 1e-4


def test_mla_absorbed_equals_naive_and_caches_less():
    m = measure_variant(SMALL, "mla")
    assert m["absorbed_vs_naive_error"] < 1e-4
    assert m["naive_bytes_per_token_per_layer"] == 4 * (2 * 8 + 4) * 4


def test_absorbed_differs_when_weights_differ():
    """The agreement check can fail: a naive twin with other weights disagrees."""
    torch.manual_seed(0)
    a = TinyDecoder(ModelShape(variant="mla", mla_mode="absorbed")).eval()
    torch.manual_seed(1)
    b = TinyDecoder(ModelShape(variant="mla", mla_mode="naive")).eval()
    toks = torch.randint(0, 64, (10,))
    with torch.no_grad():
        assert (a(toks) - b(toks)).abs().max() > 1e-2


def test_rope_relative_position_property():
    assert relative_position_error(16) < 1e-10
    # Without the rotation's composition (a position-dependent scale instead), the property fails.
    cos, sin = rope_angles(torch.tensor([3, 7]), 8, dtype=torch.float64)
    q = torch.randn(8, dtype=torch.float64)
    assert not torch.allclose(apply_rope(q[None], cos[:1], sin[:1]), apply_rope(q[None], cos[1:], sin[1:]))


def test_experiment_passes_all_checks_and_reports_deepseek_ratio():
    result = experiments.run("attention.kv_cache", context=16, n_layers=1)
    assert result.passed, [c for c in result.checks if not c.passed]
    assert result.metrics["deepseek_v3_scaled_measured_elements"] == {"mla": 36.0, "mha": 2048.0}
    savings = {r["variant"]: r["saving_vs_mha_pct"] for r in result.tables["cache"]}
    assert savings["mqa"] == pytest.approx(100 * (1 - 2 / 16))


def test_training_stays_above_the_entropy_floor():
    result = experiments.run("attention.variants_train", steps=3, batch=2, seq_len=12)
    assert result.passed
    assert all(result.metrics[f"held_out_loss.{v}"] > result.metrics["entropy_rate_nats"] - 0.5 for v in ("mha", "mla"))


@pytest.mark.parametrize("values, field", [
    ({"n_heads": "6", "n_kv_heads": "4"}, "n_kv_heads"), ({"d_rope": "7"}, "d_rope"), ({"d_c": "0"}, "d_c"),
    ({"d_head": "9"}, "d_head"), ({"variant": "mqa2"}, "variant"), ({"context": "100000"}, "context"),
])
def test_bad_inputs_name_the_field(values, field):
    with pytest.raises(ConfigError) as info:
        KVCacheConfig.from_dict(values)
    assert info.value.field == field and "allowed" in str(info.value)


# --- MLA and RoPE: absorption breaks with RoPE on the compressed keys, holds with decoupled RoPE
def test_mla_rope_absorption_run_checks():
    from backend.experiments.attention.kv_cache import rope_absorption

    checks, rows, metrics = rope_absorption(SMALL)
    assert all(c.passed for c in checks), [c for c in checks if not c.passed]
    assert metrics["mla_rope.compressed_relative_error"] > 0.1 and metrics["mla_rope.decoupled_relative_error"] < 1e-13
    assert {r["path"] for r in rows} == {"compressed", "decoupled"}


def test_mla_decoupled_check_fails_with_rope_back_on_the_compressed_path(monkeypatch):
    from backend.attention import mla_rope
    from backend.experiments.attention.kv_cache import rope_absorption

    plain = mla_rope.compressed_key
    monkeypatch.setattr(mla_rope, "compressed_key", lambda W, c_kv, pos: mla_rope.rotate(plain(W, c_kv, pos), pos))
    checks, _, _ = rope_absorption(SMALL)
    assert not next(c for c in checks if c.name.startswith("mla, decoupled RoPE")).passed


def test_mla_compressed_check_fails_if_the_rotation_commuted(monkeypatch):
    """If rotating the latents were the same as rotating the keys (RoPE a no-op), the 'must depart' check would fail."""
    from backend.attention import mla_rope
    from backend.experiments.attention.kv_cache import rope_absorption

    monkeypatch.setattr(mla_rope, "rotate", lambda x, positions: x)
    checks, _, _ = rope_absorption(SMALL)
    assert not next(c for c in checks if c.name.startswith("mla, RoPE on the compressed keys: absorbed departs")).passed


def test_kv_cache_page_draws_the_rope_section():
    from tests.sweep import render_recorded

    at = render_recorded("pages/kv_cache.py", "attention.kv_cache", variant="mla", context="16", n_layers="1")
    assert any("why RoPE breaks absorption" in s.value for s in at.subheader)


def test_kv_cache_page_draws_the_runs_dataflow_and_still_opens_runs_stored_before_it():
    """The MLA dataflow comes with the run, at the measured model's own shape (its W^DQ width, read off the built
    model); a run stored before the result held the dataflow, the live fit and every GPU's presets still opens."""
    import json
    from pathlib import Path

    from backend.store import RunStore
    from tests.sweep import render_recorded
    from tests.test_pages import _app

    at = render_recorded("pages/kv_cache.py", "attention.kv_cache", variant="mla", context="16", n_layers="1", d_c="8")
    run_id = at.query_params["run"][0] if isinstance(at.query_params["run"], list) else at.query_params["run"]
    config = KVCacheConfig(variant="mla", context=16, n_layers=1, d_c=8)
    d_cq = TinyDecoder(config.shape("mla")).blocks[0].attn.w_dq.out_features
    path = Path(RunStore().get(run_id).result_path)
    result = json.loads(path.read_text())
    absorbed = next(row["dot"] for row in result["tables"]["mla_dataflow"] if row["form"] == "absorbed")
    assert f"[{d_cq}]" in absorbed and d_cq == 16  # the model's rule (at least 16), not d_c
    assert len(at.get("graphviz_chart")) == 1
    del result["schema_version"]  # as runs were stored before result schemas (version 1)
    for key in ("mla_dataflow", "fit"):
        del result["tables"][key]
    result["tables"]["presets"] = [{k: v for k, v in row.items() if k != "gpu"} for row in result["tables"]["presets"]
                                   if row["gpu"] == "A100 / H100 (80 GiB)"]
    path.write_text(json.dumps(result))
    old = _app("pages/kv_cache.py", run=run_id)
    assert not old.exception and any("stored before" in c.value for c in old.caption)


def test_mla_origin_check_fails_if_position_0_is_rotated(monkeypatch):
    from backend.attention import mla_rope
    from backend.experiments.attention.kv_cache import rope_absorption

    rotate = mla_rope.rotate
    monkeypatch.setattr(mla_rope, "rotate", lambda x, positions: rotate(x, positions + 1))  # positions counted from 1
    checks, _, _ = rope_absorption(SMALL)
    assert not next(c for c in checks if c.name.endswith("at m = n = 0 (R_0 = I)")).passed
