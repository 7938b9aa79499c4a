"""How ``spot-callbacks`` shows tables and waits: rich on a terminal, plain aligned text when piped."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Sequence
from typing import Any, TextIO

from spot_callbacks._format import printable
from spot_callbacks.progress import is_terminal


def rich_console(stream: TextIO, *, stderr: bool = False) -> Any:
    """A rich Console on ``stream`` when rich is installed and it is a terminal, else None.

    Piped output stays plain text, so scripts can read it.
    """
    if not is_terminal(stream):
        return None
    try:
        from rich.console import Console
    except ImportError:
        return None
    return Console(file=stream, stderr=stderr, highlight=False)


@contextlib.contextmanager
def busy(message: str) -> Iterator[None]:
    """A spinner on a terminal's stderr while a long transfer runs; nothing otherwise."""
    console = rich_console(sys.stderr, stderr=True)
    if console is None:
        yield
        return
    from rich.markup import escape

    with console.status(escape(message)):
        yield


CHECKPOINT_HEADERS = ("", "STEP", "CREATED (UTC)", "REASON", "SIZE", "FRAMEWORK", "VALID")
CHECKPOINT_RIGHT_ALIGNED = {1, 4}


def plain_table(
    rows: Sequence[tuple[str, ...]],
    headers: tuple[str, ...] = CHECKPOINT_HEADERS,
    right_aligned: set[int] = CHECKPOINT_RIGHT_ALIGNED,
) -> list[str]:
    """``rows`` under ``headers`` as aligned lines of text (columns in ``right_aligned`` right-justified);
    every cell through ``printable`` (a cell may hold a manifest's text).

    Example:
        >>> print("\\n".join(plain_table([("a", "12"), ("bcd", "3")], ("NAME", "N"), right_aligned={1})))
        NAME   N
        a     12
        bcd    3
    """
    rows = [tuple(printable(cell) for cell in row) for row in rows]
    widths = [max(len(row[col]) for row in [headers, *rows]) for col in range(len(headers))]
    lines = []
    for row in [headers, *rows]:
        cells = [
            cell.rjust(widths[col]) if col in right_aligned else cell.ljust(widths[col])
            for col, cell in enumerate(row)
        ]
        lines.append("  ".join(cells).rstrip())
    return lines


def print_rich_table(console: Any, rows: list[tuple[str, ...]], footer: str) -> None:
    """The ``ls`` table on a terminal: the newest valid checkpoint bold, its VALID column coloured."""
    from rich import box
    from rich.table import Table
    from rich.text import Text

    table = Table(caption=footer, caption_justify="left", header_style="bold", box=box.SIMPLE_HEAD)
    for col, header in enumerate(CHECKPOINT_HEADERS):
        # Only the reason may wrap: a cut-off date or size would mislead.
        is_reason = col == len(CHECKPOINT_HEADERS) - 1
        table.add_column(
            header.lower(),
            justify="right" if col in CHECKPOINT_RIGHT_ALIGNED else "left",
            no_wrap=not is_reason,
            overflow="fold",
        )
    for row in rows:
        row = tuple(printable(cell) for cell in row)
        valid = row[-1]
        cells = [Text(cell) for cell in row[:-1]] + [Text(valid, style="green" if valid == "ok" else "red")]
        table.add_row(*cells, style="bold" if row[0] == "*" else None)
    console.print(table)
