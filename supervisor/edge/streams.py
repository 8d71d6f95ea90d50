"""How an inference answer goes out: SSE frames, a stream that owns its job
(`JobStream`), a JSON answer encoded by msgspec, and an endpoint as a plain ASGI app."""

from __future__ import annotations

import asyncio
import logging
from contextlib import aclosing

import msgspec
from starlette.requests import Request

from supervisor.edge.listener import DISCONNECT_KEY, Disconnect
from supervisor.scheduling.jobs import Job

log = logging.getLogger("llm_pool.inference")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# an inference stream's headers, as Starlette's StreamingResponse would send them with SSE_HEADERS
SSE_RAW_HEADERS = [(name.lower().encode(), value.encode()) for name, value in SSE_HEADERS.items()] + [
    (b"content-type", b"text/event-stream; charset=utf-8")]


def sse_frame(event: dict) -> bytes:
    """One server-sent event: {"data": str} with an optional "event" name. The
    data is compact JSON (or [DONE]): never a newline inside."""
    if "event" in event:
        return f"event: {event['event']}\ndata: {event['data']}\n\n".encode()
    return f"data: {event['data']}\n\n".encode()


_encode_answer = msgspec.json.Encoder().encode


class AnswerJSON:
    """A whole JSON answer as a plain ASGI app: its body encoded by msgspec (in C; compact UTF-8
    JSON, as Starlette's JSONResponse, with floats in their shortest form: 1e-05 as 0.00001, the
    same value), then `sent()` once the body is handed to the server. Not a Starlette Response:
    its header building and background task cost on every request, and this answer needs
    neither (its headers are the job's, already bytes)."""

    __slots__ = ("body", "headers", "sent")

    def __init__(self, content, headers: list[tuple[bytes, bytes]], sent=None) -> None:
        self.body = _encode_answer(content)
        self.headers = [(b"content-length", b"%d" % len(self.body)), (b"content-type", b"application/json"),
                        *headers]
        self.sent = sent

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.headers})
        await send({"type": "http.response.body", "body": self.body})
        if self.sent is not None:
            self.sent()


class JobStream:
    """An SSE answer that owns its job, as a plain ASGI app: when it ends for any
    reason (done, the client gone before or during the body, a failed write), the
    job is cancelled unless it has finished. A generator's own `finally` is not
    enough: a body that never starts never runs it.

    A client that leaves mid-stream cancels the stream's task, as a disconnect
    listener would, but no task is made for it: the connection says when its
    client goes (edge.listener.Disconnect). Under another ASGI server, a task waits
    for http.disconnect. (Starlette's StreamingResponse runs a task group per
    response for this under ASGI 2.3, uvicorn's: about 0.2 ms of CPU per stream.)"""

    def __init__(self, job: Job, end, body, headers: list[tuple[bytes, bytes]] = (),
                 media_headers: list[tuple[bytes, bytes]] | None = None) -> None:
        self.job = job
        self.end = end  # cancels the job unless finished; counts a client that left
        self.body = body  # async iterator of bytes: the SSE events (or a shape's own lines), ready to write
        self.headers = [*(SSE_RAW_HEADERS if media_headers is None else media_headers), *headers]

    async def __call__(self, scope, receive, send) -> None:
        task = asyncio.current_task()
        left = False

        def client_left() -> None:
            nonlocal left
            if not left:
                left = True
                task.cancel()

        disconnect = scope.get(DISCONNECT_KEY)
        watcher = None
        if disconnect is None:
            disconnect = Disconnect()
            watcher = asyncio.create_task(watch_for_disconnect(receive, disconnect))
        disconnect.on_gone(client_left)
        try:
            async with aclosing(self.body) as chunks:
                await send({"type": "http.response.start", "status": 200, "headers": self.headers})
                async for chunk in chunks:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not left or task.uncancel():  # cancelled for another reason too: that one goes on
                raise
        finally:
            # no await before this: a cancel from client_left lands inside the try, or never
            disconnect.callback = None
            if watcher is not None:
                watcher.cancel()
            self.end(self.job)


async def watch_for_disconnect(receive, disconnect: Disconnect) -> None:
    """Under an ASGI server other than the edge's: fire `disconnect` once the server
    says the client left. A receive that fails leaves the connection unusable, so
    that counts as gone too, and is logged."""
    try:
        while (await receive())["type"] != "http.disconnect":
            pass
    except Exception:
        log.exception("waiting for the client to leave failed")
    disconnect.fire()


class InferenceEndpoint:
    """One inference route's endpoint as an ASGI app (Starlette's Route takes an ASGI
    app as its endpoint, as it does an HTTPEndpoint): no per-request wrapper but the
    Request. `handle(request)` answers every error itself, in the error envelope.
    (Every answer's request id headers are the edge's: request_ids.py.)"""

    def __init__(self, handle) -> None:
        self.handle = handle

    async def __call__(self, scope, receive, send) -> None:
        response = await self.handle(Request(scope, receive))
        await response(scope, receive, send)
