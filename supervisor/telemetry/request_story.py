"""One request's whole story, from its request-log row: how it was admitted (its tenant
and that tenant's limits, the limit it hit when refused), its queue wait, the replica
that served it, its TTFT and tokens, its end, and what happened around it: the
timeline's events of its model from a little before its start to a little after its
end, and the serving replica's log lines from that time. Everything is bounded; `story`
reads files and SQLite, so it runs in a thread (asyncio.to_thread), never on the loop."""

from __future__ import annotations

import os
import re
from datetime import datetime
from pathlib import Path

from protocol.errors import ErrorCode

AROUND_S = 5.0  # events and log lines this long before the request's start and after its end
EVENTS_MAX = 50
LOG_LINES_MAX = 200
LOG_BYTES_MAX = 64 * 1024  # of the lines returned
LOG_READ_MAX = 4 * 2**20  # read from the end of the replica's log at most: older lines are not looked for
LINE_CHARS = 2000
# admission's refusals: the limit the request hit
LIMIT_CODES = {ErrorCode.RATE_LIMIT_EXCEEDED.value, ErrorCode.QUEUE_FULL.value, ErrorCode.QUEUE_TIMEOUT.value,
               ErrorCode.DEADLINE_UNMEETABLE.value}

# the worker's own lines: "2026-12-05 00:13:14,341 model/0#2 INFO ..." (local time, logging's asctime)
_WORKER_STAMP = re.compile(rb"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) ")
# llama-server's: "[llama-server] 0.01.372.141 I ..." (minutes.seconds.ms.us since it started)
_LLAMA_STAMP = re.compile(rb"^\[llama-server\] (\d+)\.(\d\d)\.(\d{3})\.(\d{3}) ")
_LLAMA_START = b"starting llama-server"


def line_times(lines: list[bytes]) -> list[float | None]:
    """Each line's unix time: a worker line's own stamp; a llama-server line's time since
    that server's start (the worker's `starting llama-server` line); any other line the
    time of the stamped line before it. None before the first stamped line."""
    times: list[float | None] = []
    last: float | None = None
    llama_start: float | None = None
    for line in lines:
        worker = _WORKER_STAMP.match(line)
        llama = _LLAMA_STAMP.match(line) if worker is None else None
        if worker is not None:
            try:
                last = datetime.strptime(worker[1].decode(), "%Y-%m-%d %H:%M:%S").timestamp() + int(worker[2]) / 1000
            except ValueError:
                pass
            if _LLAMA_START in line:
                llama_start = last
        elif llama is not None and llama_start is not None:
            minutes, seconds, ms, us = (int(g) for g in llama.groups())
            last = max(last or 0.0, llama_start + minutes * 60 + seconds + ms / 1e3 + us / 1e6)
        times.append(last)
    return times


def log_lines_between(path: Path, since: float, until: float) -> dict:
    """The replica log's lines from `since` to `until` (unix times), the last LOG_LINES_MAX
    of them and LOG_BYTES_MAX at most, read from the last LOG_READ_MAX bytes of the file."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            start = max(0, size - LOG_READ_MAX)
            f.seek(start)
            data = f.read(size - start)
    except OSError as exc:
        return {"lines": [], "note": f"no log: {exc.strerror or exc}"}
    lines = data.split(b"\n")
    if start > 0:
        lines = lines[1:]  # begin at a whole line
    times = line_times(lines)
    picked = [line for line, t in zip(lines, times) if t is not None and since <= t <= until and line.strip()]
    cut = len(picked) > LOG_LINES_MAX
    picked = picked[-LOG_LINES_MAX:]
    out: list[str] = []
    size = 0
    for line in reversed(picked):  # the newest first: the end of a request (a crash) is what matters most
        text = line.decode(errors="replace").rstrip("\r")[:LINE_CHARS]
        size += len(text) + 1
        if size > LOG_BYTES_MAX:
            cut = True
            break
        out.append(text)
    out.reverse()
    note = None
    if cut:
        note = f"the last {len(out)} lines of that time"
    elif not out and start > 0:
        note = f"nothing from that time in the log's last {LOG_READ_MAX // 2**20} MiB"
    return {"lines": out, "note": note}


def story(row: dict, engine, events) -> dict:
    """The story of one request-log row (in a thread). `events`: the EventLog."""
    end = row["ts"]
    begin = end - (row.get("duration_ms") or 0) / 1000
    tenant = row.get("tenant")
    spec = engine.tenants.by_name.get(tenant) if tenant else None
    limits = None if spec is None else {k: v for k, v in (("rpm", spec.spec.rpm), ("tpm", spec.spec.tpm), (
        "max_inflight", spec.spec.max_inflight)) if v}  # the limits its tenant has (0: none)
    refused = row.get("error_code") if row.get("error_code") in LIMIT_CODES else None
    replica = row.get("replica")
    served_by = replica.rsplit("/", 1)[0] if replica else None
    models = sorted({m for m in (row.get("model"), served_by) if m})
    around = events.between(models, begin - AROUND_S, end + AROUND_S, EVENTS_MAX)
    logs = {"replica": replica, "lines": [], "note": "it never reached a replica"}
    index = replica.rsplit("/", 1)[1] if replica else ""
    if served_by in engine.models and index.isdigit():  # the log file of a configured model's replica
        path = engine.log_dir / f"{engine.models[served_by].cfg.name}-{int(index)}.log"
        logs = {"replica": replica, **log_lines_between(path, begin - AROUND_S, end + AROUND_S)}
    elif replica:
        logs["note"] = f"model {served_by} is no longer configured"
    return {
        "request_id": row.get("request_id"), "started": round(begin, 3), "ended": end,
        "admission": {"tenant": tenant, "limits": limits, "refused_by": refused},
        "queue_wait_ms": row.get("queued_ms"), "replica": replica, "ttft_ms": row.get("ttft_ms"),
        "duration_ms": row.get("duration_ms"),
        "tokens": {"in": row.get("tokens_in"), "out": row.get("tokens_out"), "cached": row.get("cached_tokens")},
        "end": {"status": row["status"], "error_code": row.get("error_code"),
                "error_message": row.get("error_message"), "fallback_chain": row.get("fallback_chain")},
        "around_s": AROUND_S, "events": around, "log": logs,
    }
