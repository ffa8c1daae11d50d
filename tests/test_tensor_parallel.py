"""Tensor and sequence parallel against one process, DTensor, the byte model and the activation formula."""
import multiprocessing

import pytest
import torch

from backend.comm.spawn import spawn_ranks
from backend.config import ConfigError
from backend.experiments import RunContext
from backend.experiments.parallel import tp
from backend.experiments.parallel.tp import TOL, TPConfig
from backend.parallel.sp import activation_elements
from backend.result import Check


@pytest.fixture(scope="module", params=[2, 4])
def run(request):
    cfg = TPConfig(world_size=request.param).validate()
    payloads = spawn_ranks(tp.run_rank, request.param, cfg, RunContext(timeout_s=300))
    assert multiprocessing.active_children() == []
    return cfg, payloads, tp.combine(cfg, payloads)


def test_every_check_passes(run):
    cfg, payloads, result = run
    assert result.passed, [(c.name, c.error) for c in result.checks if not c.passed]
    assert len(result.checks) >= 12


def test_a_wrong_shard_fails_the_gradient_check(run):
    """The neighbour's columns of a gradient, compared as the check compares: far outside the tolerance."""
    cfg, payloads, result = run
    wrong = max(p["modes"]["TP"]["wrong_shard_error"] for p in payloads)
    assert not Check("gradient", wrong, TOL).passed and wrong > 1e-4


def test_a_wrong_byte_count_fails(run):
    cfg, payloads, result = run
    payloads[0]["modes"]["TP + SP"]["log"][0]["sent_bytes"] += 8
    assert not tp.combine(cfg, payloads).passed
    payloads[0]["modes"]["TP + SP"]["log"][0]["sent_bytes"] -= 8


def test_sequence_parallel_moves_the_same_bytes_and_saves_memory(run):
    cfg, payloads, result = run
    m = result.metrics
    assert m["TP MLP forward bytes per rank per layer"] == m["TP + SP MLP forward bytes per rank per layer"] > 0
    held = {row["layout"].split(",")[0]: row["measured_bytes"] for row in result.tables["memory"]}
    assert held["TP + SP"] < held["TP"] < held["one rank"]


def test_dtensor_bytes_measured_on_the_sockets(run):
    """DTensor's bytes, read from /proc/self/io, equal gloo's volumes for what it issued; at t ranks its MLP moves
    3 all-reduces of b·s·h (gate and up input gradients apart) where ours moves 2; a byte off fails the check."""
    cfg, payloads, result = run
    n, bsh = cfg.world_size, cfg.batch * cfg.seq * cfg.d_model
    mlp = {r["layer"]: r for r in result.tables["dtensor"]}["MLP: Colwise, Rowwise"]
    ring = 2 * (n - 1) * bsh // n * 8
    assert (mlp["dtensor_bytes_written"], mlp["ours_bytes_written"]) == (3 * ring, 2 * ring)
    issued = [c for c in result.tables["dtensor_collectives"] if c["rank"] == 0 and c["layer"].startswith("block")]
    assert {c["op"] for c in issued} == {"all_gather", "reduce_scatter", "all_reduce"}
    row = payloads[1]["dtensor"]["block: SequenceParallel norms, Colwise, Rowwise"]
    row["dtensor_written_payload"] += 8
    assert not tp.combine(cfg, payloads).passed
    row["dtensor_written_payload"] -= 8


def test_the_mlp_all_reduce_is_b_s_h(run):
    cfg, payloads, result = run
    n, bsh = cfg.world_size, cfg.batch * cfg.seq * cfg.d_model
    rows = [r for r in result.tables["collectives"] if r["mode"] == "TP" and r["name"] == "mlp"]
    assert {(r["phase"], r["op"], r["calls"]) for r in rows} == {("forward", "all_reduce", cfg.layers), ("backward", "all_reduce", cfg.layers)}
    assert all(r["sent_bytes"] == cfg.layers * 2 * (n - 1) * bsh // n * 8 for r in rows)


def test_worked_examples_step_by_step(run):
    cfg, payloads, result = run
    if cfg.world_size != 2:
        assert "worked_examples" not in result.tables  # the seed's examples are 2x2 on 2 ranks
        return
    steps = result.tables["worked_examples"]
    col = {(s["rank"], s["step"][:6]): s for s in steps if s["example"] == "column"}
    assert col[(0, "Y_r = ")]["Y_r"] == [[19.0], [43.0]] and col[(1, "Y_r = ")]["Y_r"] == [[22.0], [50.0]]
    row = [s for s in steps if s["example"] == "row" and s["step"].startswith("Y_r")]
    assert torch.tensor(row[0]["Y_r"]).add(torch.tensor(row[1]["Y_r"])).tolist() == [[19.0, 22.0], [43.0, 50.0]]
    assert row[0]["Y_r"] == [[5.0, 6.0], [15.0, 18.0]]  # x1·[w1 w2], x3·[w1 w2]: the seed's outer product


def test_activation_formula_terms():
    """Sequence parallel divides every term by t; TP leaves the norms whole."""
    tp_terms = activation_elements(2, 16, 32, 8, 64, 64, 4, False)
    sp_terms = activation_elements(2, 16, 32, 8, 64, 64, 4, True)
    one = activation_elements(2, 16, 32, 8, 64, 64, 1, False)
    assert sum(sp_terms.values()) == pytest.approx(sum(one.values()) / 4)
    assert tp_terms["norms (x, x·rsqrt, output)"] == one["norms (x, x·rsqrt, output)"]


@pytest.mark.parametrize("values, field", [
    ({"world_size": "3"}, "n_heads"), ({"world_size": "4", "n_kv_heads": "2"}, "n_kv_heads"),
    ({"n_kv_heads": "3", "n_heads": "8", "world_size": "2"}, "n_kv_heads"), ({"d_head": "7"}, "d_head"),
    ({"world_size": "1"}, "world_size"), ({"vocab": "63"}, "vocab"),
])
def test_bad_inputs(values, field):
    with pytest.raises(ConfigError) as info:
        TPConfig.from_dict(values)
    assert info.value.field == field


def test_pipeline_boundary_is_a_real_stage_cut(run):
    """Stage 0 sends layer 0's real output (b x s x h, MK float64 bytes, also on its socket) and stage 1's loss from
    it equals one process's; a byte off, or the zeros tensor the page used to send, fails."""
    cfg, payloads, result = run
    mk = cfg.batch * cfg.seq * cfg.d_model
    stage0, stage1 = payloads[0]["pp"], payloads[1]["pp"]
    assert stage0["shape"] == [cfg.batch, cfg.seq, cfg.d_model] and stage0["logged_bytes"] == mk * 8
    assert stage0["written_payload"] in (None, mk * 8) and stage1["loss_error"] <= TOL
    assert all(p["pp"]["logged_bytes"] == 0 and p["pp"]["loss"] is None for p in payloads[2:])
    stage0["logged_bytes"] += 8
    assert not tp.combine(cfg, payloads).passed
    stage0["logged_bytes"] -= 8

    from backend.experiments.parallel.tp import pipeline_boundary
    from backend.parallel.tp_model import reference_model, tokens
    from backend.trace import Tracer

    class ZerosArrive:  # stage 1's side with the old payload: an M x K tensor of zeros
        index, tracer = 1, Tracer(1)

        class p2p:
            bytes_sent = 0

            @staticmethod
            def exchange(step, phase, sends=(), recvs=()):
                for r in recvs:
                    r.tensor.zero_()
    reference = reference_model(cfg)
    wrong = pipeline_boundary(reference, tokens(cfg), ZerosArrive())["loss"]
    assert abs(wrong - reference.loss(tokens(cfg)).item()) > 1e-3


def test_pipeline_send_is_on_the_timeline_where_it_happened(run):
    """The stage boundary runs right after the TP and TP + SP steps, so its events follow them on each rank's
    timeline by less than a quarter of the steps' time (it used to come ~0.9 s later, after the DTensor peer,
    leaving the steps 11% of the axis), and nothing comes after it."""
    cfg, payloads, result = run
    for p in payloads[:2]:
        events = p["trace"]["events"]
        span = {e["name"]: e for e in events if e["lane"] == "compute" and " step " not in e["name"]}
        steps_start, steps_end = span["TP forward"]["ts"], span["TP + SP backward"]["ts"] + span["TP + SP backward"]["dur"]
        pp = [e for e in events if "pipeline send" in e["name"] or e["name"].startswith("PP stage")]
        assert len(pp) == 2
        assert min(e["ts"] for e in pp) - steps_end < 0.25 * (steps_end - steps_start)
        assert max(e["ts"] + e["dur"] for e in events) == max(e["ts"] + e["dur"] for e in pp)
