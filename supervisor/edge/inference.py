"""The inference surface: /v1/chat/completions, /v1/completions, /v1/embeddings and
/v1/responses. A request passes its stages in the order of `InferenceSurface`'s
methods: the body decoded (schemas.request_body) → admitted (admission: scope,
limits, the tenant's token reserve, the model's queue) → run as a job → shaped
(openai_shapes, responses_shapes) as one JSON answer or an SSE stream
(streams.JobStream). This module only translates bodies and job events; the
queue, capacity, drain and cancel are the engine's."""

from __future__ import annotations

import asyncio
import functools

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.background import BackgroundTask

from protocol import Delta, Done
from protocol.errors import ErrorCode, PoolError
from supervisor import anthropic_shapes as ashapes
from supervisor import openai_shapes as shapes
from supervisor import responses_shapes as rshapes
from supervisor.admission import DEFAULT_TENANT
from supervisor.edge.guard import ANTHROPIC_PATHS, TENANT_KEY, error_response
from supervisor.edge.listener import DISCONNECT_KEY, Disconnect
from supervisor.edge.schemas import document, named_model, request_body
from supervisor.edge.streams import AnswerJSON, InferenceEndpoint, JobStream, sse_frame, watch_for_disconnect
from supervisor.jobs import Job
from supervisor.metrics import CLIENT_CLOSED


def include_usage(body) -> bool:
    return bool(body.stream_options and body.stream_options.include_usage)


class InferenceSurface:
    """The inference endpoints, by path (`endpoints`), which the guard hands inference
    POSTs to directly (each ASGI layer and router costs on every request, and these
    endpoints need none of the app's: they answer their own errors). The same endpoints
    are plain routes on `app` too, so that other methods get the app's 405, and their
    bodies' schemas go in its OpenAPI document."""

    def __init__(self, app: FastAPI, engine, admission, metrics, config) -> None:
        self.engine = engine
        self.admission = admission
        self.metrics = metrics
        self.sse_ping_s = config.server.sse_ping_s
        self.endpoints: dict[str, InferenceEndpoint] = {}
        documented: dict[str, tuple[str, type[msgspec.Struct]]] = {}  # path -> (operation, body Struct)
        for path, body_type, handle in (
                ("/v1/responses", rshapes.ResponsesRequest, self.create_response),
                ("/v1/chat/completions", shapes.ChatRequest, self.chat_completions),
                ("/v1/completions", shapes.CompletionRequest, self.completions),
                ("/v1/embeddings", shapes.EmbeddingRequest, self.create_embeddings),
                ("/v1/messages", ashapes.MessagesRequest, self.create_message)):
            endpoint = self.endpoints[path] = InferenceEndpoint(functools.partial(self.answer, path, body_type, handle),
                                                                ids=path.startswith(ANTHROPIC_PATHS))
            app.add_route(path, endpoint, methods=["POST"], name=handle.__name__, include_in_schema=False)
            documented[path] = (handle.__name__, body_type)
        document(app, documented)

    # -- 1. the body ----------------------------------------------------------------------------------------
    async def answer(self, path: str, body_type: type[msgspec.Struct], handle, request: Request) -> Response:
        """The body decoded and validated as `body_type`, then `handle(body, data, request)`
        with it and its JSON object as sent. A PoolError is answered here, in the error
        envelope (it is counted where it was raised)."""
        raw = await request.body()
        try:
            body, data = request_body(raw, request.headers.get("content-type"), body_type)
        except PoolError as err:  # logged with the model the body named, its code and message
            self.metrics.request(named_model(raw), path, err.status, error=err)
            return error_response(err, path)
        try:
            return await handle(body, data, request)
        except PoolError as err:
            return error_response(err, path)

    # -- 2. the endpoints: what each asks of a job and how its answer is shaped -----------------------------------
    async def create_response(self, body: rshapes.ResponsesRequest, data: dict, request: Request):
        return await self.serve_job(request, "responses", body.model, rshapes.job_request_from_responses(body, data),
                                    rshapes.ResponsesStream(body) if body.stream else None,
                                    lambda choices, done: rshapes.response_json(body, choices, done))

    async def chat_completions(self, body: shapes.ChatRequest, data: dict, request: Request):
        return await self.serve_job(
            request, "chat_completions", body.model, shapes.job_request(data),
            shapes.ChatStream(body.model, include_usage(body)) if body.stream else None,
            lambda choices, done: shapes.chat_completion(body.model, choices, done))

    async def completions(self, body: shapes.CompletionRequest, data: dict, request: Request):
        return await self.serve_job(
            request, "completions", body.model, shapes.job_request(data),
            shapes.CompletionStream(body.model, include_usage(body)) if body.stream else None,
            lambda choices, done: shapes.text_completion(body.model, choices, done), "completions")

    async def create_message(self, body: ashapes.MessagesRequest, data: dict, request: Request):
        return await self.serve_job(request, "messages", body.model, ashapes.job_request_from_messages(body, data),
                                    ashapes.MessagesStream(body) if body.stream else None,
                                    lambda choices, done: ashapes.message_json(body, choices, done))

    async def create_embeddings(self, body: shapes.EmbeddingRequest, data: dict, request: Request):
        if body.stream:
            self.metrics.request(None, "/v1/embeddings", 400)
            raise PoolError(ErrorCode.INVALID_REQUEST, "stream: embeddings are never streamed", param="stream")
        return await self.serve_job(request, "embeddings", body.model, shapes.job_request(data), None,
                                    lambda choices, done: shapes.embeddings(body.model, done), "embeddings")

    # -- 3. admission, then the job ------------------------------------------------------------------------------
    async def serve_job(self, request: Request, endpoint: str, model: str, job_request: dict, sse_shape, to_json,
                        job_endpoint: str = "chat"):
        """Run one inference request: as SSE when `sse_shape` is given, else as
        the JSON that `to_json(choices, done)` builds. However the handler ends
        (a client gone at any moment, an error, a cancelled task), the job is
        cancelled unless finished: no slot outlives its request."""
        if sse_shape is None and job_endpoint != "embeddings":
            job_request["stream"] = False  # wanted whole: a runtime that can answer whole does (its own bytes)
        job = await self.admit(request, endpoint, model, job_request, job_endpoint)
        streaming = None
        try:
            if sse_shape is not None:
                first = await self.first_event(request, job)
                if first is None:
                    return self.client_gone(job, endpoint)
                streaming = JobStream(job, functools.partial(self.end_stream, endpoint=endpoint),
                                      self.sse_body(job, endpoint, sse_shape, first))
                return streaming
            result = await self.unless_disconnected(request, job, self.collect(job))
            if result is None:
                return self.client_gone(job, endpoint)
            choices, done = result
            # a Response skips FastAPI's generic encoder; the request is counted (metrics, request
            # log) once its answer is written, not while the client waits for it
            return AnswerJSON(to_json(choices, done),
                              background=BackgroundTask(self.count_after_answer, job, done, endpoint))
        except PoolError as err:
            self.metrics.request(model, endpoint, err.status, job, error=err)
            raise
        finally:
            if streaming is None:  # else the stream owns the job until its last write
                self.engine.cancel(job)  # a no-op once the job has finished

    async def admit(self, request: Request, endpoint: str, model: str, job_request: dict, job_endpoint: str) -> Job:
        """The job, queued by admission for the request's tenant (the guard found it by its key)."""
        tenant = request.scope.get(TENANT_KEY, DEFAULT_TENANT)
        try:
            return await self.admission.admit(tenant, model, job_request, job_endpoint)
        except PoolError as err:
            self.metrics.request(model, endpoint, err.status, error=err, tenant=tenant.name)
            raise

    # -- 4. waiting for the job, with the client -------------------------------------------------------------------
    async def collect(self, job: Job) -> tuple[shapes.Choices, Done]:
        choices = shapes.Choices()
        while isinstance(event := await job.next_event(self.engine.cancel), Delta):  # then its Done, or it raises
            choices.add(event)
        return choices, event

    async def first_event(self, request: Request, job: Job):
        """Hold the response headers until the job's first event, so that a
        failure before any token (queue timeout, upstream 429, crash, the
        runtime's 400) is a plain HTTP error the client can act on, not a
        stream that fails at once."""
        return await self.unless_disconnected(request, job, job.next_event(self.engine.cancel))

    async def unless_disconnected(self, request: Request, job: Job, waiting):
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
        disconnect.on_gone(functools.partial(self.engine.cancel, job))
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

    # -- 5. shaping the answer -----------------------------------------------------------------------------------
    async def sse_body(self, job: Job, endpoint: str, shape, first):
        """The SSE body. What is ready goes out in one write: the opening events
        with the first delta, then each delta (merged if several were waiting),
        then the closing events. A client that leaves cancels the job (see JobStream)."""
        text_sse = getattr(shape, "text_sse", None)  # a shape's fast path for plain text
        try:
            ready = [sse_frame(e) for e in shape.opening(first)]  # the runtime's own opening, if it sent one
            event = first
            while True:
                if isinstance(event, Delta):
                    if text_sse is not None and not event.parts and event.text:
                        ready.append(text_sse(event.text))
                    else:
                        ready += [sse_frame(e) for e in shape.delta(event)]
                elif isinstance(event, Done):
                    self.metrics.job_done(job, event, endpoint)
                    ready += [sse_frame(e) for e in shape.closing(event)]
                    yield b"".join(ready)
                    return
                else:  # quiet for sse_ping_s: a comment keeps proxies from timing the stream out
                    ready.append(b": ping\n\n")
                yield b"".join(ready)
                ready = []
                event = await job.next_event(self.engine.cancel, idle_s=self.sse_ping_s)
        except PoolError as err:
            self.metrics.request(job.model, endpoint, err.status, job, error=err)
            yield b"".join([*ready, *(sse_frame(e) for e in shape.failed(err))])

    # -- 6. the end: counted -----------------------------------------------------------------------------------
    async def count_after_answer(self, job: Job, done: Done, endpoint: str) -> None:
        """A Response's background, run once its body is handed to the server. The edge writes
        what a loop turn wrote after that turn (edge.writes.CoalescedWrites), so the count is
        put behind that write: it runs in the same turn, before any later request is served."""
        asyncio.get_running_loop().call_soon(self.metrics.job_done, job, done, endpoint)

    def client_gone(self, job: Job, endpoint: str) -> Response:
        self.metrics.client_gone(job, endpoint)
        return Response(status_code=CLIENT_CLOSED)  # nobody reads it: for the access log

    def end_stream(self, job: Job, endpoint: str) -> None:
        """A stream's last act, however it ended: its job is cancelled unless finished,
        and a client that left before the end is counted."""
        self.engine.cancel(job)
        self.metrics.client_gone(job, endpoint)
