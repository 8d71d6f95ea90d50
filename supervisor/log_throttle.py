"""One owner of "say it once, then count": a warning that a client can trigger at will
(a refused connection, a bad handshake) is logged at most once per `every_s` per kind,
with how many were not logged in between."""

from __future__ import annotations

import logging
import time

CLIENT_WARNING_EVERY_S = 10.0  # the edge's warnings a client can cause at will: one of each kind this often
MAX_KINDS = 1000  # kinds made of client-given text (a peer, a key) must not grow this without bound


class ThrottledLog:
    def __init__(self, log: logging.Logger, every_s: float) -> None:
        self.log = log
        self.every_s = every_s
        self._last: dict[str, tuple[float, int]] = {}  # kind -> (when last logged, skipped since)

    def warning(self, kind: str, message: str, *args, level: int = logging.WARNING, exc_info=None) -> None:
        now = time.monotonic()
        last, skipped = self._last.get(kind, (None, 0))
        if last is not None and now - last < self.every_s:
            self._last[kind] = (last, skipped + 1)
            return
        if len(self._last) >= MAX_KINDS:
            self._last.clear()
        self._last[kind] = (now, 0)
        self.log.log(level, message + (f" ({skipped} more like it since)" if skipped else ""), *args,
                     exc_info=exc_info)


class ThrottledMessages(logging.Filter):
    """A logging filter for another library's logger: a record whose message starts with one
    of `prefixes` passes at most once per `every_s` per prefix, with how many were dropped
    in between; every other record passes."""

    def __init__(self, prefixes: tuple[str, ...], every_s: float) -> None:
        super().__init__()
        self.prefixes = prefixes
        self.every_s = every_s
        self._last: dict[str, tuple[float, int]] = {}  # prefix -> (when last passed, dropped since)

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        prefix = next((p for p in self.prefixes if message.startswith(p)), None)
        if prefix is None:
            return True
        now = time.monotonic()
        last, dropped = self._last.get(prefix, (None, 0))
        if last is not None and now - last < self.every_s:
            self._last[prefix] = (last, dropped + 1)
            return False
        self._last[prefix] = (now, 0)
        if dropped:
            record.msg, record.args = f"{message} ({dropped} more like it since)", ()
        return True
