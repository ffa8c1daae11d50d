"""Every table a page draws, as a reader should read it: words for column names, as many digits as a number means,
"—" for a missing cell, and a sentence for a table with no rows (pages call it as ui.table)."""
from __future__ import annotations

import math
import re

import numpy as np
import pandas as pd
import streamlit as st


# --- tables --------------------------------------------------------------------------------------------------------
# A table is read, not parsed: every column has words for a name, every number as many digits as it means, and no
# cell says "None". Each page's tables go through table(); readable() is the rule, and tests/test_pages.py checks it.
MISSING = "—"
_UNIT_SUFFIXES = {"ms": "ms", "us": "µs", "s": "s", "ns": "ns", "bytes": "bytes", "gib": "GiB", "mib": "MiB", "gb": "GB",
                  "gbps": "GB/s", "pct": "%", "flops": "FLOPs", "tflops": "TFLOP/s"}
SNAKE = re.compile(r"[A-Za-z0-9]_[A-Za-z0-9]")


def words(name: str) -> str:
    """A column's key as a reader's label: forward_cpu_ms -> "forward cpu (ms)", capacity_bytes -> "capacity (bytes)"."""
    parts = str(name).split("_")
    unit = _UNIT_SUFFIXES.get(parts[-1].lower()) if len(parts) > 1 else None
    text = " ".join(p for p in (parts[:-1] if unit else parts) if p)
    return f"{text} ({unit})" if unit else text


def number_format(values: pd.Series) -> str:
    """A printf format showing three significant digits of a float column's smallest magnitude (so 0.77 and 0.24
    read 0.772 and 0.245, 41.98 and 6.98 read 41.99 and 6.98); whole numbers as integers; scientific where fixed
    decimals would need more than six places or seven integer digits."""
    finite = values[np.isfinite(values)].abs()
    nonzero = finite[finite > 0]
    if nonzero.empty or (finite == finite.round()).all():
        return "%d" if finite.empty or finite.max() < 1e4 else "localized"
    low, high = float(nonzero.min()), float(nonzero.max())
    if high >= 1e7 or low < 1e-3:
        return "%.3e"
    return f"%.{min(6, max(0, 2 - math.floor(math.log10(low))))}f"


def _formatted(value: float, fmt: str) -> str:
    """One number as the grid would draw it with `fmt` (printf, percent or localized): for a column that needs
    text cells because some of its values are missing."""
    if not math.isfinite(value):
        return str(value)
    if fmt == "percent":
        return f"{100 * value:.3g}%"
    if fmt in ("localized", "plain", "compact", "accounting"):
        return f"{value:,.6g}" if value != round(value) else f"{int(value):,}"
    try:
        return fmt % value
    except (TypeError, ValueError):
        return f"{value:.4g}"


def readable(df: pd.DataFrame, column_config: dict | None = None) -> tuple[pd.DataFrame, dict]:
    """The table and its column configuration as a reader should see them: a snake_case key gets a label in words,
    a float column without a format gets number_format's, a list in a cell its numbers to 4 digits, a missing value (None, NaN, "") reads "—", and a number
    column with missing values becomes right-aligned text in its own format (the grid would draw a raw "None")."""
    df = df.copy()
    config = dict(column_config or {})
    for col in df.columns:
        given = config.get(col, {})
        if given is None:  # hidden
            continue
        cfg = {"label": given} if isinstance(given, str) else dict(given)
        if SNAKE.search(cfg.get("label") or str(col)):
            cfg["label"] = words(cfg.get("label") or col)
        type_config = dict(cfg.get("type_config") or {})
        if df[col].map(lambda v: isinstance(v, (list, tuple))).any():  # a vector in a cell: its numbers, 4 digits each
            df[col] = df[col].map(lambda v: ", ".join(f"{x:.4g}" if isinstance(x, float) else str(x) for x in v)
                                  if isinstance(v, (list, tuple)) else v)
        values = df[col]
        missing = values.isna() | values.map(lambda v: isinstance(v, str) and not v.strip())
        if values.dtype.kind in "fiu":
            fmt = type_config.get("format") or number_format(values.astype(float))
            if missing.any():
                df[col] = [MISSING if gone else _formatted(float(v), fmt) for v, gone in zip(values, missing)]
                cfg = {**cfg, "type_config": {"type": "text"}, "alignment": cfg.get("alignment") or "right"}
            elif type_config.get("type") in (None, "number"):
                cfg["type_config"] = {"type": "number", **type_config, "format": fmt}
        elif missing.any():
            df[col] = values.astype(object).where(~missing, MISSING)
        if cfg:
            config[col] = cfg
    return df, config


def table(data, where=None, column_config: dict | None = None, **kwargs):
    """Draw a table (in `where`, a column or container, else the page) through readable(): every page's tables. A table
    with no rows is a sentence, not an empty grid."""
    frame = pd.DataFrame(data)
    if frame.empty and "on_select" not in kwargs:
        return (where or st).caption("None in this run.")
    df, config = readable(frame, column_config)
    kwargs.setdefault("hide_index", True)
    kwargs.setdefault("width", "stretch")
    return (where or st).dataframe(df, column_config=config, **kwargs)
