"""The one batched SQLite writer behind the request log and the event timeline.

Callers on the event loop (or any thread) `put` a row: a deque append, never
I/O, never a wait. One writer thread wakes every `flush_s`, takes what piled
up, and hands it to the store's `write(db, rows)` in one transaction (the
store inserts there, with `insert_rows`, and trims); `after(db)` runs once the transaction is
committed (the request log gives freed pages back there). Past `queue_max`
waiting rows, new rows are dropped and counted: a stuck disk loses log rows,
never slows a request. `close` writes what is queued, then stops the thread."""

from __future__ import annotations

import functools
import logging
import sqlite3
import threading
from collections import deque
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("llm_pool.sqlite_writer")

Write = Callable[[sqlite3.Connection, list[tuple]], None]
Step = Callable[[sqlite3.Connection], None]


INSERT_ROWS = 256  # rows per INSERT statement at most (21 columns: well under SQLite's 32,766 parameters)


@functools.lru_cache(maxsize=32)
def _insert(table: str, columns: tuple[str, ...], rows: int) -> str:
    one = f"({', '.join('?' * len(columns))})"
    return f"INSERT INTO {table} ({', '.join(columns)}) VALUES {', '.join([one] * rows)}"


def insert_rows(db: sqlite3.Connection, table: str, columns: tuple[str, ...], rows: list[tuple]) -> None:
    """The rows in a few INSERTs of a power of two rows each (INSERT_ROWS at most). One
    statement for many rows, not executemany: sqlite3 lets go of the GIL at each statement's
    step, and every let-go while the event loop is busy costs the loop a wait for the GIL (a
    wait per request, at 500 rows a second). Powers of two: a table has at most nine such
    statements, which stay prepared in the connection's cache; a statement per batch size
    was compiled anew for nearly every batch (a third of an insert's cost)."""
    start, left = 0, len(rows)
    while left:
        size = min(INSERT_ROWS, 1 << (left.bit_length() - 1))
        chunk = rows[start:start + size]
        db.execute(_insert(table, columns, size), [value for row in chunk for value in row])
        start += size
        left -= size


class BatchWriter:
    def __init__(self, name: str, path: Path, connect: Callable[[], sqlite3.Connection], write: Write, *,
                 queue_max: int, flush_s: float, prepare: Step | None = None, after: Step | None = None) -> None:
        self.name = name  # the thread's name, and the store's in the log
        self.path = path
        self.queue_max = queue_max
        self.flush_s = flush_s
        self.dropped = 0  # rows refused because queue_max were waiting
        self.written = 0  # rows committed
        self._connect, self._write, self._prepare, self._after = connect, write, prepare, after
        self._rows: deque[tuple] = deque()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def put(self, row: tuple) -> None:
        if len(self._rows) >= self.queue_max:
            self.dropped += 1
            return
        self._rows.append(row)

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()

    def close(self, timeout_s: float = 5.0) -> None:
        """Write what is queued, then stop the thread."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout_s)
            self._thread = None

    def _run(self) -> None:
        db = self._connect()
        try:
            if self._prepare is not None:
                try:
                    self._prepare(db)
                except sqlite3.Error:
                    log.exception("%s: preparing %s failed; writing on", self.name, self.path)
            while True:
                stopping = self._stop.wait(self.flush_s)
                rows = []
                while self._rows:
                    rows.append(self._rows.popleft())
                if rows:
                    try:
                        with db:
                            self._write(db, rows)
                        self.written += len(rows)
                        if self._after is not None:
                            self._after(db)
                    except sqlite3.Error:
                        log.exception("%s: %d rows not written to %s", self.name, len(rows), self.path)
                if stopping:
                    break
        finally:
            db.close()
