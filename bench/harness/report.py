"""One markdown table printer for every benchmark's report."""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[object]], align: str = "") -> str:
    """A markdown table; `align` has one letter per column, `l` or `r` (by default the first
    column left, the others right, as numbers read)."""
    align = align or "l" + "r" * (len(header) - 1)
    lines = [
        "| " + " | ".join(header) + " |",
        "|" + "".join("---:|" if side == "r" else "---|" for side in align),
    ]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)
