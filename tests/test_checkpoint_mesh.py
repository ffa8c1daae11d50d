"""Checkpoints of the composed mesh run (backend/parallel/mesh_train.py through mesh_state.MeshHook): a tp 2 x pp 2
plan saves every 2 steps, rank 1 is killed by SIGKILL in step 2, the spawner restarts all four ranks, they resume
from step 2 and end bit for bit equal to the uninterrupted run. A tp 2 x pp 2 checkpoint continued on tp 1 x pp 4 and
tp 2 x pp 1 (and back) equals one process; another model's is refused by name."""
import functools

import numpy as np
import pytest

from backend import experiments
from backend.comm.spawn import spawn_ranks
from backend.experiments import RunContext
from backend.checkpoint import checkpointer as ckpt
from backend.checkpoint import mesh_state
from backend.checkpoint.mesh_state import MeshHook, reference_shapes
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
    hook = MeshHook(ckpt.Checkpointer(root, 2, rank, attempt=ctx.attempt), fault, reference_shapes(config))
    out = train_rank(rank, world, config, None, hook)
    return {"params": out["params"], "losses": out["losses"], "attempt": ctx.attempt,
            "resumed_from": hook.saver.resumed_from, "timeline": ckpt.read_timeline(root)}


def _resumed_without_adam_step(rank, world, config, ctx):
    """The rule broken: Adam's step count is not restored with m and v (bias correction restarts)."""
    mesh_state.MeshState.load_checkpoint_state = lambda self, state: None
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


def _plain_with_checkpoints(rank, world, config, ctx):
    from backend.parallel.mesh_train import train_rank

    hook = MeshHook(ckpt.Checkpointer(ckpt.folder(ctx), 2, rank), None, reference_shapes(config))
    train_rank(rank, world, config, None, hook)
    return {}


def _resumed_rank(source, rank, world, config, ctx):
    """Continue `source` (a checkpoint saved on any mesh) on this config's mesh, saving every step: the weights,
    losses and DCP's reads."""
    from backend.parallel.mesh_train import train_rank

    hook = MeshHook(ckpt.Checkpointer(ckpt.folder(ctx), 1, rank, source=source), None, reference_shapes(config))
    out = train_rank(rank, world, config, None, hook)
    return {**{k: out[k] for k in ("params", "sources", "losses", "last_stage")}, "reads": hook.saver.reads,
            "held": hook.saver.held_bytes}


def _resumed_from(source):
    return functools.partial(_resumed_rank, source)


def _against_one_process(config, payloads) -> tuple[float, float]:
    """Largest |difference| of the weights (each rank's cut of the reference) and of the losses, against one float64
    process trained on the whole batch for all the steps (_reference.reference_training: torch.optim.Adam)."""
    from backend.experiments.parallel._reference import reference_training
    from backend.parallel.tp import cut

    ref = reference_training(config)
    param_err = max(float(np.abs(v - cut(ref["state"], p["sources"])[k].numpy()).max())
                    for p in payloads for k, v in p["params"].items())
    last = next(p for p in payloads if p["last_stage"])
    return param_err, max(abs(a - b) for a, b in zip(last["losses"], ref["losses"]))


@pytest.fixture(scope="module")
def saved_tp2xpp2(tmp_path_factory):
    """tp 2 x pp 2 trained 4 steps with a checkpoint every 2; step_00002 is continued on other meshes below."""
    root = tmp_path_factory.mktemp("tp2xpp2")
    spawn_ranks(_plain_with_checkpoints, 4, _config(dp_strategy="allreduce"), RunContext(scratch_dir=str(root), timeout_s=240))
    return root / ckpt.CHECKPOINTS


@pytest.mark.parametrize("mesh", [dict(tp="1", pp="4"), dict(tp="2", pp="1", dp_strategy="zero3")],
                         ids=["tp1xpp4", "tp2xpp1xdp2-zero3"])
def test_a_tp2xpp2_checkpoint_continues_on_another_mesh_equal_to_one_process(tmp_path, saved_tp2xpp2, mesh):
    """DCP plans each new rank's reads from the pieces' global offsets: the continued run (2 more steps) equals one
    process within 1e-9, and each new rank's reads add up to the bytes it holds. Then back: the new mesh's own
    checkpoint after step 3 is continued on tp 2 x pp 2 for the last step."""
    config = _config(**{"dp_strategy": "allreduce", **mesh})
    out = spawn_ranks(_resumed_from(saved_tp2xpp2 / "step_00002"), 4, config,
                      RunContext(scratch_dir=str(tmp_path / "new"), timeout_s=240))
    param_err, loss_err = _against_one_process(config, out)
    assert param_err < 1e-9 and loss_err < 1e-9
    assert all(sum(r["bytes"] for r in p["reads"]) == p["held"] for p in out)
    assert {r["saved rank"] for p in out for r in p["reads"]} == {0, 1, 2, 3}  # every saved rank's file is read
    back = _config(dp_strategy="allreduce")
    out = spawn_ranks(_resumed_from(tmp_path / "new" / ckpt.CHECKPOINTS / "step_00003"), 4, back,
                      RunContext(scratch_dir=str(tmp_path / "back"), timeout_s=240))
    assert max(_against_one_process(back, out)) < 1e-9


def _wrong_offsets_rank(source, rank, world, config, ctx):
    """The rule broken: each tp shard read at the other shard's offsets (a mesh position instead of its own rows)."""
    right = mesh_state.source_pieces

    def wrong(p, shapes):
        return [(ref, dim, start if dim is None else (start + length) % shapes[ref][dim], here, length)
                for ref, dim, start, here, length in right(p, shapes)]
    mesh_state.source_pieces = wrong
    return _resumed_rank(source, rank, world, config, ctx)


def test_the_continuation_differs_when_shards_are_read_at_the_wrong_offsets(tmp_path, saved_tp2xpp2):
    config = _config(dp_strategy="allreduce", tp="2", pp="1")
    out = spawn_ranks(functools.partial(_wrong_offsets_rank, saved_tp2xpp2 / "step_00002"), 4, config,
                      RunContext(scratch_dir=str(tmp_path), timeout_s=240))
    assert _against_one_process(config, out)[0] > 1e-3


def test_a_checkpoint_of_another_model_is_refused_by_name(tmp_path, saved_tp2xpp2):
    """The same mesh, a wider feed-forward: the load names the tensor and both shapes."""
    with pytest.raises(Exception, match=r"checkpoint step_00002 is from another model: model\.blocks\.\d+\.ffn\.\w+\.weight "
                                        r"has shape \[64, 32\] there, \[\d+, 32\] here"):
        spawn_ranks(_resumed_from(saved_tp2xpp2 / "step_00002"), 4, _config(dp_strategy="allreduce", d_ff="96"),
                    RunContext(scratch_dir=str(tmp_path), timeout_s=240))
