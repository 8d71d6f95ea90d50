"""Text an operator reads (the request log, the CLI's tables and follows, the
supervisor's log lines) shows a client's control characters escaped, never raw:
a model name of "\\x1b[2J" must not clear the operator's terminal, nor "\\r\\n"
forge a line of a table or a log."""

from __future__ import annotations

import logging
import re

# C0 controls, DEL and C1 controls (8-bit CSI, OSC... which some terminals obey too)
_CONTROLS = re.compile(r"[\x00-\x1f\x7f-\x9f]")
LOG_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"  # the supervisor's log lines


def _escape(match: re.Match) -> str:
    return f"\\x{ord(match[0]):02x}"


def printable(text: str, keep: str = "") -> str:
    """`text` with its control characters as \\xNN escapes (those in `keep`, e.g. "\\n\\t", left
    as they are); any other character, ordinary Unicode included, unchanged. Idempotent."""
    if text.isprintable() or not _CONTROLS.search(text):  # the usual case: nothing to copy (isprintable: in C)
        return text
    if keep:
        return _CONTROLS.sub(lambda m: m[0] if m[0] in keep else _escape(m), text)
    return _CONTROLS.sub(_escape, text)


class PrintableFormatter(logging.Formatter):
    """A log line whose message (where client text may appear) is printable; one record stays
    one line. A traceback after it keeps its lines."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        return printable(super().formatMessage(record))
