"""Headless CLI.

    python -m backend list
    python -m backend run NAME [--set key=value ...] [--trace-file CSV] [--out DIR] [--json] [--timeout S]
    python -m backend show RUN_ID [--json]
    python -m backend standby MODULE...   (the job runner's warm leader: backend.jobs.Standby)

Exit status: 0 ran and every check passed; 1 the run failed or a check did not pass;
2 bad input (one line on stderr naming the field and the allowed range); 128+N stopped by signal N
(the run is recorded as cancelled first).

The process running `run` is the run's leader (backend.jobs.Leader): it heartbeats into the store,
obeys a cancel flag set from any process, and holds the run to the server's time and memory limits.
"""
from __future__ import annotations

import argparse
import getpass
import json
import os
import sys
from pathlib import Path

from backend.config import ConfigError


def parse_sets(pairs: list[str]) -> dict[str, str]:
    values = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ConfigError("--set", f"{pair!r} is not key=value")
        values[key.strip()] = value
    return values


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m backend", description="LLM Systems Explorer, headless.")
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="every experiment with its summary")
    run = sub.add_parser("run", help="run an experiment")
    run.add_argument("name")
    run.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    run.add_argument("--trace-file", type=Path, help="a local CSV for the `trace` setting (checked with the server's "
                                                       "caps, stored in the run store under its content hash)")
    run.add_argument("--out", type=Path, help="folder for result.json and trace.json (default: the run store)")
    run.add_argument("--json", action="store_true", help="print one JSON object")
    run.add_argument("--timeout", type=float, help="seconds (default and most: EXPLORER_JOB_TIMEOUT_S, 120)")
    run.add_argument("--run-id", help=argparse.SUPPRESS)  # set by the job runner for a queued run
    run.add_argument("--config-json", help=argparse.SUPPRESS)
    show = sub.add_parser("show", help="a stored run")
    show.add_argument("run_id")
    show.add_argument("--json", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["standby"]:  # a job runner's warm leader (backend.jobs.Standby), not a user's command
        return standby_main(argv[1:])
    args = _parser().parse_args(argv)
    from backend import experiments
    from backend.store import RunStore

    if args.command == "list":
        for exp in experiments.all_experiments():
            print(f"{exp.name:24s} {exp.summary}")
        for old, now in sorted(experiments.ALIASES.items()):
            print(f"{old:24s} old name of {now}")
        return 0

    store = RunStore()
    if args.command == "show":
        rec = store.get(args.run_id)
        if rec is None:
            print(f"error: run_id: no run {args.run_id!r} in {store.path}", file=sys.stderr)
            return 2
        body = {"run_id": rec.id, "experiment": rec.experiment, "status": rec.status, "config": rec.config,
                "error": rec.error, "duration_s": rec.duration_s, "artifacts": {"result": rec.result_path, "trace": rec.trace_path}}
        result = experiments.open_result(rec.experiment, rec.result())  # upgraded to its schema's version
        if result:
            body.update(metrics=result["metrics"], checks=result["checks"])
        print(json.dumps(body, indent=None if args.json else 1, default=str))
        return 0

    from backend import limits

    try:
        args.timeout = limits.check_timeout(args.timeout)
        exp = experiments.get(args.name)
        values = json.loads(args.config_json) if args.config_json else parse_sets(args.sets)
        if args.trace_file:
            values["trace"] = _upload(args.trace_file, store.root)
        config = exp.make_config(values)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        if args.run_id:
            store.finish(args.run_id, "failed", error=str(err))
        return 2

    from backend import record
    from backend.comm.spawn import free_port
    from backend.jobs import DIAGNOSIS_GRACE_S, Leader

    port = int(os.environ["EXPLORER_PORT"]) if os.environ.get("EXPLORER_PORT") else free_port()
    if args.run_id:  # queued by a job runner, which claimed it
        run_id = args.run_id
        store.update(run_id, pid=os.getpid(), port=port)
    else:
        run_id = store.create(
            exp.name, config.to_dict(), config.digest(exp.name, experiments.code_version()), status="running",
            timeout_s=args.timeout, code_version=experiments.code_version(), origin="cli",
            owner=os.environ.get("EXPLORER_USER") or getpass.getuser(), pid=os.getpid())
        store.update(run_id, port=port)
    leader = Leader(store, run_id, args.timeout, limits.memory_budget(), store.run_dir(run_id) / "log.txt",
                    grace_s=DIAGNOSIS_GRACE_S if exp.distributed else 0, config=config).start()
    ctx = experiments.RunContext(run_id=run_id, store_root=str(store.root), timeout_s=args.timeout, port=port,
                                 echo_progress=not args.json)
    report = record.run_recorded(exp, config, ctx, store, run_id, args.out)
    leader.stop()
    if report["status"] == "failed" and limits.is_out_of_memory(report["error"]):
        report["error"] = limits.memory_message(config=config)
        store.update(run_id, error=report["error"])
    if args.json:
        print(json.dumps(report, default=str))
    else:
        _print_human(report)
    return 0 if report["status"] == "succeeded" and report.get("passed") else 1


def standby_main(preload: list[str]) -> int:
    """The standby process (see backend.jobs.Standby): a run's leader, warm before its run; `preload`: every experiment's modules for the ranks' fork server."""
    from backend import experiments, limits
    from backend.comm.spawn import output_to, start_fork_server

    limits.limit_this_process(limits.memory_budget())  # before the fork server starts: its ranks inherit the cap
    start_fork_server(tuple(preload))
    experiments.all_experiments()
    line = sys.stdin.readline()
    if not line:  # the runner closed: no run for this one
        return 0
    job = json.loads(line)
    output_to(job["log"])
    os.environ.clear()
    os.environ.update(job["env"])
    return main(job["args"])


def _upload(path: Path, root: Path) -> str:
    from backend import uploads

    try:
        return uploads.save_trace(uploads.read_capped(path), root)
    except (OSError, ValueError) as err:
        raise ConfigError("trace", f"{path}: {err}") from None


def _print_human(report: dict) -> None:
    print(f"{report['experiment']}  run {report['run_id']}  {report['status']}")
    if report.get("error"):
        print(f"  error: {report['error']}")
    for k, v in report.get("metrics", {}).items():
        print(f"  {k:32s} {v}")
    for c in report.get("checks", []):
        mark = "PASS" if c["passed"] else "FAIL"
        print(f"  [{mark}] {c['name']}: error {c['error']:.3g} (tolerance {c['tolerance']:.3g})")
    for k, v in report.get("artifacts", {}).items():
        print(f"  {k}: {v}")


if __name__ == "__main__":
    sys.exit(main())
