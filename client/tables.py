"""One table style for the command line: compact enough for an 80-column terminal or a log."""

from __future__ import annotations

from collections.abc import Sequence

from rich import box
from rich.table import Table


def compact_table(title: str, columns: Sequence[str], *, caption: str | None = None,
                  left: Sequence[str] = ()) -> Table:
    """Columns are right-aligned (numbers) unless named in ``left``; cells never wrap."""
    table = Table(title=title, caption=caption, box=box.SIMPLE_HEAD, collapse_padding=True,
                  pad_edge=False)
    for col in columns:
        table.add_column(col, justify="left" if col in left else "right", no_wrap=True)
    return table
