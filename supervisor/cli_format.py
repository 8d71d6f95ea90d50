"""How the CLI shows what it got: sizes, durations, tables (client text escaped and
clipped: never a raw control character on the operator's terminal)."""

from __future__ import annotations

import json
import math
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


def planned_unload(unloading: dict) -> str:
    """An unload under way, in words: why, and what its drain still waits for."""
    why = one_line(str(unloading.get("why") or "unloaded"), 80)
    draining, left = unloading.get("draining") or 0, unloading.get("drain_left_s")
    if not draining:
        return why
    return f"{why}; {draining} request{'s' if draining != 1 else ''} draining" + (
        f", at most {math.ceil(left)}s more" if isinstance(left, (int, float)) else "")


def ms(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.0f}ms" if value < 1000 else f"{value / 1000:.2f}s"


def story_lines(row: dict, story: dict) -> list[str]:
    """One request's story (GET /admin/requests/story) as the lines `requests --id` prints."""
    import time

    def at(t: float) -> str:
        return time.strftime("%H:%M:%S", time.localtime(t)) + f".{int(t * 1000) % 1000:03d}"

    admission, tokens, end = story["admission"], story["tokens"], story["end"]
    limits = admission["limits"]
    shown_limits = ", ".join(f"{k} {v}" for k, v in limits.items()) if limits else "no limits"
    refused = f"; refused: {admission['refused_by']}" if admission["refused_by"] else ""
    out = [f"request {clip(story['request_id'])} (row {row['id']}): {clip(row['model'])} {clip(row['endpoint'])}",
           f"  started {at(story['started'])}, ended {at(story['ended'])} ({ms(story['duration_ms'])})",
           f"  admission: tenant {clip(admission['tenant'])} ({shown_limits}){refused}",
           f"  queue wait {ms(story['queue_wait_ms'])}, replica {clip(story['replica'])}, TTFT {ms(story['ttft_ms'])}",
           f"  tokens: {dash(tokens['in'])} in (cached {dash(tokens['cached'])}), {dash(tokens['out'])} out",
           f"  end: HTTP {end['status']} {clip(end['error_code'])}: {one_line(end['error_message'], 200)}"]
    if end.get("fallback_chain"):
        out.append(f"  fell back: {clip(end['fallback_chain'], 200)}")
    out.append(f"  events (±{story['around_s']:g} s):" + ("" if story["events"] else " none"))
    for e in story["events"]:
        where = (e["model"] or "-") + (f"/{e['replica']}" if e.get("replica") is not None else "")
        out.append(f"    {at(e['ts'])} {e['level']} {e['kind']} {clip(where)}: {one_line(e['message'], 300)}")
    log = story["log"]
    note = f" ({printable(log['note'])})" if log.get("note") else ""
    out.append(f"  log of {clip(log['replica'])} (±{story['around_s']:g} s){note}:"
               + ("" if log["lines"] else " none"))
    out.extend("    " + printable(line) for line in log["lines"])
    return out
