"""hardware.decode: the decode step's byte and FLOP counts against independent counts (FlopCounterMode, the tensors'
own sizes, published parameter totals), the batched step against the model's own forward, and each check failing
when its rule is broken."""
import pytest

from backend import experiments
from backend.config import ConfigError
from backend.experiments.hardware import decode as exp_decode
from backend.hardware import decode
from tests.sweep import assert_refused

SMALL = {"d_model": 256, "n_layers": 1, "context": 8, "batch_sizes": "1,4"}


def _failed(result, words: str) -> bool:
    hits = [c for c in result.checks if words in c.name]
    assert hits, words
    return any(not c.passed for c in hits)


def test_small_run_passes_and_tables_are_complete():
    result = experiments.run("hardware.decode", **SMALL)
    assert result.passed, [c for c in result.checks if not c.passed]
    steps = result.tables["cpu_steps"]
    assert [r["batch"] for r in steps] == [1, 4]
    assert all(r["measured_s"] > 0 and r["predicted_s"] > 0 for r in steps)
    # a decode step reads the weights once: 4 sequences move far fewer than 4x the bytes of one
    assert steps[1]["bytes"] < 1.5 * steps[0]["bytes"] and steps[1]["flops"] > 3.9 * steps[0]["flops"]
    place = result.tables["gpu_placement"]
    at1 = [r for r in place if r["phase"] == "decode" and r["batch"] == 1]
    assert len(at1) == 4 and all(r["bound"] == "memory" for r in at1)  # every model's batch-1 decode is memory-bound
    assert [r["tokens_scored"] for r in result.tables["verify_cost"]] == [1, 2, 4, 8]
    assert all(r["bound"] == "compute" for r in place if r["phase"].startswith("prefill"))
    for model in {r["model"] for r in place}:  # the cache's share of a decode step's bytes grows with the batch
        shares = [r["kv_share"] for r in sorted(place, key=lambda r: r["batch"]) if r["model"] == model and r["phase"] == "decode"]
        assert all(0 < a < b < 1 for a, b in zip(shares, shares[1:])), (model, shares)
        assert all(r["kv_share"] == pytest.approx(r["kv_bytes"] / r["bytes"]) for r in place if r["phase"] == "decode")


def test_published_parameter_counts():
    for s in decode.MODELS.values():
        assert s.params() == s.published_params


def test_flop_check_fails_without_attention(monkeypatch):
    real = decode.decode_flops
    monkeypatch.setattr(exp_decode, "decode_flops", lambda s, b, c: {**real(s, b, c), "total": real(s, b, c)["matmul"]})
    result = experiments.run("hardware.decode", **SMALL)
    assert _failed(result, "FlopCounterMode")


def test_byte_check_fails_without_the_kv_cache(monkeypatch):
    real = decode.decode_bytes

    def weights_only(s, b, c, elem, kv_elem=None):
        got = real(s, b, c, elem, kv_elem)
        return {**got, "total": got["weights"]}

    monkeypatch.setattr(exp_decode, "decode_bytes", weights_only)
    result = experiments.run("hardware.decode", **SMALL)
    assert _failed(result, "cache tensors' sizes")


def test_parameter_check_fails_without_the_norms(monkeypatch):
    monkeypatch.setattr(decode.LlamaShape, "params", lambda s: s.matmul_params() + s.vocab * s.d_model)
    result = experiments.run("hardware.decode", **SMALL)
    assert _failed(result, "published total")


def test_batched_step_check_fails_with_a_wrong_position(monkeypatch):
    real = decode.rope_angles
    monkeypatch.setattr(decode, "rope_angles", lambda pos, dim, dtype: real(pos + 1, dim, dtype=dtype))
    result = experiments.run("hardware.decode", **SMALL)
    assert _failed(result, "model's own forward")


def test_bad_batch_sizes_are_refused_by_name():
    cls = experiments.get("hardware.decode").config_cls
    assert_refused(cls, {"batch_sizes": "0,8"}, "batch_sizes")
    assert_refused(cls, {"batch_sizes": "1,x"}, "batch_sizes")
    assert_refused(cls, {"batch_sizes": "1,2,3,4,5,6,7"}, "batch_sizes")
    with pytest.raises(ConfigError):
        cls.from_dict({"context": 0})


def test_roofline_time_takes_the_longer_term():
    t = decode.roofline_time(flops=10.0, nbytes=100.0, peak=1.0, bandwidth=1.0)
    assert t["seconds"] == 100.0 and t["bound"] == "memory"
