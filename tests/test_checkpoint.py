"""Sharded DCP checkpoints (backend/checkpoint/) and parallel.checkpoint on the tiny LLaMA mesh: a rank killed
by SIGKILL, every rank restarted from the last checkpoint (the spawner's restarts, torchrun's --max-restarts), the result
bit for bit the uninterrupted run's; corrupt, incomplete and foreign checkpoints refused by name; the last checkpoint
continued on fewer ranks under another dp strategy; the interval trade-off; old MLP runs still drawn."""
import datetime
import json

import numpy as np
import pandas as pd
import pytest
import torch.distributed as dist

from backend import experiments
from backend.comm.spawn import spawn_ranks
from backend.config import ConfigError
from backend.experiments import RunContext
from backend.experiments.parallel import checkpoint as exp
from backend.checkpoint import checkpointer as ckpt
from backend.checkpoint import mesh_checks, mesh_run, mesh_state
from backend.checkpoint.mesh_state import MeshHook, reference_shapes
from backend.store import pid_alive
from tests.conftest import REPO, torchrun_killed_and_restarted

SMALL = dict(steps=4, every=2, kill_step=2, reshard_to="off")
BITWISE = "final parameters equal the uninterrupted run's bit for bit"
KILLED = "the killed rank died by SIGKILL, its process is gone, and every rank restarted"


# --- the checkpoint code's own rules, one rank in this process ------------------------------------------------------
def _plan(**change):
    settings = {"world_size": "1", "tp": "1", "pp": "1", "microbatches": "1", "steps": "5", "layers": "2", **change}
    return experiments.get("parallel.mesh").make_config(settings)


@pytest.fixture
def one_rank(tmp_path):
    """A one-rank gloo group in this process: the checkpoint code's own logic on the mesh's loop, without spawning."""
    store = dist.FileStore(str(tmp_path / "rendezvous"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=60))
    yield tmp_path / "checkpoints"
    dist.destroy_process_group()


class Killed(Exception):
    pass


def _train(root, every=2, plan=None, fault=None, attempt=0) -> dict:
    """The mesh's loop on one rank saving into root every `every` steps (resuming from its newest checkpoint)."""
    from backend.parallel.mesh_train import train_rank

    plan = plan or _plan()
    hook = MeshHook(ckpt.Checkpointer(root, every, 0, attempt=attempt), fault, reference_shapes(plan))
    return train_rank(0, 1, plan, None, hook)


def _interrupted(root, kill_step=2) -> dict:
    """Train until `kill_step` raises, then train again from the checkpoint: the final weights."""
    def fault(step):
        if step == kill_step:
            raise Killed
    with pytest.raises(Killed):
        _train(root, fault=fault)
    return _train(root, attempt=1)["params"]


def _bitwise(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k].view(np.uint64), b[k].view(np.uint64)) for k in a)


def test_resume_equals_the_uninterrupted_run_bit_for_bit(one_rank, monkeypatch):
    """And the rule broken: Adam's step count left at 0 after the load (the bias correction restarts), bits differ."""
    from backend.parallel.mesh_train import train_rank

    plain = train_rank(0, 1, _plan())["params"]
    assert _bitwise(_interrupted(one_rank / "a"), plain)
    monkeypatch.setattr(mesh_state.MeshState, "load_checkpoint_state", lambda self, state: None)
    assert not _bitwise(_interrupted(one_rank / "b"), plain)


def _flip_a_bit(root):
    data = next(ckpt.Checkpointer(root, 2, 0).latest().glob("__0_*.distcp"))
    raw = bytearray(data.read_bytes())
    raw[-100] ^= 0x01  # one bit, inside a tensor's bytes
    data.write_bytes(bytes(raw))


def test_a_corrupt_checkpoint_is_refused_by_name_and_loads_silently_without_the_check(one_rank, monkeypatch):
    _train(one_rank)
    _flip_a_bit(one_rank)
    with pytest.raises(ckpt.CheckpointError, match=r"step_00004 is corrupt: file __0_0.distcp \(rank 0\) does not match its sha256"):
        _train(one_rank, attempt=1)
    monkeypatch.setattr(ckpt, "verify", lambda path, expected: None)  # the check is what refuses it
    assert _train(one_rank, attempt=1)["params"]


def test_a_checkpoint_of_another_model_or_length_is_refused_by_name(one_rank):
    _train(one_rank)
    with pytest.raises(ckpt.CheckpointError, match=r"step_00004 is from another model: model\.\S+ has shape \[\d+, 32\] there, "
                                                   r"\[\d+, 48\] here"):
        _train(one_rank, plan=_plan(d_model="48"), attempt=1)
    with pytest.raises(ckpt.CheckpointError, match=r"from a run of another length: loop.losses has shape \[5\] there, \[6\] here"):
        _train(one_rank, plan=_plan(steps="6"), attempt=1)


def test_an_incomplete_checkpoint_is_not_resumed_from_and_only_the_newest_are_kept(one_rank):
    """A save cut short (no manifest: a rank died while writing) is skipped for the last complete one."""
    _train(one_rank, every=1)
    assert sorted(p.name for p in one_rank.glob("step_*")) == ["step_00004", "step_00005"]
    (one_rank / "step_00005" / ckpt.MANIFEST).unlink()
    assert ckpt.Checkpointer(one_rank, 1, 0).latest().name == "step_00004"


# --- the experiment: spawned ranks ----------------------------------------------------------------------------------
@pytest.mark.parametrize("strategy", ["ddp", "zero2", "zero3", "fsdp"])
def test_spawner_kills_a_rank_restarts_and_matches_bit_for_bit(strategy):
    result = experiments.run("parallel.checkpoint", strategy=strategy, **SMALL)
    assert result.passed, [c for c in result.checks if not c.passed]
    assert result.metrics["attempts"] == 2 and result.metrics["steps_redone"] == 0  # killed in step 2, saved after 2
    assert {BITWISE, KILLED} <= {c.name for c in result.checks}
    kills = [e for e in result.tables["checkpoint_timeline"] if e["event"] == "kill"]
    assert kills and kills[0]["rank"] == 1 and kills[0]["step"] == 2
    assert not pid_alive(kills[0]["pid"]), "the killed rank is still there"


@pytest.fixture(scope="module")
def killed_and_resharded():
    """ZeRO-3 on 2 ranks killed in step 3 (after the step-2 save), restarted, its step-4 checkpoint continued on one
    rank under ZeRO-1."""
    return experiments.run("parallel.checkpoint", strategy="zero3", steps=6, every=2, kill_step=3, reshard_to="zero1",
                           reshard_ranks=1)


def test_the_defaults_kill_restart_and_continue_on_fewer_ranks(killed_and_resharded):
    result = killed_and_resharded
    assert result.passed, [c for c in result.checks if not c.passed]
    m = result.metrics
    assert (m["resumed_from_step"], m["steps_redone"], m["reshard_from"]) == (2, 1, "step_00004")
    assert m["reshard_plan"] == "tp 1 x pp 1 x dp 2 zero3 -> tp 1 x pp 1 x dp 1"
    assert {r["saved rank"] for r in result.tables["reshard_map"]} == {0, 1}
    assert {r["new rank"] for r in result.tables["reshard_map"]} == {0}
    assert result.notes[0].startswith("Rank 1 was killed by SIGKILL in step 3")


def test_the_share_per_rank_is_the_per_category_rows_summed(killed_and_resharded, monkeypatch):
    """The table the page draws as each rank's tick: pandas' groupby of the per-category rows, independently; a
    share_per_rank that drops a category (the rule broken) no longer matches."""
    rows = pd.DataFrame(killed_and_resharded.tables["checkpoint_bytes_per_rank"])
    want = rows.groupby("rank", as_index=False)[["written_bytes", "expected_bytes"]].sum().to_dict("records")

    def matches(table):
        got = pd.DataFrame(table)[["rank", "written_bytes", "expected_bytes"]].to_dict("records")
        return got == want
    assert matches(killed_and_resharded.tables["checkpoint_share_per_rank"])
    assert matches(mesh_checks.share_per_rank(rows.to_dict("records")))
    right = mesh_checks.share_per_rank
    monkeypatch.setattr(mesh_checks, "share_per_rank",
                        lambda per_rank: right([r for r in per_rank if r["category"] != "the rest"]))
    assert not matches(mesh_checks.share_per_rank(rows.to_dict("records")))


def test_async_save_resumes_from_a_checkpoint_written_while_training_went_on():
    """dcp.async_save: the step-2 save writes during step 2 and is completed (manifest) before step 3, where rank 1
    is killed: the restart loads it (not a restart from scratch) and ends bit for bit."""
    result = experiments.run("parallel.checkpoint", strategy="zero3", save="async", **{**SMALL, "kill_step": 3})
    assert result.passed, [c for c in result.checks if not c.passed]
    assert result.metrics["resumed_from_step"] == 2 and result.metrics["load_s"] is not None


RESHARD = dict(kill_rank=-1, steps=4, every=2)


@pytest.mark.parametrize("saved, loaded", [(("zero3", 4), ("zero1", 2)), (("fsdp", 4), ("ddp", 3))])
def test_a_checkpoint_saved_on_4_ranks_continues_on_fewer_ranks_equal_to_one_process(saved, loaded):
    """Resharding as the experiment's setting: the step-2 checkpoint of a 4-rank run loaded by the same processes
    regrouped as fewer ranks of another strategy (FSDP2's rows read into DDP's whole tensors), which train steps 2
    and 3 equal to one float64 process."""
    result = experiments.run("parallel.checkpoint", strategy=saved[0], world_size=saved[1], reshard_to=loaded[0],
                             reshard_ranks=loaded[1], batch=12, **RESHARD)
    assert result.passed, [c for c in result.checks if not c.passed]
    assert result.metrics["reshard_from"] == "step_00002"
    assert {r["new rank"] for r in result.tables["reshard_map"]} == set(range(loaded[1]))
    assert {r["saved rank"] for r in result.tables["reshard_map"]} == set(range(saved[1]))


def _continue_without_restoring_the_shards(rank, world, config, ctx):
    """The rule broken in the new ranks: what DCP loaded is not put back (ZeRO-1's gathered weights, Adam's step)."""
    mesh_state.MeshState.load_checkpoint_state = lambda self, state: None
    return exp.run_rank(rank, world, config, ctx)


def _continue_with_a_read_dropped(rank, world, config, ctx):
    """The rule broken: DCP's plan for each rank loses its last read (a saved piece that overlaps is not read)."""
    from torch.distributed.checkpoint import DefaultLoadPlanner

    plan = DefaultLoadPlanner.create_local_plan

    def dropped(self):
        out = plan(self)
        out.items = out.items[:-1]
        return out
    DefaultLoadPlanner.create_local_plan = dropped
    return exp.run_rank(rank, world, config, ctx)


PARAMS_AND_LOSSES = {"resharded (tp 1 x pp 1 x dp 2 zero3 -> tp 1 x pp 1 x dp 1): final parameters equal one process",
                     "resharded: every step's loss equals one process"}


@pytest.mark.parametrize("rank_fn, failing", [
    (_continue_without_restoring_the_shards, PARAMS_AND_LOSSES),
    (_continue_with_a_read_dropped, PARAMS_AND_LOSSES | {"resharded: each new rank's reads add up to the tensor bytes it holds"})])
def test_the_resharding_checks_fail_when_the_rule_is_broken(tmp_path, rank_fn, failing):
    config = exp.CheckpointConfig(strategy="zero3", reshard_to="zero1", reshard_ranks=1, **RESHARD).validate()
    payloads = spawn_ranks(rank_fn, 2, config, RunContext(scratch_dir=str(tmp_path), timeout_s=180),
                           ("torch.distributed.fsdp", "torch.distributed.checkpoint"))
    result = exp.combine(config, payloads)
    assert {c.name for c in result.checks if not c.passed} == failing


@pytest.mark.parametrize("change, field, message", [
    ({"kill_rank": "2"}, "kill_rank", "not a rank of world_size=2"),
    ({"kill_step": "6"}, "kill_step", "past the last step"),
    ({"every": "7"}, "every", "saves nothing in 6 steps"),
    ({"every": "6"}, "every", "allowed with reshard_to=same: 1 to 5"),
    ({"reshard_ranks": "3"}, "reshard_ranks", "allowed: 1 to 2"),
    ({"world_size": "4", "batch": "2"}, "batch", "2 sequences cannot give dp x ep = 4 ranks one each"),
    ({"save": "async", "every": "6", "reshard_to": "off", "kill_rank": "-1", "steps": "5"}, "every", "saves nothing in 5 steps"),
])
def test_bad_settings_are_refused_by_this_experiments_own_names(change, field, message):
    with pytest.raises(ConfigError, match=message) as info:
        experiments.get("parallel.checkpoint").make_config(change)
    assert info.value.field == field


def test_interval_tradeoff_closed_form_against_monte_carlo_and_young(monkeypatch):
    """The renewal formula agrees with simulated failures, Young's interval lands near the best one; the Monte Carlo
    check fails when the formula forgets the failures (the rule broken)."""
    good = exp.interval_tradeoff(step_s=0.04, save_s=0.09, restart_s=0.25, mtbf_s=5.0)
    assert good["mc_error"] < 0.05 and good["young_vs_best"] < 0.05
    assert good["young_steps"] == round((2 * 0.09 * 5.0) ** 0.5 / 0.04)  # sqrt(2 C M) / step
    monkeypatch.setattr(exp, "expected_time_per_step", lambda k, step, save, restart, mtbf: (k * step + save) / k)
    assert exp.interval_tradeoff(step_s=0.04, save_s=0.09, restart_s=0.25, mtbf_s=5.0)["mc_error"] > 0.05


def test_torchrun_max_restarts_resumes_the_killed_group_bit_for_bit(tmp_path):
    """Under torchrun --max-restarts 1: rank 1 dies by SIGKILL, torchrun restarts both ranks, rank 0 reopens the
    same run, they load its last checkpoint and finish equal to the uninterrupted run; no process is left."""
    from backend.store import RunStore

    report, _ = torchrun_killed_and_restarted("parallel.checkpoint", {**SMALL, "strategy": "zero3"}, 2, tmp_path, 240)
    assert RunStore(tmp_path).get(report["run_id"]).status == "succeeded"


# --- runs stored before version 2 (the MLP) -------------------------------------------------------------------------
OLD = REPO / "tests" / "data" / "old_results" / "v1" / "parallel.checkpoint.json"


def test_a_version_1_mlp_run_opens_as_the_mlp_shape_and_draws_on_the_page():
    """A run of the MLP's own loop stored before version 2 opens through the MLP's shape (the upgrade names its model)
    and draws on the page; without the upgrade step it names no shape."""
    import dataclasses

    from backend.result import Shapes, UndeclaredKey
    from backend.store import RunStore
    from tests.test_pages import _app

    stored = json.loads(OLD.read_text())
    schema = experiments.get("parallel.checkpoint").schema
    opened = schema.open(stored, "parallel.checkpoint")
    assert opened["metrics"]["model"] == "mlp" and schema.shapes["mlp"].problems(opened["metrics"], opened["tables"]) == []
    nothing = {1: lambda result: None}  # the upgrade step does nothing
    broken = Shapes(by="model", shapes={k: dataclasses.replace(s, upgrades=nothing) for k, s in schema.shapes.items()})
    with pytest.raises(UndeclaredKey, match="metric 'model' is None"):
        broken.open(stored, "parallel.checkpoint")
    store = RunStore()
    rid = store.create("parallel.checkpoint", stored["config"], "old-mlp-checkpoint", status="running")
    path = store.run_dir(rid) / "result.json"
    path.write_text(json.dumps(stored))
    store.finish(rid, "succeeded", result_path=str(path))
    at = _app("pages/checkpoints.py", run=rid)
    assert not at.exception, at.exception
    assert any("older Linear+tanh MLP" in c.value for c in at.caption)


def test_a_version_3_mesh_run_gets_its_share_per_rank_from_the_upgrade(killed_and_resharded, monkeypatch):
    """parallel.mesh runs stored before the share table (version 3): the upgrade sums their per-category rows (pandas'
    groupby here, independently); without the upgrade step the table is missing."""
    import dataclasses

    from backend.result import VERSION_KEY

    rows = killed_and_resharded.tables["checkpoint_bytes_per_rank"]
    stored = {VERSION_KEY: 3, "metrics": {}, "tables": {"checkpoint_bytes_per_rank": rows, "recompute": []}}
    schema = experiments.get("parallel.mesh").schema
    upgraded = schema.upgrade(json.loads(json.dumps(stored)))
    want = pd.DataFrame(rows).groupby("rank", as_index=False)[["written_bytes", "expected_bytes"]].sum()
    assert upgraded["tables"]["checkpoint_share_per_rank"] == want[["rank", "written_bytes", "expected_bytes"]].to_dict("records")
    skipped = dataclasses.replace(schema, upgrades={**schema.upgrades, 3: lambda result: None})
    assert "checkpoint_share_per_rank" not in skipped.upgrade(json.loads(json.dumps(stored)))["tables"]


def test_a_resumed_run_inherits_the_parents_timeline_baseline_and_attempts(tmp_path):
    """A run resuming a failed one starts at the attempt after the parent's last (so the kill, which fires only in
    attempt 0, does not fire again), with the parent's timeline (rank 0) and this rank's uninterrupted baseline."""
    parent, root = tmp_path / "parent", tmp_path / "child"
    ckpt.log_event(parent, event="start", step=0, attempt=0)
    ckpt.log_event(parent, event="kill", rank=1, step=2, pid=1)
    for rank in (0, 1):
        (parent / mesh_run.BASELINE.format(rank)).write_bytes(b"baseline %d" % rank)
    assert mesh_run.inherit(1, root, parent) == 1
    assert (root / mesh_run.BASELINE.format(1)).read_bytes() == b"baseline 1"
    assert not (root / ckpt.TIMELINE).exists() and not (root / mesh_run.BASELINE.format(0)).exists()
    assert mesh_run.inherit(0, root, parent) == 1
    assert [e["event"] for e in ckpt.read_timeline(root)] == ["start", "kill"]
    assert mesh_run.inherit(0, tmp_path / "alone", None) == 0
