"""Run a distributed experiment from torchrun's environment (one process per rank, any number of nodes):

    torchrun --nproc-per-node 4 -m backend.launch comm.bandwidth --set max_bytes=1048576
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-endpoint HOST:PORT -m backend.launch comm.bandwidth --backend nccl

torchrun supplies RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT; world_size is taken
from it. Every rank runs the experiment's rank function; rank 0 gathers the payloads, combines
them, writes result.json and trace.json (--out, else the run store) and records the run in the
store, so the explorer shows it like any other (origin "torchrun").

Rank 0 is the run's leader (backend.jobs.Leader: heartbeat, cancel flag, time and memory limits,
a final state on SIGINT/SIGTERM). Every rank runs under the per-process memory limit; a rank that
raises appends its whole traceback to the run's log.txt (when the store is on its machine), and at
the time limit every rank dumps its Python stack (faulthandler) before it ends.
"""
from __future__ import annotations

import argparse
import faulthandler
import getpass
import json
import os
import sys
import time
import traceback
from pathlib import Path

from backend.config import ConfigError


def main(argv: list[str] | None = None) -> int:
    args = _arguments(argv)
    from backend.store import RunStore

    if "RANK" not in os.environ:
        print("error: RANK: not set; start this module with torchrun", file=sys.stderr)
        return 2
    rank, world, local_rank = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0))
    try:
        exp, config = _experiment(args, world)
    except ConfigError as err:
        if rank == 0:
            print(f"error: {err}", file=sys.stderr)
        return 2
    device, attempt = _join_group(args, rank, world, local_rank)
    store = RunStore()
    run_id, leader = _lead(store, exp, config, args, rank, attempt)
    gathered, ctx = _run_rank(exp, config, args, store, run_id, leader, rank, world, device, attempt)
    if rank != 0:
        return 0
    return _report(exp, config, ctx, store, run_id, leader, gathered, args)


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m backend.launch")
    p.add_argument("name")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--out", type=Path)
    p.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    p.add_argument("--timeout", type=float, help="seconds (default and most: EXPLORER_JOB_TIMEOUT_S, 120)")
    p.add_argument("--json", action="store_true")
    return p.parse_args(argv)


def _experiment(args: argparse.Namespace, world: int):
    """The experiment and its Config from the command line, world_size from torchrun; ConfigError on bad input.
    Sets args.timeout to the checked limit."""
    from backend import experiments, limits
    from backend.__main__ import parse_sets

    args.timeout = limits.check_timeout(args.timeout)
    exp = experiments.get(args.name)
    if not exp.distributed:
        raise ConfigError("experiment", f"{exp.name} is single-process; run it with python -m backend run")
    return exp, exp.make_config({**parse_sets(args.sets), "world_size": str(world)})


def _join_group(args: argparse.Namespace, rank: int, world: int, local_rank: int) -> tuple[str, int]:
    """This rank's device and torch.distributed's process group from torchrun's rendezvous; returns the device and
    torchrun's restart attempt."""
    import datetime

    import torch
    import torch.distributed as dist

    device = "cpu"
    if args.backend == "nccl":
        torch.cuda.set_device(local_rank)
        device = f"cuda:{local_rank}"
    if device == "cpu":
        torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=args.timeout)
    rendezvous, _, _ = next(dist.rendezvous("env://", rank, world, timeout=timeout))
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))  # torchrun --max-restarts: the group's restarts
    # torchrun keeps its store across restarts: the first attempt's gloo addresses are still in it, so a restarted
    # group would dial dead ranks. Each attempt's keys get their own prefix.
    dist.init_process_group(args.backend, store=dist.PrefixStore(f"explorer/attempt_{attempt}", rendezvous),
                            rank=rank, world_size=world, timeout=timeout)
    return device, attempt


def _lead(store, exp, config, args: argparse.Namespace, rank: int, attempt: int):
    """Rank 0 records the run (or finds the one a restarted job was running) and starts its Leader; the other ranks
    take the memory limit and dump their stacks at the time limit. Returns (run id, leader), both None off rank 0."""
    from backend import experiments, limits
    from backend.jobs import Leader

    if rank != 0:
        limits.limit_this_process(limits.memory_budget())
        faulthandler.dump_traceback_later(args.timeout + 2, exit=True)  # rank 0's leader records the failure
        return None, None
    run_id = _restarted_run(store, attempt)
    if run_id is None:
        version = experiments.code_version()
        run_id = store.create(exp.name, config.to_dict(), config.digest(exp.name, version), status="running",
                              timeout_s=args.timeout, code_version=version, origin="torchrun",
                              owner=os.environ.get("EXPLORER_USER") or getpass.getuser(), pid=os.getpid())
        _remember_run(store, run_id)
    leader = Leader(store, run_id, args.timeout, limits.memory_budget(), store.run_dir(run_id) / "log.txt",
                    config=config).start()
    return run_id, leader


def _run_rank(exp, config, args: argparse.Namespace, store, run_id, leader, rank: int, world: int, device: str,
              attempt: int):
    """The experiment's rank function on this rank, its payloads gathered on rank 0; a rank that raises logs its
    traceback (rank 0 records the run failed). Returns the payloads (None off rank 0) and the run's context."""
    import torch.distributed as dist

    from backend import experiments, limits
    from backend.comm.spawn import append_log

    shared = [run_id]
    dist.broadcast_object_list(shared, src=0)
    ctx = experiments.RunContext(run_id=shared[0], store_root=str(store.root), timeout_s=args.timeout, device=device,
                                 dist_backend=args.backend, attempt=attempt)
    try:
        payload = exp.rank_fn(rank, world, config, ctx)
        gathered = [None] * world if rank == 0 else None
        dist.gather_object(payload, gathered, dst=0)
    except Exception as err:
        append_log(ctx, f"--- rank {rank} failed ---\n{traceback.format_exc()}")
        if rank == 0:
            leader.stop()
            message = limits.memory_message(config=config) if limits.is_out_of_memory(str(err)) else f"rank 0: {type(err).__name__}: {err}"
            store.finish(run_id, "failed", error=message)
        raise
    finally:
        faulthandler.cancel_dump_traceback_later()
        dist.destroy_process_group()
    return gathered, ctx


def _report(exp, config, ctx, store, run_id: str, leader, gathered: list, args: argparse.Namespace) -> int:
    """Rank 0: combine the payloads, write and record the result; exit status 0 only if every check passed."""
    from backend import experiments, record

    report_exp = experiments.Experiment(exp.name, exp.config_cls, exp.summary,
                                        run_fn=lambda c, _ctx: exp.combine(c, gathered), lanes=exp.lanes,
                                        schema=exp.schema)
    report = record.run_recorded(report_exp, config, ctx, store, run_id, args.out)
    leader.stop()
    print(json.dumps(report, default=str) if args.json else f"{exp.name} run {run_id} {report['status']}: {report.get('artifacts')}")
    return 0 if report["status"] == "succeeded" and report.get("passed") else 1


def _pointer(store) -> Path | None:
    """Where rank 0 notes its run's id for a restart of the same torchrun job (TORCHELASTIC_RUN_ID names the job)."""
    job = os.environ.get("TORCHELASTIC_RUN_ID", "")
    return store.root / "torchrun" / f"{job}.run" if job.replace("-", "").isalnum() else None


def _remember_run(store, run_id: str) -> None:
    if (path := _pointer(store)) is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(run_id)


def _restarted_run(store, attempt: int) -> str | None:
    """After torchrun restarted the group (attempt > 0): the same run, open again, so the restarted ranks find its
    checkpoints in its own folder. The first attempt's rank 0 recorded it cancelled when torchrun stopped it."""
    from backend.store import is_run_id

    path = _pointer(store)
    if attempt == 0 or path is None or not path.is_file() or path.is_symlink():
        return None
    run_id = path.read_text().strip()
    if not is_run_id(run_id) or store.get(run_id) is None:
        return None
    store.update(run_id, status="running", error=None, finished=None, pid=os.getpid(), heartbeat=time.time())
    return run_id


def _exit(code: int) -> None:
    """End this rank without Python's teardown, as spawn's ranks do: gloo's worker threads release the last work's
    tensors after it completes, and a release that needs the GIL while the interpreter tears down ends the thread
    inside a C++ destructor (std::terminate: SIGABRT)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    try:
        _exit(main())
    except SystemExit as stop:
        _exit(0 if stop.code is None else stop.code if isinstance(stop.code, int) else 1)
    except BaseException:
        traceback.print_exc()
        _exit(1)
