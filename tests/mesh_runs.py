"""Mesh plans run for a test module: every plan on one set of spawned ranks (one start-up for all of them), each plan
under an optional broken rule patched inside the ranks only, and a run's checks read by name. The check side
(mesh.combine, in the test's process) always keeps the real rules, so a broken rule shows as a failed check."""
import contextlib
import multiprocessing
from typing import Callable

from backend.comm.spawn import spawn_ranks
from backend.experiments import RunContext
from backend.experiments.parallel import mesh

Patch = Callable[[str], contextlib.AbstractContextManager]  # a broken rule's name -> the patch applying it


def _rank(rank, world, job, ctx):
    plans, patch = job
    out = []
    for cfg, broken in plans:
        with patch(broken) if patch is not None else contextlib.nullcontext():
            out.append(mesh.run_rank(rank, world, cfg, ctx))
    return out


def run_plans(plans: list, world: int = 4, patch: Patch | None = None, timeout_s: float = 900) -> list[list[dict]]:
    """Each plan's payloads in rank order, in the plans' order. A plan is a MeshConfig or (MeshConfig, broken),
    `broken` the name `patch` turns into the rule broken in the ranks (`patch` a module-level function: it travels
    to the ranks by name). Every rank process has ended when this returns."""
    pairs = [p if isinstance(p, tuple) else (p, None) for p in plans]
    pairs = [(cfg.validate(), broken) for cfg, broken in pairs]
    per_rank = spawn_ranks(_rank, world, (pairs, patch), RunContext(timeout_s=timeout_s))
    assert multiprocessing.active_children() == []
    return [[per_rank[r][i] for r in range(world)] for i in range(len(pairs))]


def checks(cfg, payloads) -> dict:
    """The run's checks by name, as the experiment's combine makes them."""
    return {c.name: c for c in mesh.combine(cfg, payloads).checks}


def failures(result) -> list[tuple[str, float]]:
    """(name, error) of every check of a Result that did not pass: the message of a test requiring all to pass."""
    return [(c.name, c.error) for c in result.checks if not c.passed]
