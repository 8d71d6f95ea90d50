"""A runtime's answer, read within bounds, and its errors in the pool's words: the body
(UpstreamBody: the job's output bound, gzip or deflate inflated in pieces), an event
stream's data lines (sse_data: each line bounded), a JSON object, a broken connection,
an HTTP error (upstream_error: a context overflow re-worded in OpenAI's words, the
runtime's numbers kept)."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import zlib
from collections.abc import AsyncIterator
from contextlib import aclosing

import aiohttp

from protocol.errors import ErrorCode, context_message
from protocol.redact import mask_url_credentials
from runtime_worker.backends.base import JobError, OutputLimits

INFLATE_PIECE_BYTES = 256 * 1024  # a compressed answer is inflated this much at a time
ERROR_BODY_BYTES = 64 * 1024  # an error answer is read this far for its message
ERROR_TEXT_CHARS = 4096  # a runtime's error message is passed on this long at most


def json_object(data: bytes, what: str) -> dict:
    try:
        value = json.loads(data)
    except ValueError as exc:
        raise JobError(ErrorCode.RUNTIME_ERROR, f"the runtime sent {what} that is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise JobError(ErrorCode.RUNTIME_ERROR, f"the runtime sent {what} that is not a JSON object")
    return value


def runtime_reported(err) -> JobError:
    """An error the runtime put in its answer (in a stream's event, or in place of a whole one)."""
    return JobError(ErrorCode.RUNTIME_ERROR,
                    str(err.get("message", err) if isinstance(err, dict) else err)[:ERROR_TEXT_CHARS])



class UpstreamBody:
    """A runtime's answer body, read within bounds: at most
    `limits.max_job_output_bytes` in all (decompressed), gzip or deflate
    inflated here in pieces of INFLATE_PIECE_BYTES (a 1 MB bomb never becomes
    1 GB at once, and the event loop gets a turn between pieces), any other
    encoding refused. Past a bound the job fails with runtime_error."""

    def __init__(self, r: aiohttp.ClientResponse, limits: OutputLimits) -> None:
        self.r = r
        self.limit = limits.max_job_output_bytes
        self.read_bytes = 0
        encoding = r.headers.get("Content-Encoding", "identity").strip().lower()
        if encoding in ("gzip", "x-gzip", "deflate"):
            self._inflate = zlib.decompressobj(wbits=47)  # 32 + 15: a gzip or zlib header, found by zlib
        elif encoding in ("identity", ""):
            self._inflate = None
        else:
            raise JobError(ErrorCode.RUNTIME_ERROR, f"the runtime answered with content encoding "
                           f"{encoding[:40]!r}; the pool reads identity, gzip or deflate")

    def _count(self, data: bytes) -> bytes:
        self.read_bytes += len(data)
        if self.read_bytes > self.limit:
            raise JobError(ErrorCode.RUNTIME_ERROR, f"the runtime's answer exceeds the pool's {self.limit} byte "
                           "bound on one job's output (server.max_job_output_bytes)")
        return data

    async def chunks(self, limit: int | None = None) -> AsyncIterator[bytes]:
        """The decoded body, piece by piece; `limit` (bytes) lowers the bound."""
        if limit is not None:
            self.limit = min(self.limit, self.read_bytes + limit)
        async for raw in self.r.content.iter_any():
            if self._inflate is None:
                yield self._count(raw)
                continue
            try:
                data = self._inflate.decompress(raw, INFLATE_PIECE_BYTES)
                yield self._count(data)
                while self._inflate.unconsumed_tail:
                    await asyncio.sleep(0)
                    data = self._inflate.decompress(self._inflate.unconsumed_tail, INFLATE_PIECE_BYTES)
                    yield self._count(data)
            except zlib.error as exc:
                raise JobError(ErrorCode.RUNTIME_ERROR, f"the runtime's compressed answer is corrupt: {exc}") \
                    from None

    async def read(self) -> bytes:
        out = bytearray()
        async for data in self.chunks():
            out += data
        return bytes(out)

    async def error_text(self) -> str:
        """The start of an error answer: enough for its message, never all of a huge one."""
        out = bytearray()
        try:
            async for data in self.chunks(ERROR_BODY_BYTES):
                out += data
        except JobError:  # longer than that: its start is the message
            pass
        return out[:ERROR_BODY_BYTES].decode(errors="replace")

    async def drain(self, timeout_s: float = 2.0) -> None:
        """Read what follows [DONE] to the end of the body, so that a keep-alive
        connection can carry the next job; a server that does not end the body in
        time (or sends more than a little) only costs that connection."""
        try:
            async with asyncio.timeout(timeout_s), aclosing(self.chunks(ERROR_BODY_BYTES)) as pieces:
                async for _ in pieces:
                    pass
        except (TimeoutError, JobError):
            pass


DATA_LINE = re.compile(rb"^data:(.*)$", re.MULTILINE)  # an SSE data line; `.` stops at the newline


def line_too_long(max_line_bytes: int) -> JobError:
    return JobError(ErrorCode.RUNTIME_ERROR, f"the runtime sent a line longer than the pool's {max_line_bytes} "
                    "byte bound (server.max_upstream_line_bytes)")


async def sse_data(body: UpstreamBody, max_line_bytes: int) -> AsyncIterator[bytes]:
    """The `data:` payloads of an SSE body. Linear in the body's size, and cheap
    per line: each byte is searched once for the last newline (from where the
    last search stopped), the data lines of what is complete are found by the
    regex engine (a flood of blank or comment lines costs no Python step per
    line), and only the unfinished line is kept (a chunk of whole lines, the
    usual token, is never copied). A data line, or an unfinished
    one, longer than `max_line_bytes` fails the job before more of it is held."""
    buf = bytearray()
    for_newline = 0  # buf[:for_newline] holds no newline
    async with aclosing(body.chunks()) as pieces:
        async for chunk in pieces:
            if not buf and chunk.endswith(b"\n"):  # the common case, whole lines: no copy
                lines = DATA_LINE.findall(chunk)
            else:
                buf += chunk
                end = buf.rfind(b"\n", for_newline) + 1  # just past the last complete line; 0: none
                lines = DATA_LINE.findall(buf, 0, end) if end else ()
                del buf[:end]
            for line in lines:
                if len(line) > max_line_bytes:
                    raise line_too_long(max_line_bytes)
                yield line.strip()
            for_newline = len(buf)
            if for_newline > max_line_bytes:
                raise line_too_long(max_line_bytes)
    if buf.startswith(b"data:"):
        yield bytes(buf[5:]).strip()


def connection_lost(exc: Exception) -> JobError:
    """A broken connection to the runtime, in plain words for the client; the library's
    own text (which names its internals) goes to the worker's log only."""
    logging.getLogger("runtime_worker").warning("connection to the runtime lost: %s",
                                                mask_url_credentials(repr(exc)))
    if isinstance(exc, aiohttp.ClientConnectorError):
        return JobError(ErrorCode.RUNTIME_CRASHED, "the runtime did not accept the connection (it is down)")
    return JobError(ErrorCode.RUNTIME_CRASHED, "the runtime's answer broke off before it was complete "
                    "(the runtime stopped or crashed)")


# vLLM's words for a request over the model's length, in its releases' wordings: the context
# (M), and what the request came to (N) where it says so
_CONTEXT_M = re.compile(r"maximum (?:context length|model length) (?:is|of) (\d+)")
_CONTEXT_N = re.compile(r"(?:requested|resulted in|has|contains at least) (\d+)(?: input)? tokens|\(length (\d+)\)")


def context_overflow(detail, message: str) -> tuple[int | None, int] | None:
    """(prompt tokens or None, context) when a runtime refused a request for its context's size:
    llama-server says so in fields of its own, vLLM in words."""
    if isinstance(detail, dict) and detail.get("type") == "exceed_context_size_error":
        n, m = detail.get("n_prompt_tokens"), detail.get("n_ctx")
        if isinstance(m, int):
            return (n if isinstance(n, int) else None), m
    if (m := _CONTEXT_M.search(message)) is None:
        return None
    n = _CONTEXT_N.search(message)
    return (int(n.group(1) or n.group(2)) if n else None), int(m.group(1))


def upstream_error(status: int, text: str) -> JobError:
    """Map an upstream HTTP error to a job error; never a success. A request
    the runtime refused as malformed keeps its status (400) and its message:
    the client gets the runtime's own words, except a request over the model's context:
    `context_length_exceeded` in OpenAI's words, which agents act on."""
    detail = None
    try:
        detail = json.loads(text).get("error", text)
        message = detail.get("message", str(detail)) if isinstance(detail, dict) else str(detail)
    except (ValueError, AttributeError):
        message = text[:500]
    message = str(message)[:ERROR_TEXT_CHARS]
    if status in (400, 413, 422) and (sizes := context_overflow(detail, message)) is not None:
        return JobError(ErrorCode.CONTEXT_LENGTH_EXCEEDED, context_message(*sizes))
    if status in (400, 422):  # 422: a server's schema validation (FastAPI's, in vLLM)
        return JobError(ErrorCode.INVALID_REQUEST, message)
    if status == 413:
        return JobError(ErrorCode.REQUEST_TOO_LARGE, message)
    if status == 501:  # llama-server: an endpoint it was not started for (embeddings)
        return JobError(ErrorCode.UNSUPPORTED_ENDPOINT, message)
    if 300 <= status < 400:  # never followed (it would carry the key and the prompt elsewhere)
        return JobError(ErrorCode.RUNTIME_ERROR, f"upstream {status}: a redirect, not followed")
    if status == 429:
        code = ErrorCode.UPSTREAM_RATE_LIMITED
    elif status in (408, 504):
        code = ErrorCode.RUNTIME_TIMEOUT
    else:  # 401, 403, 404 and 5xx: the pool's runtime is misconfigured or failed, not the client
        code = ErrorCode.RUNTIME_ERROR
    return JobError(code, f"upstream {status}: {message}")
