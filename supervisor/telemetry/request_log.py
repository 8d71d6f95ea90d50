"""The request log: one row per finished inference request, in SQLite in the
state dir, so that it survives a restart of the supervisor.

The event loop never touches the database for a write: `record()` queues a
tuple (its text columns printable, as printable.py says, and cut to TEXT_LIMITS) for the shared batched writer
(sqlite_writer.BatchWriter), which every `flush_s` inserts what has piled up
in one transaction, trims the table to `max_rows` rows, `days` days and about
`max_bytes` bytes of data, and gives freed pages back to the file system
(auto_vacuum = INCREMENTAL). Reads (`query`) open their own connection and are meant to run
in a thread; one answer holds at most QUERY_MAX_BYTES of rows (and says
where the next page starts)."""

from __future__ import annotations

import logging
import sqlite3
import time
from contextlib import closing
from pathlib import Path

from supervisor.printable import printable
from supervisor.sqlite_writer import BatchWriter, insert_rows

log = logging.getLogger("llm_pool.request_log")

BODY_CHARS = 4000  # prompt and output, each, when a model sets log_bodies
QUEUE_MAX = 100_000  # rows waiting for the writer; past it rows are dropped (and counted), never blocking
FLUSH_S = 0.1  # how often the writer looks for rows: one commit per burst, visible within this
DEFAULT_MAX_BYTES = 64 * 2**20  # [server] request_log_max_bytes
QUERY_MAX_BYTES = 4 * 2**20  # the rows of one /admin/requests answer, about (the page polls it every second)
WAL_MAX_BYTES = 4 * 2**20  # the write-ahead log is cut back to this after a checkpoint
# requests refused for their API key (401) get rows at most this many a second (a burst of as many),
# so that a flood of bad keys cannot push the operator's history out; metrics count every one
REFUSED_ROWS_PER_S = 10

COLUMNS = ("ts", "model", "endpoint", "status", "error_code", "error_message", "queued_ms", "ttft_ms",
           "duration_ms", "tokens_in", "tokens_out", "prompt", "output", "tenant", "cached_tokens",
           "runtime_prefill_tps", "runtime_decode_tps", "request_id", "replica", "fallback_chain", "skipped_tools",
           "runtime_tasks")
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
    tenant TEXT,                 -- who asked (a configured tenant name); NULL: refused before a tenant was known
    cached_tokens INTEGER,       -- of tokens_in, from the runtime's prompt cache; NULL: the runtime did not say
    runtime_prefill_tps REAL,    -- prompt tokens/s and output tokens/s as the runtime timed them
    runtime_decode_tps REAL,     -- (llama-server's timings); NULL: it gave none
    request_id TEXT,             -- the answer's x-request-id (the client's own when it sent a safe one)
    replica TEXT,                -- the replica that served it (model/index); NULL: it never reached one
    fallback_chain TEXT,         -- the models tried when another served it: "a (queue_full) -> b"
    skipped_tools TEXT,          -- a Responses body's tools the pool left out (no local meaning): "web_search, ..."
    runtime_tasks TEXT           -- the runtime's tasks that served it, "slot:task" ("1:7,0:8"; llama-server's
                                 -- `id 1 | task 7`); NULL: its runtime did not say which
);
CREATE INDEX IF NOT EXISTS requests_ts ON requests (ts);
"""
# after ADDED_COLUMNS: a log written by an older version has no request_id column before that
INDEXES = "CREATE INDEX IF NOT EXISTS requests_request_id ON requests (request_id);"
# Each stored text column is cut to this many characters (what runs past says how much more)
TEXT_LIMITS = {"model": 200, "endpoint": 64, "error_code": 64, "error_message": 1024, "tenant": 200,
               "request_id": 128, "replica": 220, "fallback_chain": 1024, "skipped_tools": 400,
               "runtime_tasks": 1500,
               "prompt": BODY_CHARS + 64, "output": BODY_CHARS + 64}  # room for truncate()'s note
_LIMITS = tuple(TEXT_LIMITS.get(name) for name in COLUMNS)  # None: not a text column
_KEEP = tuple("\n\t" if name in ("prompt", "output") else "" for name in COLUMNS)
# text the pool itself wrote, or checked on the way in, is not looked at again: the endpoint's label
# (metrics.ENDPOINTS), the tenant's and the replica's configured names, a request id (a client's
# only when printable ASCII: request_ids._SAFE), the runtime's task numbers
_POOL_MADE = frozenset({"endpoint", "tenant", "replica", "request_id", "runtime_tasks"})
_TEXT = tuple((i, limit, keep) for i, (name, limit, keep) in enumerate(zip(COLUMNS, _LIMITS, _KEEP))
              if limit and name not in _POOL_MADE)  # (column, its limit, kept)
# columns added since the first schema: a log written by an older version gets them on open
# tenant: also "(unknown key)" (tenants.UNKNOWN_KEY) for a 401 whose key no tenant holds; NULL with no key
ADDED_COLUMNS = {"tenant": "TEXT", "cached_tokens": "INTEGER", "runtime_prefill_tps": "REAL",
                 "runtime_decode_tps": "REAL", "request_id": "TEXT", "replica": "TEXT", "fallback_chain": "TEXT",
                 "skipped_tools": "TEXT", "runtime_tasks": "TEXT"}


def tasks_text(tasks: list | None) -> str | None:
    """A job's runtime tasks ([slot, task id] pairs) as the runtime_tasks column holds them."""
    return ",".join(f"{slot}:{task}" for slot, task in tasks) if tasks else None


def parse_tasks(text: str | None) -> list[tuple[int, int]]:
    """The runtime_tasks column back as (slot, task id) pairs; [] for NULL or anything else."""
    pairs = []
    for item in (text or "").split(","):
        slot, _, task = item.partition(":")
        if not (slot.isdigit() and task.isdigit()):
            return []
        pairs.append((int(slot), int(task)))
    return pairs


def truncate(text: str | None, limit: int = BODY_CHARS) -> str | None:
    if text is None or len(text) <= limit:
        return text
    return text[:limit] + f"... [{len(text) - limit} more characters]"


def phase_speeds(r: dict) -> dict:
    """Prefill (prompt tokens from hand-over to the first token) and decode (output tokens
    after the first, to the end) speeds of one logged request, in tokens/s; None when a
    phase did not happen or took no measurable time."""
    prefill = decode = None
    queued, ttft, duration = r.get("queued_ms"), r.get("ttft_ms"), r.get("duration_ms")
    if r.get("tokens_in") and ttft is not None and queued is not None and ttft - queued > 0:
        prefill = round(r["tokens_in"] / ((ttft - queued) / 1000), 1)
    if (r.get("tokens_out") or 0) > 1 and ttft is not None and duration is not None and duration - ttft > 0:
        decode = round((r["tokens_out"] - 1) / ((duration - ttft) / 1000), 1)
    return {"prefill_tokens_per_s": prefill, "decode_tokens_per_s": decode}


class SpeedSource:
    """Where a row's prefill and decode speeds come from (`speeds_from`)."""
    RUNTIME = "runtime"  # the runtime's own timings of each phase (llama-server)
    POOL = "pool"  # derived from the pool's times (phase_speeds): runtimes that time nothing


def speeds(r: dict) -> dict:
    """A logged request's prefill and decode speeds: the runtime's where it timed
    them, else derived from the pool's own times; and which it is."""
    if r.get("runtime_prefill_tps") is not None or r.get("runtime_decode_tps") is not None:
        return {"prefill_tokens_per_s": r.get("runtime_prefill_tps"),
                "decode_tokens_per_s": r.get("runtime_decode_tps"), "speeds_from": SpeedSource.RUNTIME}
    derived = phase_speeds(r)
    has = derived["prefill_tokens_per_s"] is not None or derived["decode_tokens_per_s"] is not None
    return {**derived, "speeds_from": SpeedSource.POOL if has else None}


def _clean(row: tuple) -> tuple:
    """The row with every text column printable (a client's control characters escaped;
    bodies keep their newlines and tabs) and within TEXT_LIMITS. On the event loop, for
    every request: only the text columns are looked at, and a row with nothing to change
    (the usual one) is returned as it is."""
    out = None
    for i, limit, keep in _TEXT:
        value = row[i]
        if isinstance(value, str):
            cleaned = truncate(printable(value, keep), limit)
            if cleaned is not value:
                if out is None:
                    out = list(row)
                out[i] = cleaned
    return row if out is None else tuple(out)


class RowRate:
    """A token bucket: rows at most `per_s` a second, after a burst of as many."""

    def __init__(self, per_s: float) -> None:
        self.per_s = per_s
        self.tokens = per_s
        self.at = time.monotonic()

    def take(self) -> bool:
        """Whether one more row may be written now."""
        now = time.monotonic()
        self.tokens = min(self.per_s, self.tokens + (now - self.at) * self.per_s)
        self.at = now
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True


def _row_bytes(row: dict) -> int:
    return sum(len(v) + 8 if isinstance(v, str) else 12 for v in row.values())


class RequestLog:
    def __init__(self, path: Path, max_rows: int, days: float, flush_s: float = FLUSH_S,
                 max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.path = Path(path)
        self.max_rows = max_rows
        self.days = days
        self.max_bytes = max_bytes
        self._count: int | None = None  # rows in the table (the writer thread's; None: not counted yet)
        self._writer = BatchWriter("request-log", self.path, self._connect, self._write, queue_max=QUEUE_MAX,
                                   flush_s=flush_s, prepare=self._vacuum_mode, after=self._give_back)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with closing(self._connect()) as db, db:
            db.execute("PRAGMA auto_vacuum=INCREMENTAL")  # before the first table: a new file has it
            db.executescript(SCHEMA)
            have = {row[1] for row in db.execute("PRAGMA table_info(requests)")}
            for column, kind in ADDED_COLUMNS.items():
                if column not in have:
                    db.execute(f"ALTER TABLE requests ADD COLUMN {column} {kind}")
            db.executescript(INDEXES)
            db.execute("PRAGMA journal_mode=WAL")  # readers do not wait for the writer

    def _connect(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, timeout=10, check_same_thread=False)
        db.row_factory = sqlite3.Row
        # with WAL, NORMAL syncs at checkpoints, not at each commit (ten a second): a crash of
        # the process loses nothing; a power cut may lose the last rows of a log, not corrupt it
        db.execute("PRAGMA synchronous=NORMAL")
        db.execute(f"PRAGMA journal_size_limit={WAL_MAX_BYTES}")
        return db

    # -- writing (any thread; cheap on the event loop) ---------------------------------------
    @property
    def dropped(self) -> int:
        """Rows lost because QUEUE_MAX were waiting for the disk."""
        return self._writer.dropped

    @property
    def written(self) -> int:
        return self._writer.written

    def start(self) -> None:
        self._writer.start()

    def record(self, **row) -> None:
        """Queue one finished request (keys from COLUMNS; missing ones are NULL)."""
        self.append(tuple(row.get(c) for c in COLUMNS))

    def append(self, row: tuple) -> None:
        """Queue one finished request: a tuple in COLUMNS order (the disk stuck: dropped, counted)."""
        self._writer.put(_clean(row))

    def close(self, timeout_s: float = 5.0) -> None:
        """Write what is queued, then stop the writer."""
        self._writer.close(timeout_s)

    def _write(self, db: sqlite3.Connection, rows: list[tuple]) -> None:  # the writer thread, in a transaction
        try:
            insert_rows(db, "requests", COLUMNS, rows)
            if self._count is not None:
                self._count += len(rows)
            self._trim(db)
        except BaseException:
            self._count = None  # the transaction rolls back: counted again at the next write
            raise

    def _vacuum_mode(self, db: sqlite3.Connection) -> None:
        """A file made before auto_vacuum was set keeps mode NONE until one VACUUM
        rewrites it (once; in the writer thread, never on the event loop)."""
        if db.execute("PRAGMA auto_vacuum").fetchone()[0] != 2:  # 2: incremental
            db.execute("PRAGMA auto_vacuum=INCREMENTAL")
            db.execute("VACUUM")
            log.info("request log: %s now gives freed space back (auto_vacuum=INCREMENTAL)", self.path)

    def data_bytes(self, db: sqlite3.Connection) -> int:
        """Bytes of the pages in use (the file less its free pages)."""
        pages = db.execute("PRAGMA page_count").fetchone()[0] - db.execute("PRAGMA freelist_count").fetchone()[0]
        return pages * db.execute("PRAGMA page_size").fetchone()[0]

    def _trim(self, db: sqlite3.Connection) -> None:
        """Keep the newest max_rows rows, none older than `days`, and about max_bytes of
        data (the oldest tenth goes until it fits). The rows are counted once, then kept
        count of (this writer is the table's only one): each trim costs what it deletes,
        not a walk over max_rows rows."""
        self._deleted(db.execute("DELETE FROM requests WHERE ts < ?", (time.time() - self.days * 86400,)))
        if self._count is None:
            self._count = db.execute("SELECT count(*) FROM requests").fetchone()[0]
        if self._count > self.max_rows:
            self._delete_oldest(db, self._count - self.max_rows)
        while self.data_bytes(db) > self.max_bytes and self._count > 1:
            self._delete_oldest(db, max(1, self._count // 10))

    def _delete_oldest(self, db: sqlite3.Connection, rows: int) -> None:
        self._deleted(db.execute("DELETE FROM requests WHERE id IN (SELECT id FROM requests ORDER BY id LIMIT ?)",
                                 (rows,)))

    def _deleted(self, cursor: sqlite3.Cursor) -> None:
        if self._count is not None:
            self._count -= cursor.rowcount

    def _give_back(self, db: sqlite3.Connection) -> None:
        """Free pages past an eighth of max_bytes (4 MiB at most) go back to the file system."""
        if db.execute("PRAGMA freelist_count").fetchone()[0] * db.execute("PRAGMA page_size").fetchone()[0] \
                > min(self.max_bytes // 8, 4 * 2**20):
            db.executescript("PRAGMA incremental_vacuum;")  # run to the end (execute() frees one page only)

    # -- reading (run in a thread) --------------------------------------------------------------
    def counts_since(self, since: float) -> dict[int, int]:
        """Requests per HTTP status since `since` (unix time): the error rate's figures."""
        with closing(self._connect()) as db:
            return dict(db.execute("SELECT status, COUNT(*) FROM requests WHERE ts >= ? GROUP BY status",
                                   (since,)).fetchall())

    def error_tenants_since(self, since: float, limit: int = 10) -> list[dict]:
        """The tenants with the most 4xx (then 5xx) answers since `since`: who sends what the
        pool refuses. A row refused before its key was known has no tenant (None)."""
        with closing(self._connect()) as db:
            rows = db.execute("SELECT tenant, SUM(status BETWEEN 400 AND 499), SUM(status >= 500) FROM requests "
                              "WHERE ts >= ? AND status >= 400 GROUP BY tenant ORDER BY 2 DESC, 3 DESC LIMIT ?",
                              (since, limit)).fetchall()
        return [{"tenant": tenant, "4xx": client, "5xx": server} for tenant, client, server in rows]

    def newest_of_id(self, request_id: str, per_tenant: int, max_rows: int) -> list[dict]:
        """The newest `per_tenant` rows with this request id of each tenant (a client's id is its
        own: another tenant sending the same id pushes none of them out), newest first, at most
        `max_rows` in all."""
        sql = ("SELECT * FROM (SELECT *, ROW_NUMBER() OVER (PARTITION BY tenant ORDER BY id DESC) AS nth "
               "FROM requests WHERE request_id = ?) WHERE nth <= ? ORDER BY id DESC LIMIT ?")
        with closing(self._connect()) as db:
            rows = [dict(r) for r in db.execute(sql, (request_id, per_tenant, max_rows))]
        for r in rows:
            del r["nth"]
        return _with_speeds(rows)

    def query(self, **filters) -> list[dict]:
        """The rows of one page (see page)."""
        return self.page(**filters)[0]

    def page(self, *, model: str | None = None, status: str | None = None, since: float | None = None,
             after_id: int | None = None, before_id: int | None = None, limit: int = 100,
             tenant: str | None = None, request_id: str | None = None,
             max_bytes: int = QUERY_MAX_BYTES) -> tuple[list[dict], bool]:
        """(rows, whether more rows match), newest first. `status`: an HTTP status, a class
        ("4xx"), or "ok" (below 400) or "error".
        At most `limit` rows and about `max_bytes` of them (one row at least):
        the newest ones (below `before_id`), or with `after_id` the oldest ones
        after it, so that a follower catching up misses none."""
        where, args = [], []
        if model:
            where.append("model = ?")
            args.append(model)
        if tenant:
            where.append("tenant = ?")
            args.append(tenant)
        if request_id:
            where.append("request_id = ?")
            args.append(request_id)
        if status == "ok":
            where.append("status < 400")
        elif status == "error":
            where.append("status >= 400")
        elif status in ("2xx", "3xx", "4xx", "5xx"):  # a status class (operator's filter)
            where.append("status / 100 = ?")
            args.append(int(status[0]))
        elif status:
            where.append("status = ?")
            args.append(int(status))
        if since is not None:
            where.append("ts >= ?")
            args.append(since)
        if after_id is not None:
            where.append("id > ?")
            args.append(after_id)
        if before_id is not None:
            where.append("id < ?")
            args.append(before_id)
        sql = "SELECT * FROM requests" + (" WHERE " + " AND ".join(where) if where else "")
        sql += f" ORDER BY id {'ASC' if after_id is not None else 'DESC'} LIMIT ?"
        args.append(limit + 1)  # one more: whether there are more
        rows, size, more = [], 0, False
        with closing(self._connect()) as db:
            for r in db.execute(sql, args):  # row by row: the bound holds before the rows are all read
                row = dict(r)
                size += _row_bytes(row)
                if len(rows) == limit or (rows and size > max_bytes):
                    more = True
                    break
                rows.append(row)
        if after_id is not None:
            rows.reverse()
        return _with_speeds(rows), more


def _with_speeds(rows: list[dict]) -> list[dict]:
    """The rows with their speeds added (`speeds`), and output tokens a second over the
    whole request (the time to the first one included)."""
    for r in rows:
        seconds = (r["duration_ms"] or 0) / 1000
        r["tokens_per_s"] = round(r["tokens_out"] / seconds, 1) if r["tokens_out"] and seconds > 0 else None
        r.update(speeds(r))
    return rows
