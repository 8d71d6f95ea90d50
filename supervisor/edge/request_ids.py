"""Every answer's request id, which the client and the operator share: the
`x-request-id` header (OpenAI's) on every answer, and `request-id` (Anthropic's)
too on the Messages routes. A client that sends a safe `x-request-id` (printable
ASCII, no spaces, at most MAX_CHARS) gets it back and finds it in the request log;
any other is replaced by a fresh `req_...` id. The request log row of the request
(live.Activity.finished) reads it from `REQUEST_ID`, the context of the request's
task, so no stage in between carries it. So does what the pool left out of the request
(`SKIPPED_TOOLS`: a Responses body's tools with no local meaning), which the answer's
`x-llm-pool-skipped-tools` header says too."""

from __future__ import annotations

import itertools
import re
import time
from random import getrandbits

from supervisor.telemetry.request_context import REQUEST_ID, SKIPPED_TOOLS  # noqa: F401  (set here, read by rows)

MAX_CHARS = 128
_SAFE = re.compile(rb"[\x21-\x7e]{1,%d}" % MAX_CHARS)
HEADER = b"x-request-id"
ANTHROPIC_HEADER = b"request-id"

SKIPPED_HEADER = b"x-llm-pool-skipped-tools"


def request_id(headers) -> bytes:
    """The client's x-request-id when it is safe, else a fresh one."""
    for name, value in headers:
        if name == HEADER:
            if _SAFE.fullmatch(value):
                return value
            break
    return fresh_id()


def fresh_id() -> bytes:
    """`req_` and 32 hex digits, as new_id's: 16 of a count that started at the supervisor's
    start time in µs, then 64 random bits. Ids made later sort later, so the request log's
    index on request_id grows at its end (a random id lands on a random page of it, which
    doubled the cost of a row's insert)."""
    return b"req_%032x" % (next(_ORDER) << 64 | getrandbits(64))


_ORDER = itertools.count(time.time_ns() // 1000)  # a restart starts past every id made before (< 1 per µs)


class SendWithId:
    """`send` that adds the id's headers to the response's start, and the skipped tools'
    (SKIPPED_TOOLS, read then), and says (`started`) whether a response has begun. It returns
    `send`'s awaitable: no coroutine of its own for each body chunk. An object, not a closure
    that sets an attribute on itself: that closure held itself, a reference cycle on every
    request that only the cycle collector frees (with the server's cycle of the request, which
    it holds)."""

    __slots__ = ("send", "extra", "started")

    def __init__(self, send, rid: bytes, anthropic: bool) -> None:
        self.send = send
        self.extra = [(HEADER, rid), (ANTHROPIC_HEADER, rid)] if anthropic else [(HEADER, rid)]
        self.started = False

    def __call__(self, message):
        if message["type"] == "http.response.start":
            skipped = SKIPPED_TOOLS.get()
            more = [(SKIPPED_HEADER, skipped.encode())] if skipped else []
            message = {**message, "headers": [*message.get("headers", ()), *self.extra, *more]}
            self.started = True
        return self.send(message)
