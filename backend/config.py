"""Experiment settings: a dataclass per experiment whose fields carry their allowed ranges.

`validate()` runs on the server for every run, whatever the caller (CLI, Python API, page, URL),
so a widget's bounds are only a convenience. Every failure is one `ConfigError` naming the field
and what it allows.

Every Config also predicts its run's cost: `estimate()` gives peak memory (all processes) and wall
time from the settings, and validate() refuses a run predicted to pass the server's budget
(backend.limits: EXPLORER_RUN_MEMORY_GIB, EXPLORER_JOB_TIMEOUT_S), naming the setting that drives the
cost (`cost_drivers`, most influential first) and the largest value of it that fits. The constants
below are calibrated on a 2-core CPU; bench/limits.py measures every experiment at its largest
accepted settings and checks no estimate falls below its measurement.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import contextvars
import math
from typing import Any, ClassVar, Mapping

from backend import limits

MiB = 1 << 20
PROCESS_BYTES = 400 * MiB  # anonymous memory of a process with torch and the experiments imported (~250 MiB measured)
RANK_START_S = 15.0        # seconds to start one spawned rank (its imports) on a loaded 2-core box; two start at a time
FLOPS = 5e9                # dense floating-point operations per second a run gets, whatever its rank count (2 shared cores)
BYTES_PER_S = 0.5e9        # bytes per second a copy, a send or a store of a run moves
OP_S = 100e-6              # one Python-level step: interpreter and torch dispatch overhead, on a loaded box
_SEARCHING = contextvars.ContextVar("searching_for_a_fit", default=False)  # a fit search must not search again
DYNAMO_IMPORT_S = 35.0     # a process's first torch.optim optimizer or FlopCounterMode imports torch._dynamo: 9-23 s measured loaded


class ConfigError(ValueError):
    """A bad setting: `field` names it, the message says what is allowed."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


def setting(default, *, min=None, max=None, choices=None, help: str = ""):
    """A Config field with its server-side limits and a one-line description."""
    meta = {"min": min, "max": max, "choices": tuple(choices) if choices else None, "help": help}
    return dataclasses.field(default=default, metadata=meta)


def _type_name(t) -> str:
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}[t]


@dataclasses.dataclass(frozen=True)
class Estimate:
    memory_bytes: int
    seconds: float


def cost(*, data_bytes: float = 0, flops: float = 0, moved_bytes: float = 0, ops: float = 0, ranks: int = 0,
         seconds: float = 0) -> Estimate:
    """A run's estimate from its work: the bytes it holds at its peak (beyond its processes' own), the
    floating-point operations it computes, the bytes it copies or sends, the Python-level steps it takes,
    the ranks it spawns besides its leader (and their fork server), and any fixed seconds (a compiler, a probe, a deliberate wait)."""
    start = RANK_START_S * ranks / 2
    processes = 1 + ranks + (1 if ranks else 0)  # the leader, its ranks and the fork server they come from
    return Estimate(int(processes * PROCESS_BYTES + data_bytes),
                    start + flops / FLOPS + moved_bytes / BYTES_PER_S + ops * OP_S + seconds)


@dataclasses.dataclass
class Config:
    """Base class. Subclasses declare fields with `setting(...)`, may add cross-field rules in `check()`,
    and override `estimate()` with their run's cost, naming the settings that drive it in `cost_drivers`."""

    cost_drivers: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def fields(cls) -> list[dataclasses.Field]:
        return list(dataclasses.fields(cls))

    @classmethod
    def field_type(cls, f: dataclasses.Field) -> type:
        t = f.type if isinstance(f.type, type) else {"int": int, "float": float, "bool": bool, "str": str}[f.type]
        return t

    @classmethod
    def allowed(cls, f: dataclasses.Field) -> str:
        m = f.metadata
        if m.get("choices"):
            return "one of " + ", ".join(str(c) for c in m["choices"])
        t = cls.field_type(f)
        if m.get("min") is not None and m.get("max") is not None:
            return f"{_type_name(t)} in {m['min']}..{m['max']}"
        if m.get("min") is not None:
            return f"{_type_name(t)} >= {m['min']}"
        if m.get("max") is not None:
            return f"{_type_name(t)} <= {m['max']}"
        return _type_name(t)

    @classmethod
    def _field(cls, name: str) -> dataclasses.Field:
        by_name = {f.name: f for f in cls.fields()}
        if name not in by_name:
            raise ConfigError(name, f"unknown setting; allowed settings: {', '.join(by_name) or '(none)'}")
        return by_name[name]

    @classmethod
    def parse_value(cls, name: str, raw: Any) -> Any:
        """Turn a string (CLI --set, URL query param) or a JSON value into the field's type."""
        f = cls._field(name)
        t = cls.field_type(f)
        if isinstance(raw, str):
            text = raw.strip()
            try:
                if t is bool:
                    if text.lower() in ("true", "1", "yes", "on"):
                        return True
                    if text.lower() in ("false", "0", "no", "off"):
                        return False
                    raise ValueError
                return t(text)
            except ValueError:
                raise ConfigError(name, f"{raw!r} is not {_type_name(t)} (allowed: {cls.allowed(f)})") from None
        if t is float and isinstance(raw, int) and not isinstance(raw, bool):
            return float(raw)
        if type(raw) is not t:
            raise ConfigError(name, f"{raw!r} is not {_type_name(t)} (allowed: {cls.allowed(f)})")
        return raw

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "Config":
        """Build and validate from strings or JSON values; unknown names are errors, missing ones default."""
        parsed = {name: cls.parse_value(name, raw) for name, raw in values.items()}
        config = cls(**parsed)
        config.validate()
        return config

    def validate(self) -> "Config":
        for f in self.fields():
            value = getattr(self, f.name)
            t = self.field_type(f)
            if type(value) is not t and not (t is float and type(value) is int):
                raise ConfigError(f.name, f"{value!r} is not {_type_name(t)} (allowed: {self.allowed(f)})")
            m = f.metadata
            bad = (
                (m.get("choices") and value not in m["choices"])
                or (m.get("min") is not None and value < m["min"])
                or (m.get("max") is not None and value > m["max"])
                or (t is float and value != value)
            )
            if bad:
                raise ConfigError(f.name, f"{value!r} is out of range (allowed: {self.allowed(f)})")
        self.check()
        self.check_budget()
        return self

    def check(self) -> None:
        """Cross-field rules; raise ConfigError naming the field to change."""

    def estimate(self) -> Estimate:
        """Peak memory and wall time of a run with these settings (experiments override; see cost())."""
        return cost()

    def lower_hint(self) -> str:
        """What to lower when a run took too long or too much memory: the settings its cost grows with (most
        influential first), as this run set them."""
        if not self.cost_drivers:
            return "choose smaller settings"
        named = [f"{n} (now {getattr(self, n)!r})" for n in self.cost_drivers]
        return "lower " + (", ".join(named[:-1]) + " or " + named[-1] if len(named) > 1 else named[0])

    def _fits(self, **change) -> bool:
        candidate = dataclasses.replace(self, **change)
        try:
            candidate.check()
        except ConfigError:
            return False
        est = candidate.estimate()
        return est.memory_bytes <= limits.memory_budget() and est.seconds <= limits.time_budget()

    def check_budget(self) -> None:
        """Refuse a run predicted to pass the server's memory or time budget, naming the setting to lower."""
        if self._fits():
            return
        est = self.estimate()
        need = (f"needs about {est.memory_bytes / limits.GIB:.1f} GiB and {est.seconds:.0f} s, over the server's "
                f"budget of {limits.memory_budget() / limits.GIB:g} GiB (EXPLORER_RUN_MEMORY_GIB) and "
                f"{limits.time_budget():g} s (EXPLORER_JOB_TIMEOUT_S) per run")
        if not self.cost_drivers:
            raise ConfigError("settings", f"this run {need}")
        raise self.too_costly(self.cost_drivers, f"this run {need}")

    def too_costly(self, drivers: tuple[str, ...], what: str) -> ConfigError:
        """The refusal of a run that costs too much (the server's budget, or a cost rule in check() such as an
        interpreter's step count): names the first of `drivers` that can be lowered to fit and its largest fitting
        value; if no single one is enough, how far the first may go with the other settings back at their defaults."""
        if _SEARCHING.get():
            return ConfigError(drivers[0], what)
        token = _SEARCHING.set(True)
        try:
            for name in drivers:
                best = self._largest_fitting(name)
                if best is not None:
                    return ConfigError(name, f"{getattr(self, name)!r}: {what} (allowed with the other settings as they "
                                             f"are: {name} = {best})")
            name = drivers[0]
            defaults = {f.name: f.default for f in self.fields() if f.name != name and getattr(self, f.name) != f.default}
            best = dataclasses.replace(self, **defaults)._largest_fitting(name)
            hint = (f"allowed: {name} = {best} with " + ", ".join(f"{k} = {v}" for k, v in defaults.items())
                    if best is not None else f"lower {', '.join(drivers)}")
            return ConfigError(name, f"{getattr(self, name)!r}: {what}, and no single setting brings it within ({hint})")
        finally:
            _SEARCHING.reset(token)

    def _largest_fitting(self, name: str):
        """The largest value of one setting (others unchanged) that fits the budget, or None. Assumes the cost
        grows with the value; a choice setting gives its first choice that fits."""
        f = self._field(name)
        t, m, value = self.field_type(f), f.metadata, getattr(self, name)
        if m.get("choices") or t is bool:
            options = m.get("choices") or (False, True)
            return next((c for c in options if c != value and self._fits(**{name: c})), None)
        if t is str:
            return None
        low = m.get("min") if m.get("min") is not None else (1 if t is int else 0.0)
        while low < value and not self._fits(**{name: low}):  # the smallest values may break a cross-field rule
            low = low * 2 if low > 0 else 1
        if low >= value:
            return None
        high = value  # low fits, high does not
        if t is int:
            while high - low > 1:
                mid = (low + high) // 2
                low, high = (mid, high) if self._fits(**{name: mid}) else (low, mid)
            return low
        for _ in range(40):
            mid = (low + high) / 2
            low, high = (mid, high) if self._fits(**{name: mid}) else (low, mid)
        if low <= 0:
            return low
        step = 10.0 ** (math.floor(math.log10(low)) - 2)
        return math.floor(low / step) * step  # 3 significant digits, rounded down so that it still fits

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def digest(self, experiment: str, code_version: str) -> str:
        """Identity of a run: same experiment, settings and code give the same digest (dedupe)."""
        blob = json.dumps([experiment, self.to_dict(), code_version], sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:20]
