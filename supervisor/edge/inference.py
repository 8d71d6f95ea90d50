"""The inference surface: /v1/chat/completions, /v1/completions, /v1/embeddings,
/v1/responses, /v1/messages (and its count_tokens), and the runtime's own calls (/tokenize,
/detokenize, /apply-template, /v1/rerank). A request passes its stages in the order of `InferenceSurface`'s
methods: the body decoded (schemas.request_body) → admitted (admission: scope,
limits, the tenant's token reserve, the model's queue) → run as a job → shaped
(openai_shapes, responses_shapes) as one JSON answer or an SSE stream
(streams.JobStream). This module only translates bodies and job events; the
queue, capacity, drain and cancel are the engine's."""

from __future__ import annotations

import asyncio
import functools
import time
from typing import TYPE_CHECKING

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import Response

from protocol import Delta, Done
from protocol.errors import ErrorCode, PoolError
from supervisor.shapes import anthropic as ashapes
from supervisor.shapes import ollama as oshapes
from supervisor.shapes import openai as shapes
from supervisor.shapes import responses as rshapes
from supervisor.shapes import runtime_calls as cshapes
from supervisor.admission.admit import DEFAULT_TENANT
from supervisor.edge.guard import TENANT_KEY, error_response, tenant_name
from supervisor.edge.listener import DISCONNECT_KEY, Disconnect
from supervisor.edge.request_ids import SKIPPED_TOOLS
from supervisor.edge.schemas import document, named_model, request_body
from supervisor.edge.streams import AnswerJSON, InferenceEndpoint, JobStream, sse_frame, watch_for_disconnect
from supervisor.admission.fallback_chains import Chain
from supervisor.scheduling.jobs import Job
from supervisor.admission.prompt_bounds import check_prompt_bounds
from supervisor.models.capabilities import CALLS, capabilities, native_input_tokens, native_messages
from supervisor.models.views import served_context
from supervisor.states import JOB_FINISHED, JobState
from supervisor.telemetry.metrics import CLIENT_CLOSED

if TYPE_CHECKING:
    from supervisor.admission.admit import Admission
    from supervisor.config import PoolConfig
    from supervisor.engine import ModelRouterEngine
    from supervisor.telemetry.metrics import Metrics


SESSION_HEADER = "x-claude-code-session-id"  # a Messages client's session: a key for routing = "session"
WAITING = "waiting"  # first_event: no event yet within stream_head_hold_s


async def read_body(receive) -> bytes:
    """The request's body from its ASGI messages; b"" when the client left before its end."""
    message = await receive()
    if message["type"] != "http.request":
        return b""
    body = message.get("body", b"")
    if not message.get("more_body"):
        return body
    chunks = [body]
    while message.get("more_body"):
        message = await receive()
        if message["type"] != "http.request":
            return b""
        chunks.append(message.get("body", b""))
    return b"".join(chunks)


def include_usage(body) -> bool:
    return bool(body.stream_options and body.stream_options.include_usage)


class InferenceSurface:
    """The inference endpoints, by path (`endpoints`), which the guard hands inference
    POSTs to directly (each ASGI layer and router costs on every request, and these
    endpoints need none of the app's: they answer their own errors). The same endpoints
    are plain routes on `app` too, so that other methods get the app's 405, and their
    bodies' schemas go in its OpenAPI document."""

    def __init__(self, app: FastAPI, engine: ModelRouterEngine, admission: Admission, metrics: Metrics,
                 config: PoolConfig) -> None:
        self.engine = engine
        self.admission = admission
        self.metrics = metrics
        self.sse_ping_s = config.server.sse_ping_s
        self.head_hold_s = config.server.stream_head_hold_s
        self.endpoints: dict[str, InferenceEndpoint] = {}
        documented: dict[str, tuple[str, type[msgspec.Struct]]] = {}  # path -> (operation, body Struct)
        for path, body_type, handle in (
                ("/v1/responses", rshapes.ResponsesRequest, self.create_response),
                ("/v1/chat/completions", shapes.ChatRequest, self.chat_completions),
                ("/v1/completions", shapes.CompletionRequest, self.completions),
                ("/v1/embeddings", shapes.EmbeddingRequest, self.create_embeddings),
                ("/v1/messages", ashapes.MessagesRequest, self.create_message),
                ("/v1/messages/count_tokens", ashapes.CountTokensRequest, self.count_tokens),
                ("/api/chat", oshapes.ChatBody, self.ollama_chat),
                ("/api/generate", oshapes.GenerateBody, self.ollama_generate),
                *((path, shapes.ChatRequest, self.chat_input_tokens) for path in cshapes.INPUT_TOKENS_PATHS),
                *((path, cshapes.RerankRequest if label == "rerank" else cshapes.RuntimeCall,
                   functools.partial(self.runtime_call, label)) for path, label in cshapes.PATHS.items())):
            endpoint = self.endpoints[path] = InferenceEndpoint(functools.partial(self.answer, path, body_type, handle))
            name = getattr(handle, "__name__", None) or f"{handle.func.__name__}_{handle.args[0]}"
            app.add_route(path, endpoint, methods=["POST"], name=name, include_in_schema=False)
            documented[path] = (name, body_type)
        document(app, documented)

    # -- 1. the body ----------------------------------------------------------------------------------------
    async def answer(self, path: str, body_type: type[msgspec.Struct], handle, request: Request) -> Response:
        """The body decoded and validated as `body_type`, then `handle(body, data, request)`
        with it and its JSON object as sent. A PoolError is answered here, in the error
        envelope (it is counted where it was raised)."""
        # read from the ASGI receive, not request.body(), which would keep the bytes for the
        # request's life: decoded, they are dropped (the guard hands the body over whole, in one
        # message: no copy here)
        raw = await read_body(request.receive)
        try:
            body, data = request_body(raw, request.headers.get("content-type"), body_type)
        except PoolError as err:  # logged with the model the body named, its code and message
            self.metrics.request(named_model(raw), path, err.status, error=err, tenant=tenant_name(request.scope))
            return error_response(err, path)
        del raw
        try:
            return await handle(body, data, request)
        except PoolError as err:
            return error_response(err, path)

    # -- 2. the endpoints: what each asks of a job and how its answer is shaped -----------------------------------
    # A stream's shape is made once the model that serves is known (a fallback's name is the answer's `model`)
    async def create_response(self, body: rshapes.ResponsesRequest, data: dict, request: Request):
        """Mapped onto chat inside the request's path (serve_job), so that a body refused while it
        is mapped is counted and logged as any refusal. Tools skipped in the mapping are said in
        the answer's header and the request log (request_ids.SKIPPED_TOOLS)."""
        mapped: list[rshapes.ResponsesJob] = []

        def job_for(model: str) -> tuple[dict, str]:  # the same for every model of a fallback chain
            if not mapped:
                mapped.append(rshapes.job_request_from_responses(body, data))
                SKIPPED_TOOLS.set(mapped[0].tools.skipped_text())
            return mapped[0].request, "chat"
        return await self.serve_job(
            request, "responses", body, job_for,
            (lambda: rshapes.ResponsesStream(body, mapped[0], self.context_of(body.model))) if body.stream else None,
            lambda choices, done, job: rshapes.response_json(body, choices, done, mapped[0], self.context_of(body.model)))

    def context_of(self, model: str) -> int | None:
        """The tokens one request may hold on `model`, where its runtime reports it."""
        try:
            return served_context(self.engine.entry(model))
        except PoolError:
            return None

    async def chat_completions(self, body: shapes.ChatRequest, data: dict, request: Request):
        return await self.serve_job(
            request, "chat_completions", body, shapes.job_request(data),
            (lambda: shapes.ChatStream(body.model, include_usage(body))) if body.stream else None,
            lambda choices, done, job: shapes.chat_completion(body.model, choices, done))

    async def completions(self, body: shapes.CompletionRequest, data: dict, request: Request):
        return await self.serve_job(
            request, "completions", body, shapes.job_request(data),
            (lambda: shapes.CompletionStream(body.model, include_usage(body))) if body.stream else None,
            lambda choices, done, job: shapes.text_completion(body.model, choices, done), "completions")

    async def create_message(self, body: ashapes.MessagesRequest, data: dict, request: Request):
        """On the runtime's own /v1/messages where the serving model has one (the body as sent),
        else translated to chat; either way shaped here. Session keys: the client's session
        header, else metadata.user_id."""
        def job_for(model: str) -> tuple[dict, str]:  # a fallback may be of another backend
            if self._native_messages(model):
                return ashapes.native_request(data), "messages"
            cfg = self.model_config(model)
            if cfg is not None:  # the body's blocks counted before translation joins them (and costs)
                check_prompt_bounds(cfg, data)
            return ashapes.job_request_from_messages(body, data), "chat"
        return await self.serve_job(request, "messages", body, job_for,
                                    (lambda: ashapes.MessagesStream(body)) if body.stream else None,
                                    lambda choices, done, job: ashapes.message_json(body, choices, done),
                                    session=request.headers.get(SESSION_HEADER) or ashapes.user_of(body))

    async def ollama_chat(self, body: oshapes.ChatBody, data: dict, request: Request):
        """Ollama's chat, mapped onto the runtime's chat (shapes/ollama.py); streamed as NDJSON unless
        `"stream": false`."""
        timing = oshapes.Timing(time.monotonic())
        body.model = oshapes.model_name(body.model, lambda name: self.model_config(name) is not None)
        return await self.serve_job(
            request, "ollama_chat", body, lambda model: (oshapes.chat_job(body, self.context_of(model)), "chat"),
            (lambda: oshapes.OllamaStream(body, "chat", timing)) if body.stream else None,
            lambda choices, done, job: oshapes.answer(body, "chat", choices, done, timing.of(job)))

    async def ollama_generate(self, body: oshapes.GenerateBody, data: dict, request: Request):
        """Ollama's generate: the prompt through the model's chat template, or as written (`raw`)."""
        timing = oshapes.Timing(time.monotonic())
        body.model = oshapes.model_name(body.model, lambda name: self.model_config(name) is not None)
        return await self.serve_job(
            request, "ollama_generate", body, lambda model: oshapes.generate_job(body, self.context_of(model)),
            (lambda: oshapes.OllamaStream(body, "generate", timing)) if body.stream else None,
            lambda choices, done, job: oshapes.answer(body, "generate", choices, done, timing.of(job)))

    def _native_messages(self, model: str) -> bool:
        cfg = self.model_config(model)
        return cfg is not None and native_messages(cfg)

    async def count_tokens(self, body: ashapes.CountTokensRequest, data: dict, request: Request):
        """{"input_tokens": N}: llama-server's own count of the body as sent; elsewhere the
        runtime's /tokenize of the chat it would get (the same translation as /v1/messages)."""
        cfg = self.model_config(body.model)  # None: no such model, which admission answers (and counts)
        if cfg is None or native_messages(cfg) or "count_tokens" not in capabilities(cfg):
            # the runtime's own count; admission refuses a model that has none
            return await self.serve_job(request, "count_tokens", body, cshapes.call_request(data), None,
                                        lambda choices, done, job: cshapes.call_answer(body.model, done.result),
                                        "count_tokens")
        return await self.serve_job(
            request, "count_tokens", body, ashapes.tokenize_request(body), None,
            lambda choices, done, job: {"input_tokens": cshapes.token_count(done.result)}, "tokenize")

    async def chat_input_tokens(self, body: shapes.ChatRequest, data: dict, request: Request):
        """{"object": "response.input_tokens", "input_tokens": N}: the prompt tokens of a chat body,
        llama-server's own count (its /v1/chat/completions/input_tokens); elsewhere the runtime's
        /tokenize of the chat with its template."""
        cfg = self.model_config(body.model)
        if cfg is None or native_input_tokens(cfg) or "input_tokens" not in capabilities(cfg):
            return await self.serve_job(request, "input_tokens", body, cshapes.call_request(data), None,
                                        lambda choices, done, job: cshapes.call_answer(body.model, done.result),
                                        "input_tokens")
        return await self.serve_job(
            request, "input_tokens", body, cshapes.chat_tokenize_request(data), None,
            lambda choices, done, job: cshapes.input_tokens_answer(cshapes.token_count(done.result)), "tokenize")

    async def runtime_call(self, label: str, body, data: dict, request: Request):
        """/tokenize, /detokenize, /apply-template, /v1/rerank: the runtime's own call, answered whole."""
        return await self.serve_job(request, label, body, cshapes.call_request(data), None,
                                    lambda choices, done, job: cshapes.call_answer(body.model, done.result), label)

    async def create_embeddings(self, body: shapes.EmbeddingRequest, data: dict, request: Request):
        if body.stream:
            err = PoolError(ErrorCode.INVALID_REQUEST, "stream: embeddings are never streamed", param="stream")
            self.metrics.request(body.model, "/v1/embeddings", 400, error=err, tenant=tenant_name(request.scope))
            raise err
        return await self.serve_job(request, "embeddings", body, shapes.job_request(data), None,
                                    lambda choices, done, job: shapes.embeddings(body.model, done), "embeddings")

    # -- 3. admission, then the job, on the model or its fallbacks ---------------------------------------------
    async def serve_job(self, request: Request, endpoint: str, body, job_request, sse_shape, to_json,
                        job_endpoint: str = "chat", session: str | None = None):
        """Run one inference request: as SSE when `sse_shape` (a shape's factory) is given,
        else as the JSON that `to_json(choices, done, job)` builds. `job_request` is the runtime's
        request, or, where its shape depends on the model that serves, a function of that
        model's name giving (request, job endpoint). The model `body` names is tried first,
        then its fallbacks (fallback_chains.Chain), while nothing of an answer has reached
        the client: the one that serves names itself in the answer's `model` and
        `x-llm-pool-served-by`. The runtime's own calls (tokenize, ...) answer for their
        model's tokenizer alone: they have no fallbacks. However the handler ends (a client
        gone at any moment, an error, a cancelled task), the job is cancelled unless
        finished: no slot outlives its request."""
        asked = body.model
        chain = Chain(asked, self.model_config if job_endpoint not in CALLS else lambda name: None)
        try:
            first_cfg = self.model_config(asked)
            if first_cfg is not None:  # one deadline for the whole chain: the first model's
                chain.deadline = time.monotonic() + first_cfg.request_timeout_s
            first_error = err = None
            while (model := chain.next_after(err)) is not None:
                if err is not None and chain.deadline is not None and time.monotonic() >= chain.deadline:
                    break  # the request's time is spent: no other model gets a slot for it
                chain.attempt(model)
                if model != asked:
                    body.model = self.model_config(model).name
                job_for = job_request if callable(job_request) else lambda model: (job_request, job_endpoint)
                try:
                    return await self.attempt(request, endpoint, model, *job_for(model), sse_shape, to_json, chain,
                                              session)
                except PoolError as failed:
                    err = failed
                    first_error = first_error or failed
                    chain.failed(failed)
                    if chain.last_job is not None and chain.last_job.expired(time.monotonic()):
                        break  # its deadline passed while it waited: no other model can meet it now
            body.model = asked
            if chain.fell_back:  # every model failed: the first one's error, saying what was tried
                first_error = PoolError(first_error.code, f"{first_error.message} (tried: {chain.text()})",
                                        param=first_error.param, retry_after_s=first_error.retry_after_s)
            tenant = request.scope.get(TENANT_KEY, DEFAULT_TENANT)
            job = None if chain.fell_back else chain.last_job  # a job's row has its times (queued, ...)
            self.metrics.request(asked, endpoint, first_error.status, job, error=first_error, tenant=tenant.name,
                                 fallback_chain=chain.text() if chain.fell_back else None)
            raise first_error
        finally:
            # a job's record holds its chain (its row names the models tried): the chain lets go of
            # the job with the request, else each request would leave a cycle (job -> record ->
            # chain -> job) that only the cycle collector frees, at about 10 µs a request. Nor does
            # this frame hold the error it raises: its traceback holds the frame (another cycle).
            chain.last_job = first_error = err = None

    async def attempt(self, request: Request, endpoint: str, model: str, job_request: dict, job_endpoint: str,
                      sse_shape, to_json, chain: Chain, session: str | None):
        """One model's try: its answer; PoolError while nothing was sent (another model
        may try). A stream's head waits at most stream_head_hold_s for the job's first event."""
        if sse_shape is None and job_endpoint in ("chat", "completions"):
            job_request["stream"] = False  # wanted whole: a runtime that can answer whole does (its own bytes)
        tenant = request.scope.get(TENANT_KEY, DEFAULT_TENANT)
        job = chain.last_job = await self.admission.admit(tenant, model, job_request, job_endpoint, request.headers,
                                                          session, chain)
        streaming = None
        try:
            if sse_shape is not None:
                first = await self.first_event(request, job)
                if first is None:
                    return self.client_gone(job, endpoint)
                shape = sse_shape()
                streaming = JobStream(job, functools.partial(self.end_stream, endpoint=endpoint),
                                      self.sse_body(job, endpoint, shape, first), self.answer_headers(job),
                                      getattr(shape, "media_headers", None))
                return streaming
            result = await self.unless_disconnected(request, job, self.collect(job))
            if result is None:
                return self.client_gone(job, endpoint)
            choices, done = result
            # the request is counted (metrics, request log) once its answer is written, not while
            # the client waits for it (count_after_answer)
            return AnswerJSON(to_json(choices, done, job), self.answer_headers(job),
                              functools.partial(self.count_after_answer, job, done, endpoint))
        finally:
            if streaming is None and job.state is not JOB_FINISHED:  # else the stream owns the job to its end
                self.engine.cancel(job)

    def model_config(self, name: str):
        """A model's config by its name or an alias; None when there is none."""
        try:
            return self.engine.entry(name).cfg
        except PoolError:
            return None

    @staticmethod
    def answer_headers(job: Job) -> list[tuple[bytes, bytes]]:
        """Who served (after any fallback), and the queue wait and TTFT predicted at admission."""
        headers = [(b"x-llm-pool-served-by", job.model.encode())]
        prediction = job.admitted.prediction
        if prediction is not None:
            headers += [(b"x-queue-wait-predicted-ms", b"%d" % round(prediction.wait_s * 1000)),
                        (b"x-ttft-predicted-ms", b"%d" % round(prediction.ttft_s * 1000))]
        return headers

    # -- 4. waiting for the job, with the client -------------------------------------------------------------------
    async def collect(self, job: Job) -> tuple[shapes.Choices, Done]:
        choices = shapes.Choices()
        while isinstance(event := await job.next_event(self.engine.cancel), Delta):  # then its Done, or it raises
            choices.add(event)
        return choices, event

    async def first_event(self, request: Request, job: Job):
        """Hold the response head until the job's first event, at most stream_head_hold_s,
        so that a failure before any token (queue full, upstream 429, crash, the runtime's
        400) is a plain HTTP error the client can act on (or a fallback takes the request),
        not a stream that fails at once. WAITING past that: the stream starts and says it
        waits (sse_body). None: the client left."""
        return await self.unless_disconnected(request, job, self._first_or_waiting(job))

    async def _first_or_waiting(self, job: Job):
        event = await job.next_event(self.engine.cancel, idle_s=self.head_hold_s)
        return WAITING if event is None else event

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
        then the closing events. A stream that starts before its first event
        (WAITING) opens at once and says that it waits every sse_ping_s (`ping`).
        A client that leaves cancels the job (see JobStream)."""
        text_sse = getattr(shape, "text_sse", None)  # a shape's fast path for plain text
        frame = getattr(shape, "frame", sse_frame)  # a shape's own framing (Ollama's NDJSON), else SSE
        try:
            ready = [frame(e) for e in shape.opening(first)]  # the runtime's own opening, if it sent one
            event = first
            while True:
                if isinstance(event, Delta):
                    if text_sse is not None and not event.parts and event.text:
                        ready.append(text_sse(event.text))
                    else:
                        ready += [frame(e) for e in shape.delta(event)]
                elif isinstance(event, Done):
                    self.metrics.job_done(job, event, endpoint)
                    ready += [frame(e) for e in shape.closing(event)]
                    yield b"".join(ready)
                    return
                else:  # waiting, or quiet for sse_ping_s: a ping keeps clients and proxies from timing out
                    ready.append(self.ping(job, shape))
                yield b"".join(ready)
                ready = []
                event = await job.next_event(self.engine.cancel, idle_s=self.sse_ping_s)
        except PoolError as err:
            self.metrics.request(job.model, endpoint, err.status, job, error=err)
            yield b"".join([*ready, *(frame(e) for e in shape.failed(err))])

    def ping(self, job: Job, shape) -> bytes:
        """A stream's keep-alive: the shape's own where it has one (Anthropic's `ping` event);
        else a comment, which says, while the job waits in its queue, its place and predicted
        start (`: queued position=3 predicted_start_ms=1200`)."""
        own = getattr(shape, "ping_frame", None)
        if own is not None:
            return own
        if job.state is JobState.QUEUED:
            waiting = self.engine.waiting(job)
            if waiting is not None:
                return f": queued position={waiting.position} predicted_start_ms={round(waiting.wait_s * 1000)}\n\n".encode()
        return b": ping\n\n"

    # -- 6. the end: counted -----------------------------------------------------------------------------------
    def count_after_answer(self, job: Job, done: Done, endpoint: str) -> None:
        """Run once a whole answer's body is handed to the server. The edge writes what a loop
        turn wrote after that turn (edge.writes.CoalescedWrites), so the count is put behind
        that write: it runs in the same turn, before any later request is served."""
        asyncio.get_running_loop().call_soon(self.metrics.job_done, job, done, endpoint)

    def client_gone(self, job: Job, endpoint: str) -> Response:
        self.metrics.client_gone(job, endpoint)
        return Response(status_code=CLIENT_CLOSED)  # nobody reads it: for the access log

    def end_stream(self, job: Job, endpoint: str) -> None:
        """A stream's last act, however it ended: its job is cancelled unless finished,
        and a client that left before the end is counted: with the error the pool ended
        the job with while the client did not read (a stream cut at max_unsent_output_bytes:
        504 runtime_timeout), else as gone (499)."""
        unread = job.events[-1] if job.state is JobState.FINISHED and job.events else None
        self.engine.cancel(job)
        if isinstance(unread, PoolError) and not job.counted:
            self.metrics.request(job.model, endpoint, unread.status, job, error=unread)
        else:
            self.metrics.client_gone(job, endpoint)
