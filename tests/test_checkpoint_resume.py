"""A failed run resumed from its page (JobRunner.resume): a new run naming its parent in the store, whose ranks find
the parent's checkpoint folder from that record, finishing bit for bit equal to the uninterrupted run; what cannot be
resumed (a run that did not fail, no checkpoint, a corrupt or foreign one, a symlinked folder) is refused by name."""
import re
import shutil

import pytest

from backend.config import ConfigError
from backend.checkpoint import checkpointer as ckpt

# rank 1 killed in step 2 with no restart allowed: the run fails after saving step_00002
FAILING = dict(strategy="zero3", steps=4, every=2, kill_step=2, max_restarts=0, reshard_to="off")


def _failed(runner, **change):
    run_id = runner.submit("parallel.checkpoint", {**FAILING, **change}, owner="ana")
    rec = runner.wait(run_id, timeout_s=120)
    assert rec.status == "failed" and "rank 1" in rec.error, rec.error
    return rec


def test_a_failed_run_is_resumed_from_its_checkpoint_bit_for_bit(runner, store):
    parent = _failed(runner)
    child_id = runner.resume(parent.id, owner="ben")
    child = runner.wait(child_id, timeout_s=120)
    assert child.status == "succeeded", child.error
    assert child.parent == parent.id and child.owner == "ben" and child.config == parent.config
    result = child.result()
    assert all(c["passed"] for c in result["checks"]), [c for c in result["checks"] if not c["passed"]]
    bitwise = next(c for c in result["checks"] if c["name"] == "final parameters equal the uninterrupted run's bit for bit")
    assert bitwise["error"] == 0
    assert result["metrics"]["parent_run"] == parent.id and result["metrics"]["resumed_from_step"] == 2
    assert [e["event"] for e in result["tables"]["checkpoint_timeline"] if e["event"] in ("kill", "start")] == ["start", "kill", "start"]
    assert result["notes"][0].startswith(f"Run {parent.id} failed when rank 1 was killed by SIGKILL in step 2")
    assert runner.resume(parent.id, owner="ben") == child_id  # the same resume twice is one run
    assert runner.why_not_resumable(parent.id) is None  # what the page asks before it offers the button
    assert "only a failed run is resumed" in runner.why_not_resumable(child_id)


def test_what_cannot_be_resumed_is_refused_by_name(runner, store):
    with pytest.raises(ConfigError, match=r"parent: no run '\.\./x' in this store"):
        runner.resume("../x")
    ok = runner.wait(runner.submit("parallel.checkpoint", {**FAILING, "kill_rank": "-1"}), timeout_s=120)
    with pytest.raises(ConfigError, match=rf"run {ok.id} succeeded: only a failed run is resumed"):
        runner.resume(ok.id)
    early = _failed(runner, kill_step=0)  # killed before its first save
    with pytest.raises(ConfigError, match=rf"run {early.id} left no complete checkpoint"):
        runner.resume(early.id)

    parent = _failed(runner)
    folder = store.root / "runs" / parent.id / ckpt.CHECKPOINTS
    data = next((folder / "step_00002").glob("__1_*.distcp"))
    raw = bytearray(data.read_bytes())
    raw[-100] ^= 0x01
    data.write_bytes(bytes(raw))
    with pytest.raises(ConfigError, match=r"step_00002 is corrupt: file __1_0.distcp \(rank 1\) does not match its sha256"):
        runner.resume(parent.id)

    elsewhere = folder.parent / "elsewhere"  # the folder swapped for a symlink to another: never read
    folder.rename(elsewhere)
    folder.symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(ConfigError, match=rf"run {parent.id} left no complete checkpoint"):
        runner.resume(parent.id)


def test_a_foreign_checkpoint_in_the_parents_folder_fails_the_resumed_run_by_name(runner, store):
    """A complete checkpoint of another model put in the parent's folder passes the manifest, and the ranks refuse
    it by its shapes: the resumed run fails saying so."""
    parent, other = _failed(runner), _failed(runner, hidden=16)
    mine = store.root / "runs" / parent.id / ckpt.CHECKPOINTS / "step_00002"
    shutil.rmtree(mine)
    shutil.copytree(store.root / "runs" / other.id / ckpt.CHECKPOINTS / "step_00002", mine)
    child = runner.wait(runner.resume(parent.id), timeout_s=120)
    assert child.status == "failed" and re.search(r"step_00002 is from another model: model\.\S+ has shape \[(\d+, )?16\] there, "
                                                  r"\[(\d+, )?32\] here", child.error), child.error  # a matrix or a norm


def test_the_parent_folder_comes_from_the_store_and_must_be_a_run_of_the_same_experiment(store):
    """The ranks read the parent's id from their own record and build the folder from the store's root; a parent
    that is a run of another experiment is refused, and a run without a parent resumes nothing."""
    from backend.experiments import RunContext

    child = store.create("parallel.checkpoint", {}, "d1", status="running")
    ctx = RunContext(run_id=child, store_root=str(store.root))
    assert ckpt.parent_folder(ctx) is None
    same = store.create("parallel.checkpoint", {}, "d2", status="failed")
    store.update(child, parent=same)
    assert ckpt.parent_folder(ctx) == store.root / "runs" / same / ckpt.CHECKPOINTS
    other = store.create("comm.selftest", {}, "d3", status="failed")
    store.update(child, parent=other)
    with pytest.raises(ckpt.CheckpointError, match=rf"resumes {other}, which is not a run of parallel.checkpoint"):
        ckpt.parent_folder(ctx)
