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


@pytest.mark.parametrize("saved, loaded", [(("zero3", 4), ("zero1", 2)), (("fsdp", 4), ("fsdp", 2))])
def test_a_checkpoint_saved_on_4_ranks_resumes_on_2_equal_to_one_process(tmp_path, saved, loaded):
    """Resharding: the step-2 checkpoint of a 4-rank run (its step-4 one removed) loaded by 2 ranks of another
    strategy, which train steps 2 and 3: parameters and every loss equal one float64 process within 1e-9."""
    import shutil

    from backend.comm.spawn import spawn_ranks
    from backend.experiments import RunContext
    from backend.experiments.parallel.checkpoint import CheckpointConfig, resume_rank
    from backend.parallel.workload import reference_run

    ctx = RunContext(scratch_dir=str(tmp_path), timeout_s=180)
    first = CheckpointConfig(world_size=saved[1], strategy=saved[0], kill_rank=-1, **SMALL)
    spawn_ranks(resume_rank, saved[1], first, ctx, ("torch.distributed.fsdp", "torch.distributed.checkpoint"))
    shutil.rmtree(tmp_path / "checkpoints" / "step_00004")
    then = CheckpointConfig(world_size=loaded[1], strategy=loaded[0], kill_rank=-1, **SMALL)
    reports = spawn_ranks(resume_rank, loaded[1], then, ctx, ("torch.distributed.fsdp", "torch.distributed.checkpoint"))
    assert all(r.extra["resumed_from"] == "step_00002" for r in reports)
    ref = reference_run(then.workload)
    assert max(np.abs(r.params - ref["params"].numpy()).max() for r in reports) <= 1e-9
    assert max(abs(a - b) for a, b in zip(reports[0].losses, ref["losses"])) <= 1e-9


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
