"""Terminal tables (tabulate): thousands separated, two decimals, ``-`` for missing values."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tabulate import tabulate


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """Rows (dicts with the same keys, in column order) as an aligned table with a header.
    Numbers are formatted (``1,234``, ``1.50``); strings are printed as they are (an LR written
    ``"2e-3"`` or an all-digit trial hash stays what it is)."""
    keys = list(rows[0]) if rows else []
    text_columns = [i for i, k in enumerate(keys) if any(isinstance(r.get(k), str) for r in rows)]
    return tabulate(rows, headers="keys", intfmt=",", floatfmt=",.2f", missingval="-",
                    disable_numparse=text_columns or False)
