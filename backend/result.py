"""What a run returns: measured metrics, tables for charts, checks against references, trace events."""
from __future__ import annotations

import dataclasses
import math
from typing import Any


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

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)

    def to_dict(self) -> dict[str, Any]:
        """JSON form stored as result.json (the trace goes to its own file)."""
        return {
            "metrics": self.metrics,
            "tables": self.tables,
            "checks": [c.to_dict() for c in self.checks],
            "notes": self.notes,
        }
