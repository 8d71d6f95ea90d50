"""The event timeline: what happened to the pool's models and replicas (loads,
unloads, evictions, crashes, restarts, reloads, moves to fatal or degraded),
and who asked for it. One call, `emit`, writes the supervisor's log line and
the timeline's row, so the two always say the same thing.

Rows go to SQLite (`events.sqlite3` beside the request log) through the same
batched writer as the request log's (sqlite_writer.BatchWriter): the event
loop queues a row, the writer thread inserts and trims to EVENTS_MAX_ROWS;
reads run in a thread."""

from __future__ import annotations

import logging
import sqlite3
from contextlib import closing
from enum import StrEnum
from pathlib import Path

from supervisor.sqlite_writer import BatchWriter, insert_rows

log = logging.getLogger("llm_pool.events")
log.setLevel(logging.INFO)  # the timeline records every event, whatever the console's level

EVENTS_MAX_ROWS = 20_000
MESSAGE_CHARS = 2000  # an event's text (a runtime's last words can be long)
NAME_CHARS = 200
QUEUE_MAX = 10_000  # rows waiting for the writer; past it rows are dropped (and counted)
FLUSH_S = 0.1


class EventKind(StrEnum):
    LOADING = "loading"
    LOADED = "loaded"
    LOAD_FAILED = "load_failed"
    UNLOADING = "unloading"
    UNLOADED = "unloaded"
    EVICTED = "evicted"
    CRASHED = "crashed"
    FATAL = "fatal"
    RESTARTING = "restarting"
    RESTARTED = "restarted"
    RESTART_FAILED = "restart_failed"
    RELOADED = "reloaded"
    UNLOAD_UNDONE = "unload_undone"  # loaded on demand soon after an operator's unload: it achieved nothing
    STATE = "state"  # a model's shown state changed (degraded, failed, recovered)
    # the supervisor itself: its process started, its start-up loads settled, its stop began, it stopped
    STARTED = "started"
    READY = "ready"
    STOPPING = "stopping"
    STOPPED = "stopped"


def tenant_actor(tenant: str) -> str:
    """The actor of an event a tenant's request caused (a load on demand): the tenant by
    its configured name, never its key."""
    return f"tenant {tenant}"


def emit(kind: EventKind, message: str, *, model: str | None = None, replica: int | None = None,
         by: str | None = None, level: int = logging.INFO) -> None:
    """Log the event (the supervisor's log) and record it (the timeline)."""
    who = f" (asked by {by})" if by else ""
    log.log(level, "%s%s", message, who,
            extra={"pool_event": {"kind": str(kind), "model": model, "replica": replica, "by": by,
                                  "message": message}})


FOLD_WINDOW_S = 120.0  # a repeat this soon after the last of its kind folds into it (a crash loop)
_FOLD_KEY = ("kind", "level", "model", "replica", "by", "message")


class Folder:
    """Repeats folded as they come: an event the same as one at most `window_s` before it
    (kind, level, model, replica, who asked, message), whatever came between, joins that
    one's folded row, which takes its id and time and counts it (`count`, and `first_ts`,
    the first repeat's time): "crashed x6 over 15 s". `llm-pool events -f` folds with it as
    events arrive; `fold` folds a page of them."""

    def __init__(self, window_s: float = FOLD_WINDOW_S) -> None:
        self.window_s = window_s
        self.latest: dict[tuple, dict] = {}  # per key, its folded row

    @staticmethod
    def key(row: dict) -> tuple:
        """What makes two events repeats of each other."""
        return tuple(row.get(k) for k in _FOLD_KEY)

    def seen(self, folded: dict) -> None:
        """A row folded before (GET /admin/events?fold=true): a repeat of it counts on."""
        self.latest[self.key(folded)] = folded

    def prune(self, now_ts: float) -> None:
        """Forget rows no repeat can join any more (their window has passed): a long follow stays small."""
        self.latest = {k: row for k, row in self.latest.items() if now_ts - row["ts"] <= self.window_s}

    def add(self, row: dict) -> tuple[dict, bool]:
        """(the row's folded row, whether that row is new: not a repeat)."""
        key = self.key(row)
        last = self.latest.get(key)
        if last is not None and row["ts"] - last["ts"] <= self.window_s:
            last.update(id=row["id"], ts=row["ts"], count=last["count"] + 1)
            return last, False
        # the first of its kind, or one after a quiet window: a row of its own
        new = self.latest[key] = {**row, "count": 1, "first_ts": row["ts"]}
        return new, True


def fold(rows: list[dict], window_s: float = FOLD_WINDOW_S) -> list[dict]:
    """Rows (oldest first) with each run of repeats folded into one (Folder), each in the
    place of its newest repeat."""
    folder = Folder(window_s)
    out = [folded for folded, new in map(folder.add, rows) if new]
    return sorted(out, key=lambda f: f["id"])


def clip(text: str | None, limit: int) -> str | None:
    if text is None or len(text) <= limit:
        return text
    return text[:limit] + f"... [{len(text) - limit} more characters]"


COLUMNS = ("ts", "kind", "level", "model", "replica", "by", "message")
SCHEMA = """
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    ts REAL NOT NULL,      -- unix time
    kind TEXT NOT NULL,    -- EventKind
    level TEXT NOT NULL,   -- info, warning, error
    model TEXT,
    replica INTEGER,
    by TEXT,               -- who asked: cli, page, admin key, api, tenant NAME, idle timer, memory budget, ...
    message TEXT NOT NULL
);
"""


class EventLog(logging.Handler):
    """A logging handler on `llm_pool.events` that keeps the events in SQLite."""

    def __init__(self, path: Path, max_rows: int = EVENTS_MAX_ROWS, flush_s: float = FLUSH_S) -> None:
        super().__init__(level=logging.INFO)
        self.path = Path(path)
        self.max_rows = max_rows
        self._writer = BatchWriter("event-log", self.path, self._connect, self._write, queue_max=QUEUE_MAX,
                                   flush_s=flush_s)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with closing(self._connect()) as db:
            db.executescript(SCHEMA)
            db.execute("PRAGMA journal_mode=WAL")

    def _connect(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, timeout=10, check_same_thread=False)
        db.row_factory = sqlite3.Row
        db.execute("PRAGMA synchronous=NORMAL")
        return db

    # -- writing ------------------------------------------------------------------------------
    @property
    def dropped(self) -> int:
        """Events lost because QUEUE_MAX were waiting for the disk."""
        return self._writer.dropped

    def start(self) -> None:
        self._writer.start()
        log.addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:  # logging.Handler's hook: no I/O here
        event = getattr(record, "pool_event", None)
        if event is None:
            return
        self._writer.put((record.created, event["kind"], record.levelname.lower(),
                           clip(event["model"], NAME_CHARS), event["replica"], clip(event["by"], NAME_CHARS),
                           clip(event["message"], MESSAGE_CHARS)))

    def close(self) -> None:
        log.removeHandler(self)
        self._writer.close()
        super().close()

    def _write(self, db: sqlite3.Connection, rows: list[tuple]) -> None:  # the writer thread, in a transaction
        insert_rows(db, "events", COLUMNS, rows)
        db.execute("DELETE FROM events WHERE id <= (SELECT id FROM events ORDER BY id DESC LIMIT 1 OFFSET ?)",
                   (self.max_rows,))

    # -- reading (in a thread) ------------------------------------------------------------------
    def query(self, *, after_id: int | None = None, model: str | None = None, limit: int = 100) -> list[dict]:
        """Oldest first: the `limit` events after `after_id`, or (without it) the newest `limit`."""
        where, args = [], []
        if model:
            where.append("model = ?")
            args.append(model)
        if after_id is not None:
            where.append("id > ?")
            args.append(after_id)
        sql = "SELECT * FROM events" + (" WHERE " + " AND ".join(where) if where else "")
        sql += " ORDER BY id " + ("ASC" if after_id is not None else "DESC") + " LIMIT ?"
        args.append(limit)
        with closing(self._connect()) as db:
            rows = [dict(r) for r in db.execute(sql, args)]
        return rows if after_id is not None else rows[::-1]

    def between(self, models: list[str], since: float, until: float, limit: int) -> list[dict]:
        """Oldest first: at most `limit` events of these models, and the supervisor's own
        (no model), from `since` to `until` (unix times): what happened around one request."""
        marks = ",".join("?" * len(models))
        sql = (f"SELECT * FROM events WHERE ts BETWEEN ? AND ? AND (model IS NULL"
               f"{f' OR model IN ({marks})' if models else ''}) ORDER BY id LIMIT ?")
        with closing(self._connect()) as db:
            return [dict(r) for r in db.execute(sql, (since, until, *models, limit))]
