"""Admin routes for watching the pool: the request log (JSON), and two SSE
feeds, the live samples and the live tail of one replica's log. Under
/admin/, so the admin key and the cross-site checks apply to them as to the
other admin routes. The engine and the Activity come from app.state."""

from __future__ import annotations

import asyncio
import json
import os
import re
import time
from datetime import datetime, timezone

from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse

from protocol.errors import ErrorCode, PoolError
from supervisor.telemetry import request_story
from supervisor.edge.request_ids import MAX_CHARS as MAX_ID_CHARS
from supervisor.edge.streams import SSE_HEADERS
from supervisor.events import fold as fold_events

router = APIRouter()

TAIL_POLL_S = 0.25  # how often the log tail looks for new lines
TAIL_FIRST_LINES = 200
TAIL_READ_MAX = 256 * 1024  # bytes read per look: a log that floods is skipped ahead, not buffered
QUIET_PING_S = 5.0  # a comment line when nothing was sent for this long (also finds a client gone)


CLIENT_HEADER = "x-llm-pool-client"  # who asks, for the event timeline: the CLI and the page send it


def asked_by(request: Request) -> str:
    """Who asked for an admin action: `cli`, `page` (their header), else `admin key` (a
    caller of the API with the admin key), or `api` on a pool with no admin key. Admin
    routes take only the admin key: a tenant's key never gets here (tenants show up as the
    actor of what their requests cause, a load on demand: events.tenant_actor)."""
    said = request.headers.get(CLIENT_HEADER, "")
    if re.fullmatch(r"[a-z][a-z0-9-]{0,19}", said):
        return said
    return "admin key" if request.app.state.engine.tenants.admin_key else "api"


def _event(name: str, data) -> bytes:
    return f"event: {name}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


def _since(value: str | None) -> float | None:
    """Unix seconds, or an ISO 8601 time (UTC when it names no zone)."""
    if value is None or value == "":
        return None
    try:
        return float(value)
    except ValueError:
        pass
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        raise PoolError(ErrorCode.INVALID_REQUEST, "since: unix seconds or an ISO 8601 time",
                        param="since") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return moment.timestamp()


ROW_ID_MAX = 2**63 - 1  # SQLite's integer range: a bigger number is the client's 400


@router.get("/admin/requests")
async def admin_requests(request: Request, model: str | None = Query(None, max_length=1000),
                         status: str | None = None, since: str | None = None,
                         after_id: int | None = Query(None, ge=0, le=ROW_ID_MAX),
                         before_id: int | None = Query(None, ge=0, le=ROW_ID_MAX),
                         limit: int = Query(100, ge=1, le=10_000),
                         tenant: str | None = Query(None, max_length=64),
                         id: str | None = Query(None, max_length=MAX_ID_CHARS)):
    """The newest finished requests first, from the request log: one page of at most
    `limit` rows and about request_log.QUERY_MAX_BYTES. `more` says whether older
    rows match (ask again with before_id = the last row's id); with after_id, the
    page holds the oldest rows after it (ask again with after_id = the first row's id).
    `status`: an HTTP status, a class (4xx), 'ok' or 'error'. `id`: the rows of that request
    id (the x-request-id of its answer)."""
    if status not in (None, "", "ok", "error", "2xx", "3xx", "4xx", "5xx") and not (
            status.isascii() and status.isdigit() and 100 <= int(status) <= 599):
        raise PoolError(ErrorCode.INVALID_REQUEST, "status: an HTTP status, a class (4xx), 'ok' or 'error'",
                        param="status")
    log = request.app.state.activity.requests
    rows, more = await asyncio.to_thread(log.page, model=model, status=status or None, since=_since(since),
                                         after_id=after_id, before_id=before_id, limit=limit,
                                         tenant=tenant, request_id=id)
    return {"requests": rows, "more": more, "dropped": log.dropped}


# the newest rows of one request id, of each tenant (a client may send the same id again; a tenant's
# id is its own, so that another tenant sending it pushes out none of its rows), and in all
STORIES_MAX = 5
STORIES_MAX_ROWS = 50


@router.get("/admin/requests/story")
async def admin_request_story(request: Request, id: str | None = Query(None, max_length=MAX_ID_CHARS),
                              row: int | None = Query(None, ge=0, le=ROW_ID_MAX)):
    """The whole story of a request (request_story.py): of the row `row`, or of the newest
    rows with request id `id` (STORIES_MAX of each tenant's)."""
    if (id is None) == (row is None):
        raise PoolError(ErrorCode.INVALID_REQUEST, "name a request: id (its x-request-id) or row", param="id")
    activity = request.app.state.activity
    if row is not None:
        rows, _ = await asyncio.to_thread(activity.requests.page, after_id=row - 1, limit=1)
        rows = [r for r in rows if r["id"] == row]
    else:
        rows = await asyncio.to_thread(activity.requests.newest_of_id, id, STORIES_MAX, STORIES_MAX_ROWS)
    engine = request.app.state.engine
    stories = [await asyncio.to_thread(request_story.story, r, engine, activity.events) for r in rows]
    return {"stories": [{"row": r, "story": s} for r, s in zip(rows, stories)]}


@router.get("/admin/requests/summary")
async def admin_requests_summary(request: Request, window_s: float = Query(300, gt=0, le=86400)):
    """The error rates over the last `window_s` seconds, the client's (4xx: a bad request, a
    refused key, a limit, a client that left) apart from the pool's (5xx), the tenants with
    the most errors, and the requests in flight now with their age."""
    activity = request.app.state.activity
    since = time.time() - window_s
    counts = await asyncio.to_thread(activity.requests.counts_since, since)
    tenants = await asyncio.to_thread(activity.requests.error_tenants_since, since)
    total = sum(counts.values())
    by_class = {f"{c}xx": sum(n for st, n in counts.items() if st // 100 == c) for c in (2, 4, 5)}
    errors = sum(n for status, n in counts.items() if status >= 400)
    rate = lambda n: round(n / total, 4) if total else None  # noqa: E731
    return {"window_s": window_s, "requests": total, "errors": errors, "error_rate": rate(errors),
            "client_errors": by_class["4xx"], "client_error_rate": rate(by_class["4xx"]),
            "server_errors": by_class["5xx"], "server_error_rate": rate(by_class["5xx"]),
            "by_class": by_class, "error_tenants": tenants, "in_flight": activity.in_flight()}


@router.get("/admin/events")
async def admin_events(request: Request, after_id: int | None = None, model: str | None = None,
                       limit: int = Query(100, ge=1, le=10_000), fold: bool = False):
    """The event timeline, oldest first: the `limit` events after `after_id` (page on with the
    last id), or the newest `limit` without it. `fold`: repeats within events.FOLD_WINDOW_S
    fold into one row (`count`, `first_ts`), a crash loop's crashes among them."""
    events = request.app.state.activity.events
    rows = await asyncio.to_thread(events.query, after_id=after_id, model=model, limit=limit)
    last_id = rows[-1]["id"] if rows else after_id
    return {"events": fold_events(rows) if fold else rows, "last_id": last_id, "dropped": events.dropped}


@router.get("/admin/logs/supervisor")
async def admin_supervisor_log(request: Request, after: int = 0, lines: int = Query(200, ge=1, le=10_000)):
    """The supervisor's own log, its last lines (`after`: only lines after that serial)."""
    tail = request.app.state.activity.supervisor_log
    got = tail.after(after, lines)
    return {"lines": [text for _, text in got], "last": got[-1][0] if got else after}


@router.get("/admin/logs/supervisor/live")
async def admin_supervisor_log_live(request: Request, lines: int = Query(TAIL_FIRST_LINES, ge=0, le=10_000)):
    """SSE: `lines` events, the supervisor log's last `lines` lines, then new ones as they come."""
    engine, tail = request.app.state.engine, request.app.state.activity.supervisor_log

    async def body():
        got = tail.after(0, lines) if lines else []
        last = got[-1][0] if got else tail.serial
        if got:
            yield _event("lines", [text for _, text in got])
        quiet = 0.0
        while not engine.shutting_down:
            await asyncio.sleep(TAIL_POLL_S)
            quiet += TAIL_POLL_S
            got = tail.after(last, 1000)
            if got:
                last = got[-1][0]
                yield _event("lines", [text for _, text in got])
                quiet = 0.0
            elif quiet >= QUIET_PING_S:
                yield b": ping\n\n"
                quiet = 0.0

    return StreamingResponse(body(), media_type="text/event-stream", headers=SSE_HEADERS)


@router.get("/admin/live")
async def admin_live(request: Request):
    """SSE: `history` (the samples of the last ten minutes), then one `sample` a second."""
    activity, engine = request.app.state.activity, request.app.state.engine

    async def body():
        watcher = activity.watch()
        try:
            yield _event("history", list(activity.samples))
            while not engine.shutting_down:
                try:
                    sample = await asyncio.wait_for(watcher.get(), QUIET_PING_S)
                except TimeoutError:
                    yield b": ping\n\n"
                    continue
                yield _event("sample", sample)
        finally:
            activity.unwatch(watcher)

    return StreamingResponse(body(), media_type="text/event-stream", headers=SSE_HEADERS)


@router.get("/admin/models/{name}/logs/live")
async def admin_log_live(request: Request, name: str, replica: int = 0,
                         lines: int = Query(TAIL_FIRST_LINES, ge=0, le=10_000)):
    """SSE: `lines` events, first the log's last `lines` lines, then each new line as
    it is written (the file is followed across a restart that truncates it)."""
    engine = request.app.state.engine
    entry = engine.entry(name)
    if not 0 <= replica < entry.cfg.replicas:
        raise PoolError(ErrorCode.INVALID_REQUEST, f"replica: model {name!r} has replicas 0 to "
                        f"{entry.cfg.replicas - 1}", param="replica")
    path = engine.log_dir / f"{entry.cfg.name}-{replica}.log"

    async def body():
        position, partial, quiet = None, b"", 0.0
        while not engine.shutting_down:
            chunk, position, restarted = _read_new(path, position, lines)
            if restarted:
                partial = b""
            *complete, partial = (partial + chunk).split(b"\n")
            if complete:
                yield _event("lines", [c.decode(errors="replace").rstrip("\r") for c in complete])
                quiet = 0.0
            elif quiet >= QUIET_PING_S:
                yield b": ping\n\n"
                quiet = 0.0
            await asyncio.sleep(TAIL_POLL_S)
            quiet += TAIL_POLL_S

    return StreamingResponse(body(), media_type="text/event-stream", headers=SSE_HEADERS)


def _read_new(path, position: int | None, first_lines: int) -> tuple[bytes, int | None, bool]:
    """What was appended to `path` since `position` (None: the first look, which
    returns about the last `first_lines` lines). A file that shrank was started
    again: read it from its start."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            restarted = position is not None and size < position
            if position is None:
                start = max(0, size - 256 * first_lines) if first_lines else size
                f.seek(start)
                data = f.read(size - start)
                if start > 0:  # begin at a whole line
                    data = data[data.find(b"\n") + 1:]
                data = b"\n".join(data.split(b"\n")[-first_lines - 1:]) if first_lines else b""
                return data, size, False
            start = 0 if restarted else position
            if size - start > TAIL_READ_MAX:
                start = size - TAIL_READ_MAX
            f.seek(start)
            data = f.read(size - start)
            return data, start + len(data), restarted
    except OSError:  # not there (yet, or any more), or its directory is gone: nothing new to show
        return b"", position, False
