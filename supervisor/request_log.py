"""The request log: one row per finished inference request, in SQLite in the
state dir, so that it survives a restart of the supervisor.

The event loop never touches the database for a write: `record()` appends a
tuple to a deque (atomic, no lock: well under a microsecond), and one writer
thread wakes every `flush_s`, inserts what has piled up in one transaction,
then trims the table to `max_rows` rows and `days` days. Reads (`query`) open
their own connection and are meant to run in a thread."""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from collections import deque
from pathlib import Path

log = logging.getLogger("llm_pool.request_log")

BODY_CHARS = 4000  # prompt and output, each, when a model sets log_bodies
QUEUE_MAX = 100_000  # rows waiting for the writer; past it rows are dropped (and counted), never blocking
FLUSH_S = 0.1  # how often the writer looks for rows: one commit per burst, visible within this

COLUMNS = ("ts", "model", "endpoint", "status", "error_code", "error_message", "queued_ms", "ttft_ms",
           "duration_ms", "tokens_in", "tokens_out", "prompt", "output", "tenant")
SCHEMA = """
CREATE TABLE IF NOT EXISTS requests (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    ts REAL NOT NULL,            -- unix time the request finished
    model TEXT NOT NULL,
    endpoint TEXT NOT NULL,
    status INTEGER NOT NULL,     -- the HTTP status the client got
    error_code TEXT,
    error_message TEXT,
    queued_ms REAL,              -- admission to hand-over to a worker
    ttft_ms REAL,                -- admission to first token
    duration_ms REAL,            -- admission to the end
    tokens_in INTEGER,
    tokens_out INTEGER,
    prompt TEXT,                 -- only with the model's log_bodies, truncated
    output TEXT,
    tenant TEXT                  -- who asked (a configured tenant name); NULL: refused before a tenant was known
);
CREATE INDEX IF NOT EXISTS requests_ts ON requests (ts);
"""
# columns added since the first schema: a log written by an older version gets them on open
ADDED_COLUMNS = {"tenant": "TEXT"}


def truncate(text: str | None, limit: int = BODY_CHARS) -> str | None:
    if text is None or len(text) <= limit:
        return text
    return text[:limit] + f"... [{len(text) - limit} more characters]"


class RequestLog:
    def __init__(self, path: Path, max_rows: int, days: float, flush_s: float = FLUSH_S) -> None:
        self.path = Path(path)
        self.max_rows = max_rows
        self.days = days
        self.flush_s = flush_s
        self.dropped = 0
        self.written = 0
        self._rows: deque[tuple] = deque()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self._connect() as db:
            db.executescript(SCHEMA)
            have = {row[1] for row in db.execute("PRAGMA table_info(requests)")}
            for column, kind in ADDED_COLUMNS.items():
                if column not in have:
                    db.execute(f"ALTER TABLE requests ADD COLUMN {column} {kind}")
            db.execute("PRAGMA journal_mode=WAL")  # readers do not wait for the writer

    def _connect(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, timeout=10, check_same_thread=False)
        db.row_factory = sqlite3.Row
        # with WAL, NORMAL syncs at checkpoints, not at each commit (ten a second): a crash of
        # the process loses nothing; a power cut may lose the last rows of a log, not corrupt it
        db.execute("PRAGMA synchronous=NORMAL")
        return db

    # -- writing (any thread; cheap on the event loop) ---------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._writer, name="request-log", daemon=True)
        self._thread.start()

    def record(self, **row) -> None:
        """Queue one finished request (keys from COLUMNS; missing ones are NULL)."""
        self.append(tuple(row.get(c) for c in COLUMNS))

    def append(self, row: tuple) -> None:
        """Queue one finished request: a tuple in COLUMNS order."""
        if len(self._rows) >= QUEUE_MAX:  # the disk is stuck: lose log rows, never slow a request
            self.dropped += 1
            return
        self._rows.append(row)

    def close(self, timeout_s: float = 5.0) -> None:
        """Write what is queued, then stop the writer."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout_s)
            self._thread = None

    def _writer(self) -> None:
        db = self._connect()
        insert = f"INSERT INTO requests ({', '.join(COLUMNS)}) VALUES ({', '.join('?' * len(COLUMNS))})"
        while True:
            stopping = self._stop.wait(self.flush_s)
            rows = []
            while self._rows:
                rows.append(self._rows.popleft())
            if rows:
                try:
                    with db:
                        db.executemany(insert, rows)
                        self._trim(db)
                    self.written += len(rows)
                except sqlite3.Error:
                    log.exception("request log: %d rows not written to %s", len(rows), self.path)
            if stopping:
                break
        db.close()

    def _trim(self, db: sqlite3.Connection) -> None:
        """Keep the newest max_rows rows, none older than `days`."""
        db.execute("DELETE FROM requests WHERE ts < ?", (time.time() - self.days * 86400,))
        db.execute("DELETE FROM requests WHERE id <= (SELECT id FROM requests ORDER BY id DESC "
                   "LIMIT 1 OFFSET ?)", (self.max_rows,))

    # -- reading (run in a thread) --------------------------------------------------------------
    def query(self, *, model: str | None = None, status: str | None = None, since: float | None = None,
              after_id: int | None = None, limit: int = 100, tenant: str | None = None) -> list[dict]:
        """Newest first. `status`: an HTTP status, or "ok" (below 400) or "error"."""
        where, args = [], []
        if model:
            where.append("model = ?")
            args.append(model)
        if tenant:
            where.append("tenant = ?")
            args.append(tenant)
        if status == "ok":
            where.append("status < 400")
        elif status == "error":
            where.append("status >= 400")
        elif status:
            where.append("status = ?")
            args.append(int(status))
        if since is not None:
            where.append("ts >= ?")
            args.append(since)
        if after_id is not None:
            where.append("id > ?")
            args.append(after_id)
        sql = "SELECT * FROM requests" + (" WHERE " + " AND ".join(where) if where else "")
        sql += " ORDER BY id DESC LIMIT ?"
        args.append(limit)
        with self._connect() as db:
            rows = [dict(r) for r in db.execute(sql, args)]
        for r in rows:  # output tokens over the whole request (the time to the first one included)
            seconds = (r["duration_ms"] or 0) / 1000
            r["tokens_per_s"] = round(r["tokens_out"] / seconds, 1) if r["tokens_out"] and seconds > 0 else None
        return rows
