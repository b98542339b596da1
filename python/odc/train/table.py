"""Plain-text tables for `python -m odc.train`'s report. Invariant: every column is as wide as its
widest cell (the header included) and cells are separated by at least two spaces, so columns stay
aligned and never run together whatever the magnitudes (a cost model far off, a huge error)."""

from __future__ import annotations

from typing import List, Sequence

SEPARATOR = "  "


def format_table(
    header: Sequence[str], rows: Sequence[Sequence[str]], align: str, indent: str = ""
) -> List[str]:
    """The table's lines, header first. align: one character per column, 'l' (left) or 'r'
    (right); the last column is not padded on the right (no trailing spaces)."""
    if len(align) != len(header) or set(align) - {"l", "r"}:
        raise ValueError(f"align needs one 'l' or 'r' per column ({len(header)}), got {align!r}")
    for row in rows:
        if len(row) != len(header):
            raise ValueError(f"a row has {len(row)} cells for {len(header)} columns: {row!r}")
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows)]
    lines = []
    for row in (header, *rows):
        cells = [
            str(cell).ljust(width) if side == "l" else str(cell).rjust(width)
            for cell, width, side in zip(row, widths, align)
        ]
        lines.append((indent + SEPARATOR.join(cells)).rstrip())
    return lines


def signed_percent(fraction: float) -> str:
    """A relative error as a signed percentage: +2.5%, -13.0%."""
    return f"{100 * fraction:+.1f}%"
