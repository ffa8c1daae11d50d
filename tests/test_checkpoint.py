"""Sharded DCP checkpoints (backend/parallel/checkpoint.py) and parallel.checkpoint: a rank killed by SIGKILL,
every rank restarted from the last checkpoint, the result bit for bit the uninterrupted run's."""
import datetime

import numpy as np
import pytest
import torch
import torch.distributed as dist

from backend import experiments
from backend.parallel import checkpoint as ckpt
from backend.parallel.loop import start_rank, train
from backend.parallel.workload import FP64, Workload
from backend.store import pid_alive

W = Workload(hidden=8, layers=2, batch=8, steps=5, lr=0.01, seed=3)
SMALL = dict(hidden=16, layers=2, batch=8, steps=4, every=2, kill_step=2)


@pytest.fixture
def one_rank(tmp_path):
    """A one-rank gloo group in this process: the checkpoint code's own logic, without spawning."""
    store = dist.FileStore(str(tmp_path / "rendezvous"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=60))
    yield tmp_path / "checkpoints"
    dist.destroy_process_group()


def _strategy(name, workload=W):
    from backend.experiments.parallel.checkpoint import make_strategy

    mesh, tracer = start_rank(0, 1)
    return make_strategy(name, workload, mesh, tracer)


def _resume(root, name, workload=W):
    """A fresh, set-up strategy resumed from root's newest checkpoint: the step it would run next."""
    from backend.parallel.workload import make_model

    strategy = _strategy(name, workload)
    strategy.setup(make_model(workload))
    state = {"loop.step": torch.tensor(0), "loop.losses": torch.zeros(workload.steps, dtype=torch.float64)}
    return ckpt.Checkpointer(root, 2, 0).resume(strategy, state)


class Killed(Exception):
    pass


def _interrupted(name, root, kill_step=2, every=2, workload=W):
    """Train until `kill_step` dies, then train again in a fresh strategy from the checkpoint: the final params."""
    def fault(step):
        if step == kill_step:
            raise Killed
    with pytest.raises(Killed):
        train(_strategy(name, workload), checkpoint=ckpt.Checkpointer(root, every, 0), fault=fault)
    return train(_strategy(name, workload), checkpoint=ckpt.Checkpointer(root, every, 0, attempt=1)).params


@pytest.mark.parametrize("name", ["ddp", "zero1", "zero3"])
def test_resume_equals_the_uninterrupted_run_bit_for_bit(one_rank, name):
    plain = train(_strategy(name)).params
    assert np.array_equal(_interrupted(name, one_rank).view(np.uint64), plain.view(np.uint64))


def test_resume_fails_when_adam_step_is_not_restored(one_rank, monkeypatch):
    """The rule broken: Adam's step count left at 0 after the load; the bias correction differs, so bits differ."""
    from backend.parallel.zero import ZeRO

    monkeypatch.setattr(ZeRO, "load_checkpoint_state", lambda self, state: None)
    plain = train(_strategy("zero3")).params
    assert not np.array_equal(_interrupted("zero3", one_rank), plain)


def test_a_corrupt_checkpoint_is_refused_by_name(one_rank):
    train(_strategy("zero1"), checkpoint=ckpt.Checkpointer(one_rank, 2, 0))
    saver = ckpt.Checkpointer(one_rank, 2, 0)
    data = next(saver.latest().glob("__0_*.distcp"))
    raw = bytearray(data.read_bytes())
    raw[-100] ^= 0x01  # one bit, inside a tensor's bytes
    data.write_bytes(bytes(raw))
    with pytest.raises(ckpt.CheckpointError, match=r"step_00004 is corrupt: file __0_0.distcp \(rank 0\) does not match its sha256"):
        _resume(one_rank, "zero1")


def test_a_flipped_bit_loads_silently_without_the_manifest_check(one_rank, monkeypatch):
    """The check is what refuses it: with verify() a no-op the same corrupt file loads without a word."""
    train(_strategy("zero1"), checkpoint=ckpt.Checkpointer(one_rank, 2, 0))
    saver = ckpt.Checkpointer(one_rank, 2, 0)
    data = next(saver.latest().glob("__0_*.distcp"))
    raw = bytearray(data.read_bytes())
    raw[-100] ^= 0x01
    data.write_bytes(bytes(raw))
    monkeypatch.setattr(ckpt, "verify", lambda path, expected: None)
    assert _resume(one_rank, "zero1") == 4


def test_a_checkpoint_of_another_model_is_refused(one_rank):
    train(_strategy("zero1"), checkpoint=ckpt.Checkpointer(one_rank, 2, 0))
    wider = Workload(hidden=16, layers=2, batch=8, steps=5, lr=0.01, seed=3)
    with pytest.raises(ckpt.CheckpointError, match=r"from another model: model.0.weight has shape \[64\] there, \[256\] here"):
        _resume(one_rank, "zero1", wider)
    with pytest.raises(ckpt.CheckpointError, match=r"from another model: model.0.weight has shape \[64\] there, \[8, 8\] here"):
        _resume(one_rank, "fsdp")


def test_an_incomplete_checkpoint_is_not_resumed_from(one_rank):
    """A save cut short (no manifest: a rank died while writing) is skipped for the last complete one."""
    train(_strategy("zero1"), checkpoint=ckpt.Checkpointer(one_rank, 2, 0))
    (one_rank / "step_00004" / ckpt.MANIFEST).unlink()
    assert ckpt.Checkpointer(one_rank, 2, 0).latest().name == "step_00002"


@pytest.mark.parametrize("strategy", ["ddp", "zero2", "zero3", "fsdp"])
def test_spawner_kills_a_rank_restarts_and_matches_bit_for_bit(strategy):
    result = experiments.run("parallel.checkpoint", strategy=strategy, **SMALL)
    assert result.passed, [c for c in result.checks if not c.passed]
    assert result.metrics["attempts"] == 2 and result.metrics["steps_redone"] == 0  # killed in step 2, saved after 2
    kills = [e for e in result.tables["timeline"] if e["event"] == "kill"]
    assert kills and kills[0]["rank"] == 1 and kills[0]["step"] == 2
    assert not pid_alive(kills[0]["pid"]), "the killed rank is still there"


def test_zero3_checkpoint_bytes_per_rank_are_its_shards():
    """Each rank's file holds its own half of weights, m and v (3 x 8 B x 272 x 2 / 2 = 6,528 B), the few loop
    tensors going to one rank or the other: counted from the settings, not from the code."""
    result = experiments.run("parallel.checkpoint", strategy="zero3", kill_rank=-1, **SMALL)
    per_rank = {f["rank"]: f["tensor bytes"] for f in result.tables["files"] if f["file"].endswith(".distcp")}
    shard = 3 * 8 * (16 * 16 + 16) * 2 // 2
    loop = 8 + 8 + 4 * 8 + 2 * torch.get_rng_state().numel()  # Adam step, loop step, losses, two RNG states
    assert sorted(per_rank) == [0, 1] and all(shard <= b <= shard + loop for b in per_rank.values())
    assert sum(per_rank.values()) == 2 * shard + loop


def test_kill_settings_are_range_checked():
    from backend.config import ConfigError

    exp = experiments.get("parallel.checkpoint")
    with pytest.raises(ConfigError, match="kill_rank"):
        exp.make_config({"kill_rank": "2", "world_size": "2"})
    with pytest.raises(ConfigError, match="kill_step"):
        exp.make_config({"kill_step": "6", "steps": "6"})


def test_torchrun_max_restarts_resumes_the_killed_group_bit_for_bit(tmp_path):
    """Under torchrun --max-restarts 1: rank 1 dies by SIGKILL, torchrun restarts both ranks, rank 0 reopens the
    same run, they load its last checkpoint and finish equal to the uninterrupted run; no process is left."""
    import json
    import os
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    from backend.store import RunStore
    from tests.conftest import REPO, processes_in_group

    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which("torchrun")
    sets = [a for k, v in {**SMALL, "strategy": "zero3"}.items() for a in ("--set", f"{k}={v}")]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "EXPLORER_DATA_DIR": str(tmp_path)}
    agent = subprocess.Popen([torchrun, "--standalone", "--nproc-per-node", "2", "--max-restarts", "1", "-m",
                              "backend.launch", "parallel.checkpoint", *sets, "--out", str(tmp_path / "out"), "--json"],
                             cwd=REPO, env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = agent.communicate(timeout=240)
        assert agent.returncode == 0, err[-3000:]
        report = json.loads(out.strip().splitlines()[-1])
        assert report["passed"] and report["metrics"]["attempts"] == 2, report["checks"]
        assert RunStore(tmp_path).get(report["run_id"]).status == "succeeded"
        kill = [e for e in json.loads((tmp_path / "out" / "result.json").read_text())["tables"]["timeline"] if e["event"] == "kill"]
        assert kill and not pid_alive(kill[0]["pid"])
        assert processes_in_group(agent.pid) == [], "a rank outlived torchrun"
    finally:
        if processes_in_group(agent.pid):
            os.killpg(agent.pid, 9)


RESHARD = dict(kill_rank=-1, hidden=16, layers=2, batch=8, steps=4, every=2)


@pytest.mark.parametrize("saved, loaded", [(("zero3", 4), ("zero1", 2)), (("fsdp", 4), ("fsdp", 2)),
                                           (("zero1", 4), ("ddp", 3))])
def test_a_checkpoint_saved_on_4_ranks_continues_on_another_plan_equal_to_one_process(saved, loaded):
    """Resharding as the experiment's setting: the step-2 checkpoint of a 4-rank run loaded by the same processes
    regrouped as fewer ranks of another strategy, which train steps 2 and 3 equal to one float64 process."""
    result = experiments.run("parallel.checkpoint", strategy=saved[0], world_size=saved[1], reshard_to=loaded[0],
                             reshard_ranks=loaded[1], **RESHARD)
    assert result.passed, [c for c in result.checks if not c.passed]
    assert result.metrics["reshard_from"] == "step_00002"
    assert {r["new rank"] for r in result.tables["reshard_map"]} == set(range(loaded[1]))
    assert {r["saved rank"] for r in result.tables["reshard_map"]} == set(range(saved[1]))


def test_the_resharding_map_is_zero3s_quarters_read_into_zero1s_halves():
    """ZeRO-3 over 4 ranks holds each layer's 272 flat elements as 4 x 68; ZeRO-1 over 2 gives new rank 0 the
    first 272 of the 544 (all of layer 0): it reads model.0.weight's 256 elements as 68, 68, 68 and 52 from saved
    ranks 0-3, and nothing of layer 1 (counted by hand from the two layouts)."""
    result = experiments.run("parallel.checkpoint", strategy="zero3", world_size=4, reshard_to="zero1", reshard_ranks=2,
                             **RESHARD)
    reads = [r for r in result.tables["reshard_map"] if r["key"] == "model.0.weight"]
    assert sorted((r["new rank"], r["saved rank"], r["bytes"]) for r in reads) == [(0, 0, 68 * 8), (0, 1, 68 * 8),
                                                                                  (0, 2, 68 * 8), (0, 3, 52 * 8)]
    starts = sorted(r["from byte"] for r in reads)
    assert [b - starts[0] for b in starts] == [0, 68 * 8, 136 * 8, 204 * 8]  # contiguous, in saved-rank order
    assert not [r for r in result.tables["reshard_map"] if r["key"].startswith("model.1.") and r["new rank"] == 0]


def _continue_without_restoring_the_shards(rank, world, config, ctx):
    """The rule broken in the new ranks: what DCP loaded is not put back (ZeRO-1's gathered weights, Adam's step)."""
    from backend.experiments.parallel.checkpoint import run_rank
    from backend.parallel.zero import ZeRO

    ZeRO.load_checkpoint_state = lambda self, state: None
    return run_rank(rank, world, config, ctx)


def _continue_with_a_read_dropped(rank, world, config, ctx):
    """The rule broken: DCP's plan for each rank loses its last read (a saved piece that overlaps is not read)."""
    from torch.distributed.checkpoint import DefaultLoadPlanner

    from backend.experiments.parallel.checkpoint import run_rank

    plan = DefaultLoadPlanner.create_local_plan

    def dropped(self):
        out = plan(self)
        out.items = [i for i in out.items if i.storage_index.fqn != "model.0.weight"] + \
            [i for i in out.items if i.storage_index.fqn == "model.0.weight"][:-1]
        return out
    DefaultLoadPlanner.create_local_plan = dropped
    return run_rank(rank, world, config, ctx)


PARAMS_AND_LOSSES = {"resharded (zero3 on 4 ranks -> zero1 on 2): final parameters equal one process",
                     "resharded: every step's loss equals one process"}


@pytest.mark.parametrize("rank_fn, failing", [
    (_continue_without_restoring_the_shards, PARAMS_AND_LOSSES),
    (_continue_with_a_read_dropped, PARAMS_AND_LOSSES | {"resharded: each new rank's reads add up to the tensor bytes it holds"})])
def test_the_resharding_checks_fail_when_the_rule_is_broken(tmp_path, rank_fn, failing):
    from backend.comm.spawn import spawn_ranks
    from backend.experiments import RunContext
    from backend.experiments.parallel.checkpoint import CheckpointConfig, combine

    config = CheckpointConfig(strategy="zero3", world_size=4, reshard_to="zero1", reshard_ranks=2, **RESHARD).validate()
    reports = spawn_ranks(rank_fn, 4, config, RunContext(scratch_dir=str(tmp_path), timeout_s=180),
                          ("torch.distributed.fsdp", "torch.distributed.checkpoint"))
    result = combine(config, reports)
    assert {c.name for c in result.checks if not c.passed} == failing


def test_checkpoint_bytes_per_rank_are_each_ranks_own_shards_and_the_check_sees_a_moved_piece(tmp_path, monkeypatch):
    """ZeRO-3 over 3 ranks cuts each layer's 272 elements as 91, 91, 90: each rank's file holds 3 x 8 B per element
    it owns plus its generator state. The check fails when 8 bytes move from rank 0's file to rank 1's (the total
    unchanged) and when the layout rule is not ceil(total / n) pieces."""
    from backend.comm.spawn import spawn_ranks
    from backend.experiments import RunContext
    from backend.experiments.parallel import checkpoint as exp

    config = exp.CheckpointConfig(strategy="zero3", world_size=3, reshard_to="off", batch=9,
                                  **{k: v for k, v in RESHARD.items() if k != "batch"}).validate()
    reports = spawn_ranks(exp.run_rank, 3, config, RunContext(scratch_dir=str(tmp_path), timeout_s=180),
                          ("torch.distributed.checkpoint",))
    name = "each rank's file holds exactly its own shards: weights, Adam m, v and its RNG state"
    check = lambda result: next(c for c in result.checks if c.name == name)
    assert check(exp.combine(config, reports)).passed
    rows = {r["rank"]: r for r in exp.bytes_per_rank(config, reports[0].extra["pieces"])}
    rng = torch.get_rng_state().numel()
    assert [rows[r]["sharded bytes"] for r in range(3)] == [24 * 2 * 91 + rng, 24 * 2 * 91 + rng, 24 * 2 * 90 + rng]
    moved = [dict(p) for p in reports[0].extra["pieces"]]
    first = next(p for p in moved if p["rank"] == 0 and p["key"] == "model.0.weight")
    first["bytes"] -= 8
    next(p for p in moved if p["rank"] == 1 and p["key"] == "model.0.weight")["bytes"] += 8
    reports[0].extra["pieces"] = moved
    assert check(exp.combine(config, reports)).error == 8
    monkeypatch.setattr(exp, "owned", lambda total, rank, n: total // n)  # an even floor split: not the layout
    assert not check(exp.combine(config, reports)).passed


def test_reshard_settings_are_refused_by_name():
    from backend.config import ConfigError

    exp = experiments.get("parallel.checkpoint")
    with pytest.raises(ConfigError, match=r"reshard_to.*allowed with strategy=zero3: same, off, ddp, zero1, zero2, zero3"):
        exp.make_config({"reshard_to": "fsdp"})
    with pytest.raises(ConfigError, match=r"reshard_to.*allowed with strategy=fsdp: same, off, fsdp"):
        exp.make_config({"reshard_to": "zero1", "strategy": "fsdp"})
    with pytest.raises(ConfigError, match=r"reshard_ranks.*allowed: 1 to 2"):
        exp.make_config({"reshard_ranks": "3"})
    with pytest.raises(ConfigError, match=r"every.*allowed with reshard_to=same: 1 to 5"):
        exp.make_config({"every": "6"})


def test_interval_tradeoff_closed_form_against_monte_carlo_and_young(monkeypatch):
    """The renewal formula agrees with simulated failures, Young's interval lands near the best one; the Monte Carlo
    check fails when the formula forgets the failures (the rule broken)."""
    from backend.experiments.parallel import checkpoint as exp

    good = exp.interval_tradeoff(step_s=0.04, save_s=0.09, restart_s=0.25, mtbf_s=5.0)
    assert good["mc_error"] < 0.05 and good["young_vs_best"] < 0.05
    assert good["young_steps"] == round((2 * 0.09 * 5.0) ** 0.5 / 0.04)  # sqrt(2 C M) / step
    monkeypatch.setattr(exp, "expected_time_per_step", lambda k, step, save, restart, mtbf: (k * step + save) / k)
    assert exp.interval_tradeoff(step_s=0.04, save_s=0.09, restart_s=0.25, mtbf_s=5.0)["mc_error"] > 0.05


def test_async_save_resumes_from_a_checkpoint_written_while_training_went_on():
    """dcp.async_save: the step-2 save writes during step 2 and is completed (manifest) before step 3, where rank 1
    is killed: the restart loads it (not a restart from scratch) and ends bit for bit."""
    result = experiments.run("parallel.checkpoint", strategy="zero3", save="async", **{**SMALL, "kill_step": 3})
    assert result.passed, [c for c in result.checks if not c.passed]
    assert result.metrics["resumed_from_step"] == 2 and result.metrics["load_s"] is not None


def test_only_the_newest_checkpoints_are_kept(one_rank):
    train(_strategy("zero1"), checkpoint=ckpt.Checkpointer(one_rank, 1, 0))
    assert sorted(p.name for p in one_rank.glob("step_*")) == ["step_00004", "step_00005"]
