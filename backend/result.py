"""What a run returns: measured metrics, tables for charts, checks against references, trace events; and the
schema that declares, once per experiment, which metrics and tables (with their columns) a result holds."""
from __future__ import annotations

import copy
import dataclasses
import math
from typing import Any, Callable, Iterable, Mapping


@dataclasses.dataclass
class Check:
    """One comparison with an independent reference. `error` is the measured disagreement."""

    name: str
    error: float
    tolerance: float
    reference: str = ""
    detail: str = ""

    @property
    def passed(self) -> bool:
        return math.isfinite(self.error) and self.error <= self.tolerance

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "passed": self.passed}


@dataclasses.dataclass
class Result:
    metrics: dict[str, Any] = dataclasses.field(default_factory=dict)
    tables: dict[str, list[dict[str, Any]]] = dataclasses.field(default_factory=dict)
    checks: list[Check] = dataclasses.field(default_factory=list)
    trace_events: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    schema_version: int | None = None  # the version of its experiment's Schema it was built to (Schema.stamp)

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)

    def to_dict(self) -> dict[str, Any]:
        """JSON form stored as result.json (the trace goes to its own file)."""
        body = {
            "metrics": self.metrics,
            "tables": self.tables,
            "checks": [c.to_dict() for c in self.checks],
            "notes": self.notes,
        }
        if self.schema_version is not None:
            body[VERSION_KEY] = self.schema_version
        return body


def error_bars(rows: list[dict], value: str, stderr: str, k: float, low: str, high: str) -> list[dict]:
    """Each row's `value` k standard errors either side, as its columns `low` and `high`: the interval a page draws
    as an error bar (a mean over n samples ± k·σ/√n)."""
    for r in rows:
        r[low], r[high] = r[value] - k * r[stderr], r[value] + k * r[stderr]
    return rows


VERSION_KEY = "schema_version"  # in result.json; a stored result without it is version 1 (stored before schemas)


class UndeclaredKey(KeyError):
    """A metric or table read (or produced) that its experiment's schema does not declare."""


def _matches(key: str, declared: Iterable[str]) -> bool:
    """`key` is declared by name, or by a family `prefix.*` (one key per variant, device or size: `error_pct.*`)."""
    return any(key == d or (d.endswith(".*") and key.startswith(d[:-1])) for d in declared)


@dataclasses.dataclass(frozen=True, eq=False)
class Schema:
    """The keys of one experiment's result, declared once beside the experiment: its metrics, its tables with their
    columns, which of them only some settings produce, and the version. The experiment's run is stamped with it (a
    missing or undeclared key fails the run), and a page reads the result through `open`, which upgrades a run stored
    by an older version (one function per version step) and refuses a key the schema does not declare: a page reads
    keys directly, without fallbacks for old runs."""

    metrics: tuple[str, ...]
    tables: Mapping[str, tuple[str, ...]]
    optional: tuple[str, ...] = ()     # metrics or tables produced by some settings only (a page tests `in` first)
    version: int = 1
    upgrades: Mapping[int, Callable[[dict], None]] = dataclasses.field(default_factory=dict)  # v -> makes v into v+1

    def __post_init__(self):
        missing = [v for v in range(1, self.version) if v not in self.upgrades]
        if missing:
            raise ValueError(f"schema version {self.version} has no upgrade from version(s) {missing}")
        strings = [name for name, columns in self.tables.items() if isinstance(columns, str)]
        if strings:
            raise ValueError(f"the columns of table(s) {strings} are a string, not a tuple of names")
        unknown = [k for k in self.optional if not (_matches(k, self.metrics) or k in self.tables)]
        if unknown:
            raise ValueError(f"optional keys the schema does not declare: {unknown}")

    def declares(self, kind: str, key: str) -> bool:
        return _matches(key, self.metrics) if kind == "metrics" else key in self.tables

    def problems(self, metrics: Mapping[str, Any], tables: Mapping[str, list]) -> list[str]:
        """What a result holds that the schema does not declare, and what it lacks that the schema requires."""
        found = [f"metric {k!r} is not declared" for k in metrics if not self.declares("metrics", k)]
        found += [f"table {k!r} is not declared" for k in tables if not self.declares("tables", k)]
        for name, rows in tables.items():
            columns = set().union(*(row.keys() for row in rows if isinstance(row, dict))) if rows else set()
            extra = sorted(columns - set(self.tables.get(name, columns)))
            if extra:
                found.append(f"table {name!r} has undeclared columns {extra}")
        for key in self.metrics:
            present = any(_matches(k, [key]) for k in metrics)
            if not present and key not in self.optional:
                found.append(f"metric {key!r} is missing")
        found += [f"table {k!r} is missing" for k in self.tables if k not in tables and k not in self.optional]
        return found

    def stamp(self, result: Result, experiment: str) -> Result:
        """The experiment's Result, checked against its declaration and marked with this version."""
        found = self.problems(result.metrics, result.tables)
        if found:
            raise UndeclaredKey(f"{experiment}'s result does not match its schema (version {self.version}): "
                                + "; ".join(found))
        result.schema_version = self.version
        return result

    def upgrade(self, stored: dict) -> dict:
        """A stored result brought to this version, one step at a time (a copy; the stored file is never rewritten)."""
        body = copy.deepcopy(stored)
        version = body.get(VERSION_KEY, 1)
        if version > self.version:
            raise ValueError(f"a result of schema version {version}, newer than this code's {self.version}")
        while version < self.version:
            self.upgrades[version](body)
            version += 1
        body[VERSION_KEY] = version
        return body

    def open(self, stored: dict, experiment: str) -> dict:
        """A stored result upgraded to this version, its metrics and tables readable only by declared keys."""
        body = self.upgrade(stored)
        body["metrics"] = Declared(body.get("metrics", {}), self, "metrics", experiment)
        body["tables"] = Declared(body.get("tables", {}), self, "tables", experiment)
        return body


@dataclasses.dataclass(frozen=True, eq=False)
class Shapes:
    """One experiment whose settings produce results of different shapes (parallel.ddp on the MLP or the tiny LLaMA):
    a Schema per value of the metric `by`, each with its own required keys, so a result missing a key its shape
    requires fails. The shapes share one version and its upgrades, run before the shape is chosen (an upgrade may
    supply `by`); `declares` answers for any shape (what some run of the experiment may hold)."""

    by: str
    shapes: Mapping[str, Schema]

    def __post_init__(self):
        versions = {(s.version, tuple(sorted(s.upgrades.items()))) for s in self.shapes.values()}
        if len(versions) != 1:
            raise ValueError("the shapes of one experiment share one version and its upgrades")
        unnamed = [v for v, s in self.shapes.items() if not s.declares("metrics", self.by) or self.by in s.optional]
        if unnamed:
            raise ValueError(f"shape(s) {unnamed} do not require the metric {self.by!r} that chooses them")

    @property
    def version(self) -> int:
        return next(iter(self.shapes.values())).version

    def shape(self, metrics: Mapping[str, Any], experiment: str = "the experiment") -> Schema:
        """The schema of the shape the result's `by` metric names."""
        value = metrics.get(self.by)
        if value not in self.shapes:
            raise UndeclaredKey(f"{experiment}'s result names no shape of its schema: metric {self.by!r} is {value!r} "
                                f"(allowed: {', '.join(self.shapes)})")
        return self.shapes[value]

    @property
    def metrics(self) -> tuple[str, ...]:  # every shape's, for a reader asking what some run may hold
        return tuple(dict.fromkeys(k for s in self.shapes.values() for k in s.metrics))

    @property
    def tables(self) -> dict[str, tuple[str, ...]]:
        return {name: tuple(dict.fromkeys(c for s in self.shapes.values() for c in s.tables.get(name, ())))
                for s in self.shapes.values() for name in s.tables}

    def declares(self, kind: str, key: str) -> bool:
        return any(s.declares(kind, key) for s in self.shapes.values())

    def stamp(self, result: Result, experiment: str) -> Result:
        return self.shape(result.metrics, experiment).stamp(result, experiment)

    def upgrade(self, stored: dict) -> dict:
        return next(iter(self.shapes.values())).upgrade(stored)

    def open(self, stored: dict, experiment: str) -> dict:
        """The stored result upgraded, then read through the schema of its shape."""
        body = self.upgrade(stored)
        return self.shape(body.get("metrics", {}), experiment).open(body, experiment)


class Declared(dict):
    """A result's metrics or tables as a page reads them: a key its schema does not declare raises UndeclaredKey
    naming the experiment, even when the run happens to hold it (so a page cannot come to depend on it)."""

    def __init__(self, items: Mapping, schema: Schema, kind: str, experiment: str):
        super().__init__(items)
        self._schema, self._kind, self._experiment = schema, kind, experiment

    def _declared(self, key) -> None:
        if not self._schema.declares(self._kind, key):
            raise UndeclaredKey(f"{self._kind[:-1]} {key!r} is not declared in {self._experiment}'s result schema "
                                f"(version {self._schema.version})")

    def __getitem__(self, key):
        self._declared(key)
        return super().__getitem__(key)

    def get(self, key, default=None):
        self._declared(key)
        return super().get(key, default)

    def __contains__(self, key) -> bool:
        self._declared(key)
        return super().__contains__(key)
