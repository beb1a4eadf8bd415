"""One table style for the command line: compact enough for an 80-column terminal or a log."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import IO

from rich import box
from rich.console import Console
from rich.table import Table

PIPED_WIDTH = 1000
"""Line width when output goes to a pipe or file: rich would otherwise assume 80 columns and
cut every wider row short (``…``) in exactly the logs people grep later."""


def cli_console(file: IO[str] | None = None) -> Console:
    """A console for command output: a terminal's own width; when piped, ``$COLUMNS`` if set,
    else wide enough that no row is cut."""
    console = Console(file=file)
    if console.is_terminal or os.environ.get("COLUMNS"):
        return console
    return Console(file=file, width=PIPED_WIDTH)


def compact_table(title: str, columns: Sequence[str], *, caption: str | None = None,
                  left: Sequence[str] = ()) -> Table:
    """Columns are right-aligned (numbers) unless named in ``left``; cells never wrap."""
    table = Table(title=title, caption=caption, box=box.SIMPLE_HEAD, collapse_padding=True,
                  pad_edge=False)
    for col in columns:
        table.add_column(col, justify="left" if col in left else "right", no_wrap=True)
    return table
