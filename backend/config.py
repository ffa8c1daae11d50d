"""Experiment settings: a dataclass per experiment whose fields carry their allowed ranges.

`validate()` runs on the server for every run, whatever the caller (CLI, Python API, page, URL),
so a widget's bounds are only a convenience. Every failure is one `ConfigError` naming the field
and what it allows.

A Config also declares its run's cost: `estimate()` (built with backend.limits.cost) and `cost_drivers`,
the settings the cost grows with. Holding a run to the server's budget is backend.limits' work
(check_budget, called by the experiment registry beside validate()); this module imports nothing from it.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any, ClassVar, Mapping


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


@dataclasses.dataclass
class Config:
    """Base class. Subclasses declare fields with `setting(...)`, may add cross-field rules in `check()`,
    and override `estimate()` with their run's cost (backend.limits.cost), naming the settings that drive it
    in `cost_drivers`."""

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
    def field_of(cls, name: str) -> dataclasses.Field:
        by_name = {f.name: f for f in cls.fields()}
        if name not in by_name:
            raise ConfigError(name, f"unknown setting; allowed settings: {', '.join(by_name) or '(none)'}")
        return by_name[name]

    @classmethod
    def parse_value(cls, name: str, raw: Any) -> Any:
        """Turn a string (CLI --set, URL query param) or a JSON value into the field's type."""
        f = cls.field_of(name)
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
        return self

    def check(self) -> None:
        """Cross-field rules; raise ConfigError naming the field to change."""

    def estimate(self):
        """Peak memory and wall time of a run with these settings, a backend.limits.Estimate (experiments
        override it with backend.limits.cost(...): the base has no cost model to offer)."""
        raise NotImplementedError(f"{type(self).__name__} declares no estimate(): see backend.limits.cost")

    def lower_hint(self) -> str:
        """What to lower when a run took too long or too much memory: the settings its cost grows with (most
        influential first), as this run set them."""
        if not self.cost_drivers:
            return "choose smaller settings"
        named = [f"{n} (now {getattr(self, n)!r})" for n in self.cost_drivers]
        return "lower " + (", ".join(named[:-1]) + " or " + named[-1] if len(named) > 1 else named[0])

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def digest(self, experiment: str, code_version: str) -> str:
        """Identity of a run: same experiment, settings and code give the same digest (dedupe)."""
        blob = json.dumps([experiment, self.to_dict(), code_version], sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:20]


# The cost model moved to backend.limits. backend/parallel/workload.py (rebuilt on another branch) and experiments
# written elsewhere before the move still import it from here: those names resolve from limits on first use.
# Drop this once `grep -rn "from backend.config import.*cost" backend` finds nothing.
_MOVED_TO_LIMITS = frozenset({"Estimate", "cost", "PROCESS_BYTES", "RANK_START_S", "FLOPS", "BYTES_PER_S", "OP_S",
                              "DYNAMO_IMPORT_S"})


def __getattr__(name: str):
    if name in _MOVED_TO_LIMITS:
        from backend import limits

        return getattr(limits, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
