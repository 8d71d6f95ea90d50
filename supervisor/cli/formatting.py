"""How the CLI shows what it got: sizes, durations, tables (client text escaped and
clipped: never a raw control character on the operator's terminal)."""

from __future__ import annotations

import json
import math

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


# A table's columns, kubectl's pattern: the default fits the terminal (80 columns piped) and
# never cuts what an operator types back (a pid, a state, an id); `-o wide` has every column.
KEEP = "keep"  # in the default table, never cut
FLEX = "flex"  # in the default table, cut to fit (a name); cut, its whole value follows on a line of its own
SPILL = "spill"  # in the default table while it fits, else on a line of its own below the row
FIT = "fit"  # in the default table while it fits, else in `-o wide` only
BELOW = "below"  # on a line of its own below the row, when it has something to say
WIDE = "wide"  # in `-o wide` only
FLEX_MIN = 8
FLEX_FIRST = 20  # a name is cut to this before a column that fits leaves the default table
INDENT = "    "


def width() -> int:
    """The terminal's width: $COLUMNS, else the terminal's own; piped, 80 (the default table,
    never one as wide as every column)."""
    import shutil
    return max(40, shutil.get_terminal_size((80, 24)).columns)


def table(columns: list[tuple[str, str]], rows: list[tuple[str, ...]], wide: bool = False) -> None:
    """Print rows under `columns` ((header, KEEP|FLEX|SPILL|FIT|BELOW|WIDE) each): with `wide`,
    every column, a row a line (for grep and awk); else the default table for the terminal."""
    headers = [h for h, _ in columns]
    rows = [tuple(printable(cell) for cell in row) for row in rows]  # names and errors come from clients
    if wide:
        return _print_grid(headers, rows, list(range(len(headers))), _widths(headers, rows))
    limit = width()
    shown = [i for i, (_, kind) in enumerate(columns) if kind in (KEEP, FLEX, SPILL, FIT)]
    widths = _widths(headers, rows)
    flex = [i for i in shown if columns[i][1] == FLEX]
    total = lambda: sum(min(widths[i], FLEX_FIRST) if i in flex else widths[i]  # noqa: E731
                        for i in shown) + 2 * (len(shown) - 1)
    for i in reversed([i for i in shown if columns[i][1] in (SPILL, FIT)]):  # the rightmost go first
        if total() <= limit:
            break
        shown.remove(i)
    total = lambda: sum(widths[i] for i in shown) + 2 * (len(shown) - 1)  # noqa: E731
    for i in flex:  # cut to fit, never below FLEX_MIN (or its header), never widened
        widths[i] = min(widths[i], max(FLEX_MIN, len(headers[i]), widths[i] - max(0, total() - limit)))
    below = [i for i, (_, kind) in enumerate(columns) if i not in shown and kind in (SPILL, BELOW)]
    _print_grid(headers, rows, shown, widths, below, limit)


def _widths(headers: list[str], rows: list[tuple[str, ...]]) -> list[int]:
    return [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(headers)]


def _print_grid(headers, rows, shown, widths, below=(), limit=0) -> None:
    import textwrap

    def line(cells) -> str:
        return "  ".join(c.ljust(widths[i]) for i, c in zip(shown, cells)).rstrip()

    out = [line([headers[i] for i in shown])]
    for row in rows:
        cut = {i: row[i] for i in shown if len(row[i]) > widths[i]}  # FLEX cells only
        out.append(line([row[i][:widths[i] - 1] + "…" if i in cut else row[i] for i in shown]))
        for i in sorted([*cut, *(i for i in below if row[i] not in ("-", ""))]):
            out.extend(textwrap.wrap(f"{headers[i].lower()}: {row[i]}", limit, initial_indent=INDENT,
                                     subsequent_indent=INDENT * 2, break_on_hyphens=False))
    typer.echo("\n".join(out))


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
    # its own lines (those of its runtime's tasks), or its time window's (the note says why)
    whose = (", its " + ", ".join(f"task {task} (slot {slot})" for slot, task in log["tasks"])
             if log.get("by") == "task" else f" (±{story['around_s']:g} s)")
    out.append(f"  log of {clip(log['replica'])}{whose}{note}:" + ("" if log["lines"] else " none"))
    out.extend("    " + printable(line) for line in log["lines"])
    return out
