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


def setting(default, *, min=None, max=None, choices=None, item_range=None, length=None, help: str = ""):
    """A Config field with its server-side limits and a one-line description.

    A list default makes a list setting (held as a tuple; a comma-separated string on the CLI and in a URL):
    `item_range=(lo, hi)` or `choices` bound each item, `length=(lo, hi)` the number of items, and the item type is
    the default items' (an empty default's is int)."""
    if isinstance(default, (list, tuple)):
        if min is not None or max is not None:
            raise TypeError("a list setting bounds its items with item_range=(lo, hi), not min/max")
        lo, hi = item_range or (None, None)
        meta = {"item": type(default[0]) if default else int, "length": tuple(length) if length else None,
                "items": {"min": lo, "max": hi, "choices": tuple(choices) if choices else None}, "help": help}
        return dataclasses.field(default=tuple(default), metadata=meta)
    if item_range is not None or length is not None:
        raise TypeError("item_range and length are for a list setting (a list default)")
    meta = {"min": min, "max": max, "choices": tuple(choices) if choices else None, "help": help}
    return dataclasses.field(default=default, metadata=meta)


_SCALARS = {"int": int, "float": float, "bool": bool, "str": str}


def _type_name(t, plural: bool = False) -> str:
    names = {int: ("an integer", "integers"), float: ("a number", "numbers"), bool: ("true or false", "true/false values"),
             str: ("a string", "names")}
    return names[t][plural]


def _scalar_allowed(t: type, m: Mapping) -> str:
    """What one value (a scalar setting, or each item of a list setting) may be."""
    if m.get("choices"):
        return "one of " + ", ".join(str(c) for c in m["choices"])
    if m.get("min") is not None and m.get("max") is not None:
        return f"{_type_name(t)} in {m['min']}..{m['max']}"
    if m.get("min") is not None:
        return f"{_type_name(t)} >= {m['min']}"
    if m.get("max") is not None:
        return f"{_type_name(t)} <= {m['max']}"
    return _type_name(t)


def _parse_scalar(t: type, text: str):
    """One value from its text; ValueError if it is not of type `t`."""
    text = text.strip()
    if t is bool:
        if text.lower() in ("true", "1", "yes", "on"):
            return True
        if text.lower() in ("false", "0", "no", "off"):
            return False
        raise ValueError(text)
    return t(text)


def _of_type(value, t: type) -> bool:
    return type(value) is t or (t is float and type(value) is int)


def _in_range(value, m: Mapping) -> bool:
    return not ((m.get("choices") and value not in m["choices"])
                or (m.get("min") is not None and value < m["min"])
                or (m.get("max") is not None and value > m["max"])
                or value != value)  # NaN


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
        """The field's type: int, float, bool, str, or tuple for a list setting (its items' type is item_type)."""
        if "item" in f.metadata:
            return tuple
        return f.type if isinstance(f.type, type) else _SCALARS[f.type]

    @staticmethod
    def item_type(f: dataclasses.Field) -> type | None:
        """The type of a list setting's items; None for a scalar setting."""
        return f.metadata.get("item")

    @classmethod
    def allowed(cls, f: dataclasses.Field) -> str:
        m, item = f.metadata, cls.item_type(f)
        if item is None:
            return _scalar_allowed(cls.field_type(f), m)
        lo, hi = m.get("length") or (0, None)
        count = f"{lo}..{hi} " if hi is not None else f"at least {lo} " if lo else ""
        each = _scalar_allowed(item, m["items"]).removeprefix(_type_name(item)).strip()
        return f"a comma-separated list of {count}{_type_name(item, plural=True)}" + (f", each {each}" if each else "")

    @staticmethod
    def text_of(value) -> str:
        """A setting's value as the CLI and a URL write it (a list setting comma-separated)."""
        return ",".join(str(v) for v in value) if isinstance(value, (list, tuple)) else str(value)

    @classmethod
    def field_of(cls, name: str) -> dataclasses.Field:
        by_name = {f.name: f for f in cls.fields()}
        if name not in by_name:
            raise ConfigError(name, f"unknown setting; allowed settings: {', '.join(by_name) or '(none)'}")
        return by_name[name]

    @classmethod
    def parse_value(cls, name: str, raw: Any) -> Any:
        """Turn a string (CLI --set, URL query param) or a JSON value into the field's type. A list setting takes
        a comma-separated string (empty items skipped) or a JSON list."""
        f = cls.field_of(name)
        t, item = cls.field_type(f), cls.item_type(f)
        if item is not None:
            parts = [p for p in raw.split(",") if p.strip()] if isinstance(raw, str) else raw
            if not isinstance(parts, (list, tuple)):
                raise ConfigError(name, f"{raw!r} is not a list (allowed: {cls.allowed(f)})")
            within = f" in {cls.text_of(raw)!r}"
            return tuple(cls._parse_one(name, f, item, p, within) for p in parts)
        return cls._parse_one(name, f, t, raw)

    @classmethod
    def _parse_one(cls, name: str, f: dataclasses.Field, t: type, raw: Any, within: str = "") -> Any:
        """One value of type `t` (a scalar setting, or one item of a list setting, `within` naming the list) from a
        string or a JSON value."""
        if isinstance(raw, str):
            try:
                return _parse_scalar(t, raw)
            except ValueError:
                raise ConfigError(name, f"{raw.strip()!r}{within} is not {_type_name(t)} (allowed: {cls.allowed(f)})") from None
        if t is float and isinstance(raw, int) and not isinstance(raw, bool):
            return float(raw)
        if type(raw) is not t:
            raise ConfigError(name, f"{raw!r}{within} is not {_type_name(t)} (allowed: {cls.allowed(f)})")
        return raw

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "Config":
        """Build and validate from strings or JSON values; unknown names are errors, missing ones default."""
        parsed = {name: cls.parse_value(name, raw) for name, raw in values.items()}
        config = cls(**parsed)
        config.validate()
        return config

    def validate(self) -> "Config":
        """Each field's type and range (each item's, and the count, for a list setting), then check()."""
        for f in self.fields():
            value, t, m, item = getattr(self, f.name), self.field_type(f), f.metadata, self.item_type(f)
            if not _of_type(value, t):
                raise ConfigError(f.name, f"{value!r} is not {_type_name(t) if item is None else 'a list'} "
                                          f"(allowed: {self.allowed(f)})")
            if item is None:
                if not _in_range(value, m):
                    raise ConfigError(f.name, f"{value!r} is out of range (allowed: {self.allowed(f)})")
                continue
            for v in value:
                if not _of_type(v, item):
                    raise ConfigError(f.name, f"{v!r} in {self.text_of(value)!r} is not {_type_name(item)} "
                                              f"(allowed: {self.allowed(f)})")
                if not _in_range(v, m["items"]):
                    raise ConfigError(f.name, f"{v!r} in {self.text_of(value)!r} is out of range (allowed: {self.allowed(f)})")
            lo, hi = m.get("length") or (0, None)
            if len(value) < lo or (hi is not None and len(value) > hi):
                raise ConfigError(f.name, f"{len(value)} items in {self.text_of(value)!r} (allowed: {self.allowed(f)})")
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
