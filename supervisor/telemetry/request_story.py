"""One request's whole story, from its request-log row: how it was admitted (its tenant
and that tenant's limits, the limit it hit when refused), its queue wait, the replica
that served it, its TTFT and tokens, its end, and what happened around it: the
timeline's events of its model from a little before its start to a little after its
end, and the serving replica's log lines of it. Everything is bounded; `story` reads files
and SQLite, so it runs in a thread (asyncio.to_thread), never on the loop.

Its log lines: where its runtime said which of its tasks served it (the row's
runtime_tasks: llama-server's `id N | task T`, runtime_worker/llama_tasks.py), the lines
of those tasks in that runtime's run (from the worker's `starting llama-server` line that
started it), the line before each task's start that chose its slot, and the worker's
warnings and errors from the request's time (a crash); else, the lines of its time window,
which say so, for they hold other requests' lines too."""

from __future__ import annotations

import os
import re
from datetime import datetime
from pathlib import Path

from protocol.errors import ErrorCode
from supervisor.telemetry.request_log import parse_tasks

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
# llama-server's slot lines: "slot launch_slot_: id  1 | task 7 | processing task" (task -1: none yet)
_SLOT_TASK = re.compile(rb"^\[llama-server\] \S+ \S+ slot +\S+: id +(\d+) \| task (-?\d+) \| ")
# the worker's own warnings and errors (a crash, a stall): the replica's, not another request's
_WORKER_TROUBLE = re.compile(rb"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} \S+ (WARNING|ERROR|CRITICAL) ")


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


def _log_tail(path: Path) -> tuple[list[bytes], bool] | str:
    """The whole lines of the last LOG_READ_MAX bytes of the log, and whether that is not
    all of it; or why there are none."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            start = max(0, size - LOG_READ_MAX)
            f.seek(start)
            data = f.read(size - start)
    except OSError as exc:
        return f"no log: {exc.strerror or exc}"
    lines = data.split(b"\n")
    return (lines[1:] if start > 0 else lines), start > 0  # begin at a whole line


def log_lines_between(path: Path, since: float, until: float) -> dict:
    """The replica log's lines from `since` to `until` (unix times), the last LOG_LINES_MAX
    of them and LOG_BYTES_MAX at most, read from the last LOG_READ_MAX bytes of the file."""
    tail = _log_tail(path)
    if isinstance(tail, str):
        return {"lines": [], "note": tail}
    lines, partial = tail
    times = line_times(lines)
    picked = [line for line, t in zip(lines, times) if t is not None and since <= t <= until and line.strip()]
    return _bounded(picked, f"nothing from that time in the log's last {LOG_READ_MAX // 2**20} MiB"
                    if partial else None)


def _starts(line: bytes) -> bool:
    """The worker's line that starts a llama-server: a new run, whose task ids begin at 0."""
    return _LLAMA_START in line and _WORKER_STAMP.match(line) is not None


def task_lines(path: Path, tasks: list[tuple[int, int]], served_at: float, since: float, until: float) -> dict:
    """The replica log's lines of the runtime's `tasks` ((slot, task id) pairs) in the run of
    the runtime that was up when the request was handed to it (`served_at`; task ids begin
    again at each start), each task's slot choice (its slot's line with no task yet, right
    before the task's start), and the worker's warnings and errors from `since` to `until`
    (a crash); bounded as log_lines_between."""
    tail = _log_tail(path)
    if isinstance(tail, str):
        return {"lines": [], "note": tail}
    lines, partial = tail
    times = line_times(lines)
    run = 0  # where the run that served it begins: after its start line (else the tail's start)
    for i, (line, t) in enumerate(zip(lines, times)):
        if t is not None and t > served_at:
            break
        if _starts(line):
            run = i + 1
    wanted = set(tasks)
    picked: list[bytes] = []
    choice: dict[int, bytes] = {}  # slot -> its last line with no task, until a task of it starts
    for line, t in zip(lines[run:], times[run:]):
        if _starts(line):
            break  # the next run: its task ids are others'
        slot_line = _SLOT_TASK.search(line)
        if slot_line is not None:
            slot, task = int(slot_line[1]), int(slot_line[2])
            if task < 0:
                choice[slot] = line
            else:
                if (slot, task) in wanted:
                    if slot in choice:
                        picked.append(choice[slot])
                    picked.append(line)
                choice.pop(slot, None)
        elif _WORKER_TROUBLE.match(line) and t is not None and since <= t <= until:
            picked.append(line)
    found = {(int(m[1]), int(m[2])) for m in map(_SLOT_TASK.search, picked) if m is not None}
    missing = wanted - found
    return _bounded(picked, None if not missing else "nothing of task " + ", ".join(
        str(task) for _, task in sorted(missing)) + (f" in the log's last {LOG_READ_MAX // 2**20} MiB"
                                                     if partial else " in the log"))


def _bounded(picked: list[bytes], empty_note: str | None) -> dict:
    """The last LOG_LINES_MAX of `picked`, LOG_BYTES_MAX at most, as text; with a note."""
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
    note = empty_note
    if cut:
        note = f"its last {len(out)} lines"
    return {"lines": out, "note": note}


def replica_lines(path: Path, backend: str, tasks: list[tuple[int, int]], begin: float, served_at: float,
                  end: float) -> dict:
    """The request's lines of its replica's log: `by` "task" (those of its runtime's tasks)
    where the runtime said which they were, else "window" (all lines of its time, and why).
    `served_at`: when it was handed to the replica."""
    if tasks:
        return {"by": "task", "tasks": [list(pair) for pair in tasks],
                **task_lines(path, tasks, served_at, begin - AROUND_S, end + AROUND_S)}
    found = log_lines_between(path, begin - AROUND_S, end + AROUND_S)
    why = ("llama-server did not say which of its tasks was this request's" if backend == "llama_server"
           else f"the {backend} runtime names no task of a request")
    return {"by": "window", "tasks": [], "lines": found["lines"],
            "note": f"lines by time window, other requests' among them: {why}"
                    + (f"; {found['note']}" if found["note"] else "")}


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
    logs = {"replica": replica, "by": None, "tasks": [], "lines": [], "note": "it never reached a replica"}
    index = replica.rsplit("/", 1)[1] if replica else ""
    if served_by in engine.models and index.isdigit():  # the log file of a configured model's replica
        cfg = engine.models[served_by].cfg
        logs = {**logs, **replica_lines(engine.log_dir / f"{cfg.name}-{int(index)}.log", cfg.backend,
                                        parse_tasks(row.get("runtime_tasks")), begin,
                                        begin + (row.get("queued_ms") or 0) / 1000, end)}
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
