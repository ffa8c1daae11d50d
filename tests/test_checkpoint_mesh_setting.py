"""Kill and resume, and resharding, as settings of parallel.mesh (backend/checkpoint/mesh_run.py): the run's own
checks pass (bit for bit against the uninterrupted run, the killed process gone, the continuation on tp 1 x pp 4 equal
to one process), fail when the rules are broken, and bad combinations are refused by name."""
import re

import pytest

from backend import experiments
from backend.comm.spawn import spawn_ranks
from backend.config import ConfigError
from backend.experiments import RunContext

SETTINGS = {"steps": "4", "checkpoint_every": "2", "kill_rank": "1", "kill_step": "3", "reshard_tp": "1", "reshard_pp": "4"}
NAMES = ("final parameters equal the uninterrupted run's bit for bit",
         "the killed rank died by SIGKILL, its process is gone, and every rank restarted",
         "resharded (tp 2 x pp 2 x dp 1 -> tp 1 x pp 4 x dp 1): final parameters equal one process",
         "resharded: every step's loss equals one process",
         "resharded: each new rank's reads add up to the tensor bytes it holds",
         "tensor bytes in the last checkpoint equal the model's state exactly (each piece written once)")


def _checks(result) -> dict:
    return {c.name: c for c in result.checks}


@pytest.mark.timeout(900)
def test_a_mesh_run_killed_resumed_and_continued_on_another_mesh_passes(tmp_path):
    exp = experiments.get("parallel.mesh")
    result = exp.run(exp.make_config(SETTINGS))
    checks = _checks(result)
    assert all(checks[n].passed for n in NAMES) and result.passed, [c.name for c in result.checks if not c.passed]
    m = result.metrics
    assert (m["attempts"], m["resumed_from_step"], m["steps_redone"], m["reshard_from"]) == (2, 2, 1, "step_00002")
    kinds = [e["event"] for e in result.tables["checkpoint_timeline"]]
    assert kinds.count("kill") == 1 and kinds.count("start") == 2
    assert {r["saved rank"] for r in result.tables["reshard_map"]} == {0, 1, 2, 3}


def _broken_rank(rank, world, config, ctx):
    """Rules broken in the ranks: Adam's step is not restored with m and v (bias correction restarts), the weights are
    saved twice, and the continuation on the other mesh reads each block's tensors from the next block's (ownership by
    position, not by layer index)."""
    from backend.experiments.parallel import mesh
    from backend.checkpoint import mesh_run, mesh_state

    restore, right = mesh_state.MeshState.load_checkpoint_state, mesh_state.source_pieces
    go_on = mesh_run.continue_on_another_mesh

    def without_adam_step(self, state):
        step = self.sync.adam.step
        restore(self, state)
        self.sync.adam.step = step

    def next_block(p, shapes):
        return [(re.sub(r"^blocks\.(\d+)\.", lambda m: f"blocks.{(int(m[1]) + 1) % config.layers}.", ref), *rest)
                for ref, *rest in right(p, shapes)]

    def continued_from_the_next_block(*args):
        mesh_state.MeshState.load_checkpoint_state = restore
        mesh_state.source_pieces = next_block
        return go_on(*args)
    state = mesh_state.MeshState.checkpoint_state

    def with_a_second_copy(self):  # a third rule broken: the model's weights saved twice (under another name too)
        out = state(self)
        return {**out, **{k.replace("model.", "copy.", 1): v for k, v in out.items() if k.startswith("model.")}}
    mesh_state.MeshState.load_checkpoint_state = without_adam_step
    mesh_state.MeshState.checkpoint_state = with_a_second_copy
    mesh_run.continue_on_another_mesh = continued_from_the_next_block
    return mesh.run_rank(rank, world, config, ctx)


@pytest.mark.timeout(900)
def test_the_checks_fail_when_the_rules_are_broken(tmp_path):
    exp = experiments.get("parallel.mesh")
    config = exp.make_config(SETTINGS)
    payloads = spawn_ranks(_broken_rank, 4, config, RunContext(scratch_dir=str(tmp_path), timeout_s=600), restarts=1)
    checks = _checks(exp.combine(config, payloads))
    assert not checks[NAMES[0]].passed and not checks[NAMES[2]].passed and not checks[NAMES[5]].passed


@pytest.mark.parametrize("change, field", [
    ({"kill_rank": "1"}, "kill_rank"),  # nothing to restart from
    ({"checkpoint_every": "1", "kill_rank": "4"}, "kill_rank"),  # not a rank of 4
    ({"checkpoint_every": "1", "kill_rank": "0", "kill_step": "3"}, "kill_step"),  # past the last of 3 steps
    ({"checkpoint_every": "1", "reshard_tp": "1"}, "reshard_pp"),
    ({"checkpoint_every": "3", "reshard_tp": "1", "reshard_pp": "4"}, "checkpoint_every"),  # no checkpoint before the end
    ({"checkpoint_every": "1", "reshard_tp": "1", "reshard_pp": "3"}, "reshard_pp"),  # 4 layers on 3 stages: named by its pp
])
def test_bad_combinations_are_refused_by_name(change, field):
    with pytest.raises(ConfigError) as err:
        experiments.get("parallel.mesh").make_config(change)
    assert err.value.field == field and "allowed" in str(err.value)


@pytest.mark.timeout(900)
def test_torchrun_max_restarts_resumes_a_killed_mesh_bit_for_bit(tmp_path):
    """tp 2 x pp 2 under torchrun --max-restarts 1: rank 1 dies by SIGKILL in step 2, torchrun restarts the four
    ranks, rank 0 reopens the same run, they load its last checkpoint and end bit for bit equal to the uninterrupted
    run; no process outlives torchrun."""
    from tests.conftest import torchrun_killed_and_restarted

    sets = {"steps": 3, "checkpoint_every": 1, "kill_rank": 1, "kill_step": 2}
    report, _ = torchrun_killed_and_restarted("parallel.mesh", sets, 4, tmp_path, 840)
    assert {c["name"] for c in report["checks"]} >= set(NAMES[:2])
