"""The inference routes: /v1/chat/completions, /v1/completions,
/v1/embeddings and /v1/responses. Each request becomes one job through the
engine's scheduler (queue, capacity, drain, cancel on disconnect, metrics,
the error table); this module only translates bodies and job events, with
the shapes in openai_shapes. The routes are plain Starlette routes (see
`route`): a body is decoded and validated by msgspec, in C, and the same
Structs give the OpenAPI document its schemas (`document`)."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import re
from contextlib import aclosing

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.background import BackgroundTask

from protocol import Delta, Done
from protocol.errors import ErrorCode, PoolError
from supervisor import openai_shapes as shapes
from supervisor import responses_shapes as rshapes
from supervisor.admission import DEFAULT_TENANT
from supervisor.edge.guard import TENANT_KEY, error_response
from supervisor.edge.listener import DISCONNECT_KEY, Disconnect
from supervisor.jobs import Job
from supervisor.metrics import CLIENT_CLOSED

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


class AnswerJSON(JSONResponse):
    """Starlette's JSONResponse, its body encoded by msgspec (in C): compact UTF-8 JSON,
    as Starlette's, with floats in their shortest form (1e-05 as 0.00001: the same value)."""

    def render(self, content) -> bytes:
        return _encode_answer(content)


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

    def __init__(self, job: Job, end, body) -> None:
        self.job = job
        self.end = end  # cancels the job unless finished; counts a client that left
        self.body = body  # async iterator of bytes: the SSE events, ready to write

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
                await send({"type": "http.response.start", "status": 200, "headers": SSE_RAW_HEADERS})
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
    Request. `handle(request)` answers every error itself, in the error envelope."""

    def __init__(self, handle) -> None:
        self.handle = handle

    async def __call__(self, scope, receive, send) -> None:
        response = await self.handle(Request(scope, receive))
        await response(scope, receive, send)


def add_inference_routes(app: FastAPI, engine, admission, metrics, config) -> dict[str, InferenceEndpoint]:
    """The inference surface: its POST endpoints by path, which the edge hands inference
    POSTs to directly (each ASGI layer and router costs on every request, and this surface
    needs none of the app's: its endpoints answer their own errors). The same endpoints are
    plain routes on `app` too, so that other methods get the app's 405, and their bodies'
    schemas go in its OpenAPI document."""
    documented: dict[str, tuple[str, type[msgspec.Struct]]] = {}  # path -> (operation, body Struct)
    surface: dict[str, InferenceEndpoint] = {}
    # -- running a job for a client ------------------------------------------------------------------
    async def collect(job: Job) -> tuple[shapes.Choices, Done]:
        choices = shapes.Choices()
        while isinstance(event := await job.next_event(engine.cancel), Delta):  # then its Done, or it raises
            choices.add(event)
        return choices, event

    async def unless_disconnected(request: Request, job: Job, waiting):
        """Await `waiting` (about `job`). If the client goes away first, the job
        is cancelled (a queued one dropped, a submitted one stopped by its
        worker, which frees the slot) and None is returned once it has ended.
        The connection says when its client goes (edge.listener.Disconnect); under
        another ASGI server, a task waits for http.disconnect instead."""
        disconnect = request.scope.get(DISCONNECT_KEY)
        watcher = None
        if disconnect is None:
            disconnect = Disconnect()
            watcher = asyncio.create_task(watch_for_disconnect(request.receive, disconnect))
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

    async def serve_job(request: Request, endpoint: str, model: str, job_request: dict, sse_shape, to_json,
                        job_endpoint: str = "chat"):
        """Run one inference request: as SSE when `sse_shape` is given, else as
        the JSON that `to_json(choices, done)` builds. However the handler ends
        (a client gone at any moment, an error, a cancelled task), the job is
        cancelled unless finished: no slot outlives its request."""
        if sse_shape is None and job_endpoint != "embeddings":
            job_request["stream"] = False  # wanted whole: a runtime that can answer whole does (its own bytes)
        tenant = request.scope.get(TENANT_KEY, DEFAULT_TENANT)
        try:
            # routing "prefix" on replicas that report their cache: the prompt's token ids first
            tokens = await admission.prompt_tokens(tenant, model, job_request, job_endpoint)
            job = admission.submit(tenant, model, job_request, job_endpoint, tokens)
        except PoolError as err:
            metrics.request(model, endpoint, err.status, error=err, tenant=tenant.name)
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
            # a Response skips FastAPI's generic encoder; the request is counted (metrics, request
            # log) once its answer is written, not while the client waits for it
            return AnswerJSON(to_json(choices, done),
                              background=BackgroundTask(count_after_answer, job, done, endpoint))
        except PoolError as err:
            metrics.request(model, endpoint, err.status, job, error=err)
            raise
        finally:
            if streaming is None:  # else the stream owns the job until its last write
                engine.cancel(job)  # a no-op once the job has finished

    async def count_after_answer(job: Job, done: Done, endpoint: str) -> None:
        """A Response's background, run once its body is handed to the server. The edge writes
        what a loop turn wrote after that turn (edge.listener.CoalescedWrites), so the count is
        put behind that write: it runs in the same turn, before any later request is served."""
        asyncio.get_running_loop().call_soon(metrics.job_done, job, done, endpoint)

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

    def route(path: str, model: type[msgspec.Struct]):
        """POST `path` as a plain Starlette route: `handle(body, data, request)` gets the
        body decoded and validated as `model` (request_body) and its JSON object as sent;
        a PoolError it raises is answered here, in the error envelope (it is already
        counted where it was raised). The OpenAPI document lists the route with `model`'s
        schema (see `document`)."""
        def register(handle):
            async def answer(request: Request):
                raw = await request.body()
                try:
                    body, data = request_body(raw, request.headers.get("content-type"), model)
                except PoolError as err:  # logged with the model the body named, its code and message
                    metrics.request(_named_model(raw), path, err.status, error=err)
                    return error_response(err)
                try:
                    return await handle(body, data, request)
                except PoolError as err:
                    return error_response(err)
            endpoint = surface[path] = InferenceEndpoint(answer)
            app.add_route(path, endpoint, methods=["POST"], name=handle.__name__, include_in_schema=False)
            documented[path] = (handle.__name__, model)
            return handle
        return register

    @route("/v1/responses", rshapes.ResponsesRequest)
    async def create_response(body: rshapes.ResponsesRequest, data: dict, request: Request):
        return await serve_job(request, "responses", body.model, rshapes.job_request_from_responses(body, data),
                               rshapes.ResponsesStream(body) if body.stream else None,
                               lambda choices, done: rshapes.response_json(body, choices, done))

    @route("/v1/chat/completions", shapes.ChatRequest)
    async def chat_completions(body: shapes.ChatRequest, data: dict, request: Request):
        return await serve_job(
            request, "chat_completions", body.model, shapes.job_request(data),
            shapes.ChatStream(body.model, include_usage(body)) if body.stream else None,
            lambda choices, done: shapes.chat_completion(body.model, choices, done))

    @route("/v1/completions", shapes.CompletionRequest)
    async def completions(body: shapes.CompletionRequest, data: dict, request: Request):
        return await serve_job(
            request, "completions", body.model, shapes.job_request(data),
            shapes.CompletionStream(body.model, include_usage(body)) if body.stream else None,
            lambda choices, done: shapes.text_completion(body.model, choices, done), "completions")

    @route("/v1/embeddings", shapes.EmbeddingRequest)
    async def create_embeddings(body: shapes.EmbeddingRequest, data: dict, request: Request):
        if body.stream:
            metrics.request(None, "/v1/embeddings", 400)
            raise PoolError(ErrorCode.INVALID_REQUEST, "stream: embeddings are never streamed", param="stream")
        return await serve_job(request, "embeddings", body.model, shapes.job_request(data), None,
                               lambda choices, done: shapes.embeddings(body.model, done), "embeddings")

    document(app, documented)
    return surface


# -- the OpenAPI document ------------------------------------------------------------------------------
_ERROR_ENVELOPE = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}


def document(app: FastAPI, routes: dict[str, tuple[str, type[msgspec.Struct]]]) -> None:
    """Add `routes` to the app's OpenAPI document, their bodies' schemas made by msgspec
    from the Structs that validate them (FastAPI's documented way to extend the document:
    an `openapi()` of one's own, cached in `app.openapi_schema`)."""
    fastapi_openapi = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = fastapi_openapi()
            models = [model for _, model in routes.values()]
            refs, components = msgspec.json.schema_components(models, ref_template="#/components/schemas/{name}")
            schema.setdefault("components", {}).setdefault("schemas", {}).update(
                {**components, "ErrorEnvelope": _ERROR_ENVELOPE})
            error = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorEnvelope"}}}}
            for (path, (name, _)), ref in zip(routes.items(), refs):
                operation = f"{name}_{path.strip('/').replace('/', '_')}_post"  # as FastAPI names them
                schema.setdefault("paths", {})[path] = {"post": {
                    "summary": name.replace("_", " ").capitalize(), "operationId": operation,
                    "requestBody": {"required": True, "content": {"application/json": {"schema": ref}}},
                    "responses": {
                        "200": {"description": "The answer, or its server-sent events when `stream` is true",
                                "content": {"application/json": {"schema": {"type": "object"}},
                                            "text/event-stream": {"schema": {"type": "string"}}}},
                        "400": {"description": "A body the API refuses", **error},
                        "default": {"description": "An error, in the OpenAI error envelope", **error}}}}
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi


# -- the request body ---------------------------------------------------------------------------------
_decode = msgspec.json.Decoder().decode


def _is_json(content_type: str | None) -> bool:
    """application/json or application/<anything>+json, parameters allowed."""
    if not content_type:
        return False
    media = content_type.partition(";")[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


def request_body(raw: bytes, content_type: str | None, model: type[msgspec.Struct]) -> tuple[msgspec.Struct, dict]:
    """The body decoded as a JSON object and validated as `model` (strictly: "5" is not an
    int), and the object itself. A client error is a PoolError naming where it is: `param`
    "body" for a body that is not JSON, the field's dotted path for a wrong field, and none
    for a body that is absent, sent as another type, or not an object."""
    if not raw:
        raise PoolError(ErrorCode.INVALID_REQUEST, "body: Field required")
    if not _is_json(content_type):
        raise PoolError(ErrorCode.INVALID_REQUEST, f"body: expected a JSON object sent as application/json, "
                        f"got {(content_type or 'no Content-Type')[:100]!r}")
    try:
        data = _decode(raw)
    except (msgspec.DecodeError, RecursionError):
        data = _lenient_decode(raw)  # NaN, Infinity or huge numbers: the field's range refuses them below
    if not isinstance(data, dict):
        raise PoolError(ErrorCode.INVALID_REQUEST, f"body: Expected `object`, got `{type(data).__name__}`")
    try:
        return msgspec.convert(data, model, strict=True), data
    except msgspec.ValidationError as exc:
        message, param = _located(str(exc))
        raise PoolError(ErrorCode.INVALID_REQUEST, f"{param or 'body'}: {message}", param=param) from None


def _lenient_decode(raw: bytes):
    """What msgspec refuses, read by the standard library, which takes NaN and the infinities
    (a wrong value of a field, not a broken body) and says where a broken body breaks."""
    try:
        return json.loads(raw)
    except json.JSONDecodeError as exc:
        raise PoolError(ErrorCode.INVALID_REQUEST, f"body: not valid JSON at offset {exc.pos}: {exc.msg}",
                        param="body") from None
    except (RecursionError, UnicodeDecodeError, ValueError):
        raise PoolError(ErrorCode.INVALID_REQUEST, "body: There was an error parsing the body",
                        param="body") from None


def _named_model(raw: bytes) -> str | None:
    """The "model" a refused body named, for the request log (the error path only)."""
    try:
        data = msgspec.json.decode(raw)
    except (msgspec.DecodeError, RecursionError):
        return None
    model = data.get("model") if isinstance(data, dict) else None
    return model if isinstance(model, str) else None


_AT = re.compile(r"^(.*?)(?: - at `\$(.*)`)?$", re.DOTALL)
_MISSING = re.compile(r"missing required field `([^`]*)`")


def _located(error: str) -> tuple[str, str | None]:
    """msgspec's "Expected ... - at `$.messages[0].role`" as ("Expected ...", "messages.0.role");
    a missing field is named in the path as well."""
    message, path = _AT.match(error).groups()
    parts = re.findall(r"\.([^.\[]+)|\[(\d+)\]", path or "")
    names = [name or index for name, index in parts]
    if missing := _MISSING.search(message):
        names.append(missing.group(1))
        message = "Field required"
    return message, ".".join(names) or None
