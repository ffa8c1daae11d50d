"""Checkpoints of the composed mesh run (backend/parallel/mesh_train.py through checkpoint.MeshHook): a tp 2 x pp 2
plan saves every 2 steps, rank 1 is killed by SIGKILL in step 2, the spawner restarts all four ranks, they resume
from step 2 and end bit for bit equal to the uninterrupted run."""
import numpy as np
import pytest

from backend import experiments
from backend.comm.spawn import spawn_ranks
from backend.experiments import RunContext
from backend.parallel import checkpoint as ckpt
from backend.store import pid_alive

KILLED_RANK, KILLED_STEP = 1, 2


def _config(**change):
    return experiments.get("parallel.mesh").make_config({"world_size": "4", "tp": "2", "pp": "2", "steps": "4", **change})


def _plain_rank(rank, world, config, ctx):
    from backend.parallel.mesh_train import train_rank

    out = train_rank(rank, world, config)
    return {"params": out["params"], "losses": out["losses"]}


def _killed_and_resumed_rank(rank, world, config, ctx):
    from backend.parallel.mesh_train import train_rank

    root = ckpt.folder(ctx)

    def fault(step):
        if ctx.attempt == 0 and rank == KILLED_RANK and step == KILLED_STEP:
            ckpt.kill_self(root, rank, step)
    hook = ckpt.MeshHook(ckpt.Checkpointer(root, 2, rank, attempt=ctx.attempt), fault, ckpt.reference_shapes(config))
    out = train_rank(rank, world, config, None, hook)
    return {"params": out["params"], "losses": out["losses"], "attempt": ctx.attempt,
            "resumed_from": hook.saver.resumed_from, "timeline": ckpt.read_timeline(root)}


def _resumed_without_adam_step(rank, world, config, ctx):
    """The rule broken: Adam's step count is not restored with m and v (bias correction restarts)."""
    ckpt.MeshState.load_checkpoint_state = lambda self, state: None
    return _killed_and_resumed_rank(rank, world, config, ctx)


def _bitwise(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k].view(np.uint64), b[k].view(np.uint64)) for k in a)


@pytest.mark.parametrize("plan", [dict(tp="2", pp="2", dp_strategy="allreduce"), dict(tp="1", pp="2", dp_strategy="zero1")],
                         ids=["tp2xpp2", "pp2xdp2-zero1"])
def test_mesh_plan_killed_and_resumed_bit_for_bit(tmp_path, plan):
    """tp 2 x pp 2; and pp 2 x dp 2 with ZeRO-1 (Adam's states sharded over dp, the weights gathered after the load)."""
    world, config = 4, _config(**plan)
    plain = spawn_ranks(_plain_rank, world, config, RunContext(timeout_s=240))
    resumed = spawn_ranks(_killed_and_resumed_rank, world, config, RunContext(scratch_dir=str(tmp_path), timeout_s=240),
                          restarts=1)
    assert all(r["attempt"] == 1 and r["resumed_from"] == "step_00002" for r in resumed)
    assert all(_bitwise(p["params"], r["params"]) for p, r in zip(plain, resumed))
    assert [p["losses"] for p in plain] == [r["losses"] for r in resumed]
    kill = [e for e in resumed[0]["timeline"] if e["event"] == "kill"]
    assert kill and kill[0]["rank"] == KILLED_RANK and not pid_alive(kill[0]["pid"])


def test_the_resume_differs_when_adams_step_is_not_restored(tmp_path):
    config = _config(dp_strategy="allreduce")
    plain = spawn_ranks(_plain_rank, 4, config, RunContext(timeout_s=240))
    broken = spawn_ranks(_resumed_without_adam_step, 4, config, RunContext(scratch_dir=str(tmp_path), timeout_s=240),
                         restarts=1)
    assert not all(_bitwise(p["params"], r["params"]) for p, r in zip(plain, broken))


def test_a_checkpoint_of_another_mesh_is_refused_by_name(tmp_path):
    """Saved by tp 2 x pp 2, loaded by pp 4: a rank's keys are not there (pp3...) or hold another shape (pp0.tp0:
    fewer layers), and the load says so by name."""
    spawn_ranks(_plain_with_checkpoints, 4, _config(dp_strategy="allreduce"), RunContext(scratch_dir=str(tmp_path), timeout_s=240))
    with pytest.raises(Exception, match=r"checkpoint step_00004 is from another model"):
        spawn_ranks(_plain_with_checkpoints, 4, _config(dp_strategy="allreduce", tp="1", pp="4"),
                    RunContext(scratch_dir=str(tmp_path), timeout_s=240))


def _plain_with_checkpoints(rank, world, config, ctx):
    from backend.parallel.mesh_train import train_rank

    hook = ckpt.MeshHook(ckpt.Checkpointer(ckpt.folder(ctx), 2, rank), None, ckpt.reference_shapes(config))
    train_rank(rank, world, config, None, hook)
    return {}
