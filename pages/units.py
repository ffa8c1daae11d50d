"""Numbers as a page shows them: SI prefixes and three significant digits, short enough that a metric is never cut."""
from __future__ import annotations


def rate(gbps: float) -> str:
    """A bandwidth given in GB/s, with the prefix that keeps three significant digits visible (0.05 -> 50 MB/s)."""
    return si(gbps * 1e9, "B/s")


def si(value: float, unit: str = "") -> str:
    """A number with an SI prefix and three significant digits (28,352 B -> 28.4 kB): short enough for a metric."""
    value = float(value)
    for factor, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}".strip()


def before_after(column, label: str, before: float, after: float, unit: str = "", help: str | None = None) -> None:
    """A metric that went from `before` to `after`: the new value, and the change beside it (green when it fell),
    so the value stays short enough never to be cut."""
    change = f"{100 * (after - before) / before:+.0f} % from {si(before, unit)}" if before else f"from {si(before, unit)}"
    column.metric(label, si(after, unit), change, delta_color="inverse", help=help)


def binary(value: float, unit: str = "B") -> str:
    """A size in binary prefixes, as caches and working sets are sized (32,768 B -> 32 KiB, 1.5 * 2^20 -> 1.5 MiB)."""
    value = float(value)
    for factor, prefix in ((2**40, "Ti"), (2**30, "Gi"), (2**20, "Mi"), (2**10, "Ki")):
        if abs(value) >= factor:
            return f"{value / factor:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"
