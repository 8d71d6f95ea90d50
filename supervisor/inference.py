"""The inference routes: /v1/chat/completions, /v1/completions,
/v1/embeddings and /v1/responses. Each request becomes one job through the
engine's scheduler (queue, capacity, drain, cancel on disconnect, metrics,
the error table); this module only translates bodies and job events, with
the shapes in openai_shapes. The routes are served straight from the HTTP
edge (see `route`): FastAPI's dependency solving, and the layers between the
edge and a route, cost more per request than the request's own handling."""

from __future__ import annotations

import asyncio
import email.message
import functools
import json

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException

from protocol import Delta, Done
from protocol.errors import ErrorCode, PoolError
from supervisor import openai_shapes as shapes
from supervisor import responses_shapes as rshapes
from supervisor.http_guard import DISCONNECT_KEY, Disconnect
from supervisor.jobs import Job
from supervisor.metrics import CLIENT_CLOSED

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse_frame(event: dict) -> bytes:
    """One server-sent event: {"data": str} with an optional "event" name. The
    data is compact JSON (or [DONE]): never a newline inside."""
    if "event" in event:
        return f"event: {event['event']}\ndata: {event['data']}\n\n".encode()
    return f"data: {event['data']}\n\n".encode()


_answer_encoder = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":"))


class AnswerJSON(JSONResponse):
    """Starlette's JSONResponse with one encoder made once (json.dumps with
    options builds a new one per call), same bytes."""

    def render(self, content) -> bytes:
        return _answer_encoder.encode(content).encode("utf-8")


class JobStream(StreamingResponse):
    """An SSE response that owns its job: when the response ends for any
    reason (done, client gone before or during the body, a failed write), the
    job is cancelled unless it has finished. A generator's own `finally` is
    not enough: a body that never starts never runs it."""

    def __init__(self, job: Job, end, body) -> None:
        super().__init__(body, media_type="text/event-stream", headers=SSE_HEADERS)
        self.job = job
        self.end = end  # cancels the job unless finished; counts a client that left

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.end(self.job)


def add_inference_routes(app: FastAPI, engine, metrics, config) -> dict:
    """Declare the inference routes; returns what HttpEdge serves directly: {path: handler}."""
    # -- running a job for a client ------------------------------------------------------------------
    async def collect(job: Job) -> tuple[shapes.Choices, Done]:
        choices = shapes.Choices()
        async for event in job.stream(engine.cancel):
            if isinstance(event, Delta):
                choices.add(event)
            else:
                return choices, event
        raise PoolError(ErrorCode.RUNTIME_ERROR, "job ended without a result")

    async def unless_disconnected(request: Request, job: Job, waiting):
        """Await `waiting` (about `job`). If the client goes away first, the job
        is cancelled (a queued one dropped, a submitted one stopped by its
        worker, which frees the slot) and None is returned once it has ended.
        The connection says when its client goes (http_guard.Disconnect); under
        another ASGI server, a task waits for http.disconnect instead."""
        disconnect = request.scope.get(DISCONNECT_KEY)
        watcher = None
        if disconnect is None:
            disconnect = Disconnect()
            watcher = asyncio.create_task(watch(request, disconnect))
        disconnect.on_gone(functools.partial(engine.cancel, job))
        try:
            result = await waiting
        except PoolError:
            if disconnect.gone:
                return None
            raise
        finally:
            disconnect.callback = None
            if watcher is not None:
                watcher.cancel()
        return None if disconnect.gone else result

    async def watch(request: Request, disconnect: Disconnect) -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        disconnect.fire()

    async def serve_job(request: Request, endpoint: str, model: str, job_request: dict, sse_shape, to_json,
                        job_endpoint: str = "chat"):
        """Run one inference request: as SSE when `sse_shape` is given, else as
        the JSON that `to_json(choices, done)` builds. However the handler ends
        (a client gone at any moment, an error, a cancelled task), the job is
        cancelled unless finished: no slot outlives its request."""
        if sse_shape is None and job_endpoint != "embeddings":
            job_request["stream"] = False  # wanted whole: a runtime that can answer whole does (its own bytes)
        try:
            job = engine.submit(model, job_request, job_endpoint)
        except PoolError as err:
            metrics.request(model, endpoint, err.status, error=err)
            raise
        streaming = None
        try:
            if sse_shape is not None:
                first = await first_event(request, job)
                if first is None:
                    return client_gone(job, endpoint)
                streaming = JobStream(job, lambda job: end_stream(job, endpoint),
                                      _sse(job, endpoint, sse_shape, first))
                return streaming
            result = await unless_disconnected(request, job, collect(job))
            if result is None:
                return client_gone(job, endpoint)
            choices, done = result
            metrics.job_done(job, done, endpoint)
            return AnswerJSON(to_json(choices, done))  # a Response skips FastAPI's generic encoder
        except PoolError as err:
            metrics.request(model, endpoint, err.status, job, error=err)
            raise
        finally:
            if streaming is None:  # else the stream owns the job until its last write
                engine.cancel(job)  # a no-op once the job has finished

    def client_gone(job: Job, endpoint: str) -> Response:
        metrics.client_gone(job, endpoint)
        return Response(status_code=CLIENT_CLOSED)  # nobody reads it: for the access log

    def end_stream(job: Job, endpoint: str) -> None:
        """A stream's last act, however it ended: its job is cancelled unless finished,
        and a client that left before the end is counted."""
        engine.cancel(job)
        metrics.client_gone(job, endpoint)

    async def first_event(request: Request, job: Job):
        """Hold the response headers until the job's first event, so that a
        failure before any token (queue timeout, upstream 429, crash, the
        runtime's 400) is a plain HTTP error the client can act on, not a
        stream that fails at once."""
        return await unless_disconnected(request, job, job.next_event(engine.cancel))

    async def _sse(job: Job, endpoint: str, shape, first):
        """The SSE body. What is ready goes out in one write: the opening events
        with the first delta, then each delta (merged if several were waiting),
        then the closing events. A client that leaves cancels the job (see JobStream)."""
        text_sse = getattr(shape, "text_sse", None)  # a shape's fast path for plain text
        try:
            ready = [sse_frame(e) for e in shape.opening()]
            event = first
            while True:
                if isinstance(event, Delta):
                    if text_sse is not None and not event.parts and event.text:
                        ready.append(text_sse(event.text))
                    else:
                        ready += [sse_frame(e) for e in shape.delta(event)]
                elif isinstance(event, Done):
                    metrics.job_done(job, event, endpoint)
                    ready += [sse_frame(e) for e in shape.closing(event)]
                    yield b"".join(ready)
                    return
                else:  # quiet for sse_ping_s: a comment keeps proxies from timing the stream out
                    ready.append(b": ping\n\n")
                yield b"".join(ready)
                ready = []
                event = await job.next_event(engine.cancel, idle_s=config.server.sse_ping_s)
        except PoolError as err:
            metrics.request(job.model, endpoint, err.status, job, error=err)
            yield b"".join([*ready, *(sse_frame(e) for e in shape.failed(err))])

    def include_usage(body) -> bool:
        return bool(body.stream_options and body.stream_options.include_usage)

    direct = {}  # path -> the handler that HttpEdge calls with the body

    def route(path: str, model: type[BaseModel]):
        """Serve POST `path` from the HTTP edge (http_guard.HttpEdge): `handle(body,
        request)` with the body validated as FastAPI would (parse_body), and the
        app's exception handlers for what it raises; without FastAPI's
        per-request dependency solving, nor the router and the layers between
        the edge and it. FastAPI still declares the route, so that it stays in
        the OpenAPI document (and answers other methods with 405)."""
        def register(handle):
            async def serve(scope, receive, send, raw: bytes):
                request = Request(scope, receive, send)
                try:
                    response = await handle(parse_body(raw, request.headers.get("content-type"), model), request)
                except Exception as exc:
                    handler = exception_handler(exc)
                    if handler is None:
                        raise  # to ServerErrorMiddleware: a 500
                    response = await handler(request, exc)
                await response(scope, receive, send)
            direct[path] = serve

            async def documented(body):  # noqa: ARG001 -- never called: the edge answers POST first
                raise AssertionError("unreachable")
            documented.__annotations__ = {"body": model}  # a type, not the string this module's annotations are
            documented.__name__ = handle.__name__  # the same operationId as when FastAPI served it
            app.post(path)(documented)
            return handle
        return register

    def exception_handler(exc: Exception):
        """The app's handler for `exc`, as Starlette looks it up (by class, most specific first)."""
        for cls in type(exc).__mro__:
            if cls in app.exception_handlers:
                return app.exception_handlers[cls]
        return None

    @route("/v1/responses", rshapes.ResponsesRequest)
    async def create_response(body: rshapes.ResponsesRequest, request: Request):
        return await serve_job(request, "responses", body.model, rshapes.job_request_from_responses(body),
                               rshapes.ResponsesStream(body) if body.stream else None,
                               lambda choices, done: rshapes.response_json(body, choices, done))

    @route("/v1/chat/completions", shapes.ChatRequest)
    async def chat_completions(body: shapes.ChatRequest, request: Request):
        return await serve_job(
            request, "chat_completions", body.model, body.job_request(),
            shapes.ChatStream(body.model, include_usage(body)) if body.stream else None,
            lambda choices, done: shapes.chat_completion(body.model, choices, done))

    @route("/v1/completions", shapes.CompletionRequest)
    async def completions(body: shapes.CompletionRequest, request: Request):
        return await serve_job(
            request, "completions", body.model, body.job_request(),
            shapes.CompletionStream(body.model, include_usage(body)) if body.stream else None,
            lambda choices, done: shapes.text_completion(body.model, choices, done), "completions")

    @route("/v1/embeddings", shapes.EmbeddingRequest)
    async def create_embeddings(body: shapes.EmbeddingRequest, request: Request):
        return await serve_job(request, "embeddings", body.model, body.job_request(), None,
                               lambda choices, done: shapes.embeddings(body.model, done), "embeddings")

    return direct


# -- the request body, as FastAPI reads it ----------------------------------------------------------------
_MISSING = object()


@functools.lru_cache(maxsize=64)
def _is_json(content_type: str) -> bool:
    """FastAPI's test: application/json or application/*+json, parameters allowed."""
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (subtype == "json" or subtype.endswith("+json"))


def parse_body(raw: bytes, content_type: str | None, model: type[BaseModel]) -> BaseModel:
    """The request's body validated as `model`, with the errors a FastAPI
    `body: model` parameter gives (and so the same handlers, statuses and
    messages): a body that is not JSON is a json_invalid error at its offset;
    one that cannot be parsed at all (nested too deep) a 400 HTTPException;
    a missing body "Field required"; a body sent under another content type
    is validated as bytes (and refused). Field errors are located under "body"."""
    data = _MISSING
    if raw:
        data = raw
        if content_type and _is_json(content_type):
            try:
                data = json.loads(raw)
            except json.JSONDecodeError as exc:
                raise RequestValidationError([{"type": "json_invalid", "loc": ("body", exc.pos),
                                               "msg": "JSON decode error", "input": {},
                                               "ctx": {"error": exc.msg}}]) from None
            except Exception:
                raise HTTPException(status_code=400, detail="There was an error parsing the body") from None
    if data is _MISSING:
        raise RequestValidationError([{"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}])
    try:
        return model.model_validate(data, from_attributes=True)
    except ValidationError as exc:
        raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]) from None
