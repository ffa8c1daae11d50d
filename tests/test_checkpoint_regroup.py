"""The regroup of a run's ranks onto fewer and back (mesh_run.regroup, parallel.checkpoint's continuation on fewer
ranks): rank 1 idle while rank 0 works alone for longer than the new group's timeout, as a continued training does on
a loaded machine. The idle rank must wait on the store, not in gloo's rendezvous; with that wait taken out (the old
regroup) the rendezvous times out and the run fails."""
import multiprocessing
import time
from pathlib import Path

import pytest

from backend.checkpoint import mesh_run
from backend.comm.spawn import RankFailed, spawn_ranks
from backend.experiments import RunContext

TIMEOUT_S = 2.0  # the regrouped groups' timeout, made small
LATE_S = 3 * TIMEOUT_S  # rank 0's work alone, longer than that timeout


def _shrink_work_grow(rank, world, late_s, ctx):
    """Both ranks as one group, rank 0 alone for late_s, both again; then an all-reduce over the whole group."""
    import torch
    import torch.distributed as dist

    root = Path(ctx.scratch_dir)
    mesh_run.regroup(rank, world, 1, root / "new.store", TIMEOUT_S, wait_s=60)
    if rank == 0:
        time.sleep(late_s)
    mesh_run.regroup(rank, 1, world, root / "all.store", TIMEOUT_S, wait_s=60)
    total = torch.tensor([rank + 1.0])
    dist.all_reduce(total)
    return {"sum": total.item(), "world": dist.get_world_size()}


def _idle_rank_joins_at_once(rank, world, late_s, ctx):
    """The rule broken: the idle rank enters gloo's rendezvous without waiting for the old group (the old regroup).
    One rendezvous trial: a retry (join's TRIES, tested below) can outlast rank 0's sleep on a loaded machine and
    hide the missing wait, as it did once in the suite."""
    mesh_run.wait_for_old_group = lambda store, wait_s: None
    mesh_run.TRIES = 1
    return _shrink_work_grow(rank, world, late_s, ctx)


def test_an_idle_rank_joins_a_late_peer_after_more_than_the_groups_timeout(tmp_path):
    started = time.monotonic()
    out = spawn_ranks(_shrink_work_grow, 2, LATE_S, RunContext(scratch_dir=str(tmp_path), timeout_s=120))
    assert out == [{"sum": 3.0, "world": 2}] * 2
    assert time.monotonic() - started > LATE_S
    assert multiprocessing.active_children() == []


def test_the_regroup_fails_when_the_idle_rank_enters_the_rendezvous_at_once(tmp_path):
    with pytest.raises(RankFailed, match="(?i)timeout|connectFullMesh"):
        spawn_ranks(_idle_rank_joins_at_once, 2, LATE_S, RunContext(scratch_dir=str(tmp_path), timeout_s=120))
    assert multiprocessing.active_children() == []


def _first_rendezvous_broken(rank, world, tries, ctx):
    """Rank 1's first group is formed and at once closed, as when a peer's connection drops in gloo's rendezvous
    ("connectFullMesh failed: Connection closed by peer"); `tries`: the regroup's trials. Returns the all-reduce's sum
    and how many groups each rank formed."""
    import torch
    import torch.distributed as dist

    mesh_run.TRIES = tries
    real, inits = dist.init_process_group, []

    def init(*args, **kwargs):
        inits.append(1)
        real(*args, **kwargs)
        if rank == 1 and len(inits) == 1:
            dist.destroy_process_group()
            raise RuntimeError("injected: Connection closed by peer")

    dist.init_process_group = init
    root = Path(ctx.scratch_dir)
    mesh_run.regroup(rank, world, 1, root / "new.store", 30)
    mesh_run.regroup(rank, 1, world, root / "all.store", 30)
    total = torch.tensor([rank + 1.0])
    dist.all_reduce(total)
    return {"sum": total.item(), "inits": len(inits)}


def test_a_rendezvous_that_fails_on_one_rank_is_tried_again_by_all(tmp_path):
    out = spawn_ranks(_first_rendezvous_broken, 2, mesh_run.TRIES, RunContext(scratch_dir=str(tmp_path), timeout_s=120))
    # rank 0: its group of one, the broken trial, the one tried again; rank 1: the last two
    assert out == [{"sum": 3.0, "inits": 3}, {"sum": 3.0, "inits": 2}]
    assert multiprocessing.active_children() == []


def test_with_one_trial_the_broken_rendezvous_fails_the_regroup(tmp_path):
    with pytest.raises(RankFailed, match="regroup of 2 ranks: all 1 rendezvous trials failed"):
        spawn_ranks(_first_rendezvous_broken, 2, 1, RunContext(scratch_dir=str(tmp_path), timeout_s=120))
    assert multiprocessing.active_children() == []
