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

import re

from supervisor.shapes.openai import new_id
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
    return new_id("req").encode()


def with_request_id(send, rid: bytes, anthropic: bool):
    """`send` that adds the id's headers to the response's start, and the skipped tools'
    (SKIPPED_TOOLS, read then), and says (its `started`) whether a response has begun. A plain
    function that returns `send`'s awaitable: no
    coroutine of its own for each body chunk."""
    extra = [(HEADER, rid), (ANTHROPIC_HEADER, rid)] if anthropic else [(HEADER, rid)]

    def send_with_id(message):
        if message["type"] == "http.response.start":
            skipped = SKIPPED_TOOLS.get()
            more = [(SKIPPED_HEADER, skipped.encode())] if skipped else []
            message = {**message, "headers": [*message.get("headers", ()), *extra, *more]}
            send_with_id.started = True
        return send(message)
    send_with_id.started = False
    return send_with_id
