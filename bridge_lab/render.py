"""How the lab commands print tables: ``rich`` on a terminal, the same table as plain text everywhere else.

Scripts and tests read their stdout (a summary table, then a JSON line), so output that is not a
terminal carries no colour codes and no line wrapping: a captured table stays one row per line.
"""

from __future__ import annotations

import io
from collections.abc import Iterable, Mapping
from typing import TextIO

from rich.console import Console, RenderableType
from rich.table import Table
from rich.text import Text

PLAIN_WIDTH = 200  # wide enough that no row of ours wraps when the stream is a file or a pipe


def console(stream: TextIO) -> Console:
    """A console on ``stream``: live width and colour on a terminal, plain and unwrapped otherwise."""
    tty = stream.isatty()
    return Console(file=stream, width=None if tty else PLAIN_WIDTH, highlight=False, soft_wrap=not tty)


def show(renderable: RenderableType, stream: TextIO) -> None:
    """Print ``renderable``: styled on a terminal, as ``to_text`` (no padding, no escape codes) otherwise."""
    if stream.isatty():
        console(stream).print(renderable)
    else:
        stream.write(to_text(renderable) + "\n")
    stream.flush()


def to_text(renderable: RenderableType, width: int = PLAIN_WIDTH) -> str:
    """``renderable`` as plain text, for callers that print or assert on a string."""
    buffer = io.StringIO()
    Console(file=buffer, width=width, color_system=None, highlight=False).print(renderable)
    return "\n".join(line.rstrip() for line in buffer.getvalue().splitlines())


def cell(value: object) -> Text:
    """A table cell that shows ``value`` literally: no rich markup parsing of ``[...]`` in errors or URLs."""
    return Text("-" if value is None else str(value))


def key_value_table(rows: Iterable[tuple[str, object]], title: str | None = None) -> Table:
    """Two columns, label and value, no borders: the summary shape of demo and bench."""
    table = Table(title=title, title_justify="left", show_header=False, box=None, pad_edge=False)
    table.add_column("label", style="bold", no_wrap=True)
    table.add_column("value", overflow="fold")
    for label, value in rows:
        table.add_row(cell(label), cell(value))
    return table


def rows_table(rows: Iterable[Mapping[str, object]], columns: Mapping[str, str]) -> Table:
    """One row per mapping, one column per ``columns`` key (its value is the header)."""
    table = Table(box=None, pad_edge=False)
    for header in columns.values():
        table.add_column(header, overflow="fold")
    for row in rows:
        table.add_row(*(cell(row.get(key)) for key in columns))
    return table
