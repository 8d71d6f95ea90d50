"""How the CLI shows what it got: sizes, durations, tables (client text escaped and
clipped: never a raw control character on the operator's terminal)."""

from __future__ import annotations

import json
import os

import typer

from supervisor.printable import printable


def size(n: int | None) -> str:
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            break
        value /= 1024
    return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def dash(value) -> str:
    return "-" if value is None else str(value)


def print_json(data) -> None:
    typer.echo(json.dumps(data, indent=2))


def table(headers: list[str], rows: list[tuple[str, ...]]) -> None:
    from rich.console import Console  # here, not at the top: a command that prints no table starts faster
    from rich.table import Table
    from rich.text import Text
    console = Console()
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console.width = 10_000  # piped: one line per row, never wrapped, for grep and awk
    grid = Table(*headers, box=None, pad_edge=False, header_style="bold")
    for row in rows:
        grid.add_row(*(Text(printable(cell)) for cell in row))  # Text: names and errors are not markup
    console.print(grid)


CELL_CHARS = 60  # a client's or runtime's text in a table cell: never wider (--json has it whole)


def clip(text: str | None, limit: int = CELL_CHARS) -> str:
    if not text:
        return "-"
    text = printable(text)
    return text if len(text) <= limit else text[:limit - 1] + "…"


def one_line(text: str | None, limit: int = 120) -> str:
    """An error for a table cell: its first line, clipped."""
    return clip((text or "").strip().splitlines()[0] if (text or "").strip() else None, limit)


def ms(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.0f}ms" if value < 1000 else f"{value / 1000:.2f}s"
