"""Mesh checkpoints of the last two plans of issue #30: context parallel (ring attention, cp = 2) and expert parallel (the
MoE's experts over ep = 2). Each killed mid-step and resumed bit for bit against the uninterrupted float64 run, its
checkpoint's bytes equal to the model's state (per rank too), and continued on cp 1 / ep 1 (reshard_cp, reshard_ep)
equal to one float64 process within 1e-9. Each rule is shown to fail when broken: experts saved at another ep rank's
expert index, cp replicas not written by the lowest rank."""
import pytest

from backend import experiments
from backend.config import ConfigError
from backend.checkpoint import mesh_checks, mesh_run, mesh_state
from backend.checkpoint import pieces as dcp_pieces
from backend.parallel.tp_model import reference_model
from tests.test_checkpoint_mesh_plans import BITWISE, KILLED, PER_RANK, RESHARDED, TOTAL, _checks, _failing, _spawned

EXP = experiments.get("parallel.mesh")
ONE = {"world_size": "2", "tp": "1", "pp": "1", "microbatches": "1", "steps": "3", "checkpoint_every": "1"}
CP = {**ONE, "cp": "2"}
EP = {**ONE, "ep": "2", "experts": "4"}
KILL = {"kill_rank": "1", "kill_step": "2"}
TO_ONE = {"reshard_tp": "1", "reshard_pp": "1"}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("plan, reshard, label", [
    (CP, {"reshard_cp": "1"}, "tp 1 x pp 1 x dp 1 x cp 2 -> tp 1 x pp 1 x dp 2 allreduce"),
    (EP, {"reshard_ep": "1"}, "tp 1 x pp 1 x dp 1 x ep 2 -> tp 1 x pp 1 x dp 2 allreduce"),
], ids=["cp2-to-cp1", "ep2-to-ep1"])
def test_cp_and_ep_are_killed_resumed_bit_for_bit_and_continued_on_one_rank_of_that_dimension(plan, reshard, label):
    """Rank 1 killed in step 2, both ranks restarted from step 2's checkpoint and finishing bit for bit as the run
    without the kill; the checkpoint (each rank's file its share: cp's replicas by rank 0, ep's experts by their
    holder) continued with the dimension folded into dp, equal to one float64 process."""
    result = EXP.run(EXP.make_config({**plan, **KILL, **TO_ONE, **reshard}))
    checks = _checks(result)
    assert result.passed, _failing(result)
    for name in (BITWISE, KILLED, TOTAL, PER_RANK, RESHARDED.format(label)):
        assert checks[name].passed and checks[name].error <= 1e-9, name
    assert checks[BITWISE].error == 0 and (result.metrics["attempts"], result.metrics["resumed_from_step"]) == (2, 2)
    assert result.metrics["reshard_plan"] == label


def test_the_moe_holds_no_state_beside_its_parameters():
    """What an ep checkpoint must hold beside the parameters (router, experts, shared expert) and Adam's m, v: nothing.
    The router is a parameter and the routing dropless top-k, with no load-balance bias or counts kept between steps."""
    model = reference_model(EXP.make_config(EP))
    assert not list(model.buffers())
    assert any(".ffn.router." in k for k, _ in model.named_parameters())


def _experts_rotated(rank, world, config, ctx):
    """The rule broken: each ep rank saves (and loads back) its experts under the other ep rank's expert indices, so a
    resume on the same mesh reads them back right and the checkpoint's bytes are all there, but at the wrong keys."""
    from backend.experiments.parallel import mesh

    right, shift = mesh_state.source_pieces, config.experts // config.ep

    def rotated(p, shapes):
        out = []
        for ref, *rest in right(p, shapes):
            head, sep, tail = ref.partition(".experts.")
            if sep:
                i, _, name = tail.partition(".")
                ref = f"{head}.experts.{(int(i) + shift) % config.experts}.{name}"
            out.append((ref, *rest))
        return out

    continued = mesh_run.continue_on_another_mesh

    def continue_right(*args, **kwargs):  # the continuation on ep 1 keys its experts rightly
        mesh_state.source_pieces = right
        return continued(*args, **kwargs)
    mesh_state.source_pieces, mesh_run.continue_on_another_mesh = rotated, continue_right
    return mesh.run_rank(rank, world, config, ctx)


@pytest.mark.timeout(900)
def test_the_ep_continuation_differs_when_experts_are_saved_at_another_ranks_indices(tmp_path):
    result = _spawned(_experts_rotated, {**EP, **TO_ONE, "reshard_ep": "1"}, tmp_path)
    checks = _checks(result)
    name = RESHARDED.format("tp 1 x pp 1 x dp 1 x ep 2 -> tp 1 x pp 1 x dp 2 allreduce")
    assert checks[TOTAL].passed and checks[PER_RANK].passed and not checks[name].passed


def _replicas_balanced(rank, world, config, ctx):
    """The rule broken: DCP's deduplication of identical cp replicas balances them over the ranks (its default)
    instead of giving each to the lowest rank: every byte is still written once, but rank 1's file holds rank 0's."""
    from torch.distributed.checkpoint import DefaultSavePlanner

    from backend.experiments.parallel import mesh

    class Balanced(DefaultSavePlanner):
        def lookup_object(self, index):
            return dcp_pieces.lookup(self.state_dict, index)
    dcp_pieces.save_planner = lambda: Balanced(dedup_save_to_lowest_rank=False)
    return mesh.run_rank(rank, world, config, ctx)


@pytest.mark.timeout(900)
def test_the_per_rank_check_fails_when_cp_replicas_are_not_written_by_the_lowest_rank(tmp_path):
    result = _spawned(_replicas_balanced, CP, tmp_path)
    checks = _checks(result)
    assert checks[TOTAL].passed and not checks[PER_RANK].passed
    written = {r: sum(x["written_bytes"] for x in result.tables["checkpoint_bytes_per_rank"] if x["rank"] == r) for r in (0, 1)}
    assert written[1] > 0


@pytest.mark.parametrize("change, field", [
    ({**EP, **TO_ONE, "reshard_ep": "3"}, "reshard_ep"),  # 4 experts over 3 ranks
    ({**CP, **TO_ONE, "reshard_cp": "3"}, "reshard_cp"),  # 3 does not divide 2 ranks
    ({**CP, "reshard_cp": "1"}, "reshard_cp"),  # no continuation
    ({**EP, "reshard_ep": "1"}, "reshard_ep"),
])
def test_a_cp_or_ep_reshard_the_new_mesh_refuses_is_refused_by_its_own_name(change, field):
    with pytest.raises(ConfigError) as err:
        EXP.make_config(change)
    assert err.value.field == field and "allowed" in str(err.value)


def test_the_checkpoints_page_reads_the_bench_figures_from_its_json(tmp_path):
    """The page's bench expander shows bench/checkpoint.py's JSON as written, and nothing while there is none."""
    import json

    row = {"plan": "tp 2 x pp 2", "mode": "async", "checkpoint_tensor_bytes": 1000, "model_state_bytes": 1000,
           "per_rank_bytes": [{"rank": 0, "written_bytes": 600, "expected_bytes": 600}, {"rank": 1, "written_bytes": 400}],
           "save_blocking": {"median_s": 0.01, "min_s": 0.005, "max_s": 0.03}, "load": {"seconds_slowest_rank": 0.4},
           "step_after_save": {"median_s": 0.8}, "step_without_save": {"median_s": 0.25}}
    path = tmp_path / "checkpoint.json"
    assert mesh_checks.bench_rows(path) is None
    path.write_text(json.dumps({"device": {"name": "CPU (2 cores)"}, "when": "T", "load_average_1_5_15_min_at_start": [3.5, 1, 1],
                                "rows": [row]}))
    about, (got,) = mesh_checks.bench_rows(path)
    assert about == {"machine": "CPU (2 cores)", "when": "T", "load": 3.5}
    assert (got["blocking (s)"], got["min-max (s)"], got["load (s)"]) == (0.01, "0.005-0.030", 0.4)
    assert (got["step, saving (s)"], got["step, not (s)"], got["top rank (B)"]) == (0.8, 0.25, 600)
    assert got["bytes / model (B)"] == "1,000 / 1,000"
