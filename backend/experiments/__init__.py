"""Experiments: one module per experiment under this folder, and the registry that finds them.

The module `backend/experiments/<group>/<name>.py` is the experiment `<group>.<name>`: it ends with
    EXPERIMENT = define(__name__, SettingsClass, "one-line summary", run_fn=...)  (or rank_fn=, combine=)
and nothing else needs editing; the registry imports every module in this package. What a group's experiments
share (settings, a check one runs through another) is a module named with a leading underscore, defining no
experiment: `serving/_settings.py`. An experiment is a Config class, a one-line summary, and either
  run(config, ctx) -> Result                         (single process), or
  rank_fn(rank, world_size, config, ctx) -> payload  (one call per rank, on torch.distributed)
  combine(config, payloads) -> Result                (rank payloads, in rank order)
The distributed form is what lets the same code run from the job runner (ranks spawned here) and
from torchrun on a cluster (`python -m backend.launch`).
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib
import tempfile
import pkgutil
import sys
from pathlib import Path
from typing import Any, Callable, Mapping

from backend import limits
from backend.config import Config, ConfigError
from backend.result import Result, Schema
from backend.trace import DEFAULT_LANES

REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclasses.dataclass
class RunContext:
    """What a running experiment may use besides its config. Picklable, so ranks get a copy."""

    run_id: str | None = None
    store_root: str | None = None
    timeout_s: float = 120.0
    port: int | None = None
    device: str = "cpu"
    dist_backend: str = "gloo"
    echo_progress: bool = False
    attempt: int = 0                # 0, then 1, 2, ... each time the ranks were restarted after a rank failed
    scratch_dir: str | None = None  # an unrecorded distributed run's own folder (a recorded run has its run folder)

    def progress(self, fraction: float, message: str = "") -> None:
        fraction = max(0.0, min(1.0, float(fraction)))
        if self.run_id and self.store_root:
            from backend.store import RunStore

            RunStore(self.store_root).update(self.run_id, progress=fraction, progress_msg=message)
        if self.echo_progress:
            print(f"[{fraction:6.1%}] {message}", file=sys.stderr, flush=True)

    def partial(self, note: str, metrics: dict | None = None, tables: dict | None = None) -> None:
        """Record what the run has computed so far, so a run stopped by a limit or a fault still shows it.
        Call from one process only (rank 0 in a distributed run); each call replaces the last."""
        if self.run_id and self.store_root:
            from backend.store import RunStore

            RunStore(self.store_root).write_partial(self.run_id, {"note": note, "metrics": metrics or {},
                                                                  "tables": tables or {}})


@dataclasses.dataclass(frozen=True)
class Experiment:
    name: str
    config_cls: type[Config]
    summary: str
    run_fn: Callable[[Config, RunContext], Result] | None = None
    rank_fn: Callable[[int, int, Config, RunContext], Any] | None = None
    combine: Callable[[Config, list[Any]], Result] | None = None
    lanes: tuple[str, ...] = DEFAULT_LANES
    preload: tuple[str, ...] = ()  # modules every rank imports: the fork server imports them once for all ranks
    schema: Schema | None = None   # its result's declared keys and version (None: not declared yet, read as stored)

    @property
    def distributed(self) -> bool:
        return self.rank_fn is not None

    def validate(self, config: Config) -> Config:
        """Settings are accepted when their fields and rules hold (Config.validate) and the run is predicted
        within the server's budget (backend.limits.check_budget); else one ConfigError naming the field."""
        config.validate()
        limits.check_budget(config)
        return config

    def make_config(self, values: Mapping[str, Any] | None = None) -> Config:
        """Settings from strings (CLI, URL) or JSON values, validated as any run's are."""
        return self.validate(self.config_cls.from_dict(values or {}))

    def run(self, config: Config, ctx: RunContext | None = None) -> Result:
        ctx = ctx or RunContext()
        self.validate(config)
        if self.distributed:
            from backend.comm.spawn import spawn_ranks

            with tempfile.TemporaryDirectory(prefix="explorer-run-") as scratch:
                if not (ctx.run_id and ctx.store_root):
                    ctx = dataclasses.replace(ctx, scratch_dir=scratch)
                payloads = spawn_ranks(self.rank_fn, config.world_size, config, ctx, self.preload,
                                       restarts=getattr(config, "max_restarts", 0))
                return self._stamped(self.combine(config, payloads))
        return self._stamped(self.run_fn(config, ctx))

    def _stamped(self, result: Result) -> Result:
        return self.schema.stamp(result, self.name) if self.schema else result

    def open_result(self, stored: dict | None) -> dict | None:
        """A stored result.json as pages read it: upgraded to the schema's version, its keys checked (Schema.open);
        as stored for an experiment that declares no schema yet."""
        if stored is None or self.schema is None:
            return stored
        return self.schema.open(stored, self.name)


_REGISTRY: dict[str, Experiment] = {}

# Names experiments had before they were renamed -> the name each has now. The CLI, links and stored runs keep
# using old names; get() and canonical() read them as the new ones. Never delete a row: stored runs outlive renames.
ALIASES: dict[str, str] = {
    "collectives.run": "comm.collectives",
    "kernels.gemm": "hardware.gemm",
    "memory.decode": "hardware.decode",
    "memory.roofline": "hardware.roofline",
    "moe.routing": "models.moe_routing",
    "pipeline.run": "parallel.pipeline",
}


def define(module_name: str, config_cls: type[Config], summary: str, **kind) -> Experiment:
    """The experiment a module defines; its name is the module's path below this package."""
    prefix = __name__ + "."
    if not module_name.startswith(prefix):
        raise ValueError(f"experiments live under {__name__}/ (got {module_name})")
    exp = Experiment(name=module_name[len(prefix):], config_cls=config_cls, summary=summary, **kind)
    if not (exp.run_fn or (exp.rank_fn and exp.combine)):
        raise ValueError(f"experiment {exp.name!r} needs run_fn, or rank_fn and combine")
    return exp


@functools.cache
def _load_all() -> None:
    for info in pkgutil.walk_packages(__path__, prefix=__name__ + "."):
        module = importlib.import_module(info.name)
        exp = getattr(module, "EXPERIMENT", None)
        if isinstance(exp, Experiment):
            _REGISTRY[exp.name] = exp
        elif not (info.ispkg or helper(info.name)):
            raise ValueError(f"{info.name} defines no EXPERIMENT = define(__name__, ...)")
    check_aliases()


def helper(module_name: str) -> bool:
    """A module named with a leading underscore (`serving/_settings.py`) is a part its group's experiments share: the
    one kind of module here that defines no experiment."""
    return module_name.rsplit(".", 1)[-1].startswith("_")


def check_aliases() -> None:
    """Every old name leads, without a circle, to a registered experiment, and no old name is a registered one."""
    for old in ALIASES:
        if old in _REGISTRY:
            raise ValueError(f"the old name {old!r} is also a registered experiment")
        if canonical(old) not in _REGISTRY:
            raise ValueError(f"the old name {old!r} leads to {canonical(old)!r}, which is not an experiment")


def all_experiments() -> list[Experiment]:
    _load_all()
    return sorted(_REGISTRY.values(), key=lambda e: e.name)


def every_preload() -> tuple[str, ...]:
    """Every experiment's `preload`: what the ranks' fork server imports in a process that leads runs of any
    experiment (the server's standby leader, a test worker), so that no rank imports them itself."""
    return tuple(sorted({m for e in all_experiments() for m in e.preload}))


def canonical(name: str) -> str:
    """The name an experiment has now, for a name it has or had (an unknown name is returned as it is)."""
    seen = {name}
    while name in ALIASES:
        name = ALIASES[name]
        if name in seen:
            raise ValueError(f"the alias table runs in a circle through {name!r}")
        seen.add(name)
    return name


def spellings(name: str) -> tuple[str, ...]:
    """Every name under which runs of this experiment may be stored: its name now, then its old names."""
    now = canonical(name)
    return (now, *sorted(old for old in ALIASES if canonical(old) == now))


def get(name: str) -> Experiment:
    """The experiment by its name, or by a name it had (ALIASES)."""
    _load_all()
    now = canonical(name)
    if now not in _REGISTRY:
        raise ConfigError("experiment", f"unknown experiment {name!r}; allowed: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[now]


def open_result(name: str, stored: dict | None) -> dict | None:
    """A stored run's result as it is read (Experiment.open_result), by the experiment's name now or an old one; as
    stored when no experiment of that name is registered any more."""
    _load_all()
    exp = _REGISTRY.get(canonical(name))
    return exp.open_result(stored) if exp else stored


def run(name: str, **settings) -> Result:
    """Python API: run an experiment in this process, unrecorded. Raises ConfigError on bad input."""
    exp = get(name)
    return exp.run(exp.make_config(settings), RunContext())


@functools.cache
def code_version() -> str:
    """A digest of the backend and kernel sources: runs of different code are never deduplicated."""
    h = hashlib.sha256()
    for folder in ("backend", "kernels"):
        for path in sorted((REPO_ROOT / folder).rglob("*.py")):
            h.update(str(path.relative_to(REPO_ROOT)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()[:12]
