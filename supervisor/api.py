"""HTTP API: OpenAI-compatible inference, health, and the admin surface.

This layer only translates: request bodies to job requests, job events to
Responses / Chat Completions JSON and SSE, PoolErrors to the error envelope.
Queueing and scheduling live in the engine and its executors."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from protocol import Delta, Done
from protocol.errors import ERROR_TYPE, ErrorCode, PoolError
from supervisor import admin_feeds, ui
from supervisor import openai_shapes as shapes
from supervisor.config import PoolConfig
from supervisor.engine import ModelRouterEngine
from supervisor.http_guard import AccessGate, BodySizeLimit, error_response
from supervisor.jobs import Job
from supervisor.live import Activity
from supervisor.metrics import Metrics
from supervisor.observe import worker_views

log = logging.getLogger("llm_pool.api")
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse_frame(event: dict) -> bytes:
    """One server-sent event: {"data": str} with an optional "event" name. The
    data is compact JSON (or [DONE]): never a newline inside."""
    if "event" in event:
        return f"event: {event['event']}\ndata: {event['data']}\n\n".encode()
    return f"data: {event['data']}\n\n".encode()


class JobStream(StreamingResponse):
    """An SSE response that owns its job: when the response ends for any
    reason (done, client gone before or during the body, a failed write), the
    job is cancelled unless it has finished. A generator's own `finally` is
    not enough: a body that never starts never runs it."""

    def __init__(self, job: Job, cancel, body) -> None:
        super().__init__(body, media_type="text/event-stream", headers=SSE_HEADERS)
        self.job = job
        self.cancel = cancel

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.cancel(self.job)


def create_app(config: PoolConfig) -> FastAPI:
    engine = ModelRouterEngine(config)
    api_key = config.server.api_key or os.environ.get("LLM_POOL_API_KEY")
    admin_key = config.server.admin_key or os.environ.get("LLM_POOL_ADMIN_KEY")

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await engine.start()
        activity.start()
        yield
        await engine.shutdown(config.server.shutdown_grace_s)
        await activity.close()

    app = FastAPI(title="llm-pool", version="0.1.0", lifespan=lifespan)
    app.state.engine = engine
    app.state.activity = activity = Activity(engine)  # the request log and the live samples
    metrics = Metrics(engine, on_finished=activity.finished)
    app.include_router(admin_feeds.router)
    app.include_router(ui.router)
    app.add_middleware(BodySizeLimit, limit=config.server.max_body_bytes)
    app.add_middleware(AccessGate, server=config.server, api_key=api_key, admin_key=admin_key)  # runs first

    # -- errors -------------------------------------------------------------------------------
    @app.exception_handler(PoolError)
    async def _pool_error(request: Request, exc: PoolError):
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        err = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        metrics.request(None, request.url.path, 400)
        if err.get("type") == "json_invalid":  # its loc is ("body", offset): name the body, not the offset
            where = err.get("loc", ())[-1]
            reason = (err.get("ctx") or {}).get("error", "")
            return error_response(PoolError(ErrorCode.INVALID_REQUEST,
                                            f"body: not valid JSON at offset {where}: {reason}", param="body"))
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        param = ".".join(loc) or None
        return error_response(PoolError(ErrorCode.INVALID_REQUEST,
                                        f"{param or 'body'}: {err.get('msg')}", param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 400:  # FastAPI could not parse the body (e.g. JSON nested too deep)
            metrics.request(None, request.url.path, 400)
            return error_response(PoolError(ErrorCode.INVALID_REQUEST, f"body: {exc.detail}", param="body"))
        return JSONResponse({"error": {"message": str(exc.detail), "type": ERROR_TYPE.get(exc.status_code,
                                       "invalid_request_error"), "param": None, "code": None}},
                            status_code=exc.status_code, headers=exc.headers)

    # -- running a job for a client ------------------------------------------------------------------
    async def collect(job: Job) -> tuple[str, Done]:
        parts = []
        async for event in job.stream(engine.cancel):
            if isinstance(event, Delta):
                parts.append(event.text)
            else:
                return "".join(parts), event
        raise PoolError(ErrorCode.RUNTIME_ERROR, "job ended without a result")

    async def unless_disconnected(request: Request, job: Job, waiting):
        """Await `waiting` (about `job`). If the client goes away first, the job
        is cancelled (a queued one dropped, a submitted one stopped by its
        worker, which frees the slot) and None is returned once it has ended."""
        gone = False

        async def watch() -> None:
            nonlocal gone
            while (await request.receive())["type"] != "http.disconnect":
                pass
            gone = True
            engine.cancel(job)

        watcher = asyncio.create_task(watch())
        try:
            result = await waiting
        except PoolError:
            if gone:
                return None
            raise
        finally:
            watcher.cancel()
        return None if gone else result

    # -- inference ----------------------------------------------------------------------------
    async def serve_job(request: Request, endpoint: str, model: str, job_request: dict, sse_shape, to_json):
        """Run one inference request: as SSE when `sse_shape` is given, else as
        the JSON that `to_json(text, done)` builds. However the handler ends (a
        client gone at any moment, an error, a cancelled task), the job is
        cancelled unless finished: no slot outlives its request."""
        try:
            job = engine.submit(model, job_request)
        except PoolError as err:
            metrics.request(model, endpoint, err.status, error=err)
            raise
        streaming = None
        try:
            if sse_shape is not None:
                first = await first_event(request, job)
                if first is None:
                    return Response(status_code=499)
                streaming = JobStream(job, engine.cancel, _sse(job, endpoint, sse_shape, first))
                return streaming
            result = await unless_disconnected(request, job, collect(job))
            if result is None:
                return Response(status_code=499)
            text, done = result
            metrics.job_done(job, done, endpoint)
            return JSONResponse(to_json(text, done))  # a Response skips FastAPI's generic encoder
        except PoolError as err:
            metrics.request(model, endpoint, err.status, job, error=err)
            raise
        finally:
            if streaming is None:  # else the stream owns the job until its last write
                engine.cancel(job)  # a no-op once the job has finished

    async def first_event(request: Request, job: Job):
        """Hold the response headers until the job's first event, so that a
        failure before any token (queue timeout, upstream 429, crash) is a plain
        HTTP error the client can retry, not a stream that fails at once."""
        return await unless_disconnected(request, job, job.next_event(engine.cancel))

    async def _sse(job: Job, endpoint: str, shape, first):
        """The SSE body. What is ready goes out in one write: the opening events
        with the first delta, then each delta (merged if several were waiting),
        then the closing events. A client that leaves cancels the job (see JobStream)."""
        try:
            ready = [sse_frame(e) for e in shape.opening()]
            event = first
            while True:
                if isinstance(event, Delta):
                    ready.append(sse_frame(shape.delta(event.text)))
                elif isinstance(event, Done):
                    metrics.job_done(job, event, endpoint)
                    ready += [sse_frame(e) for e in shape.closing(event.finish_reason, event.usage)]
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

    @app.post("/v1/responses")
    async def create_response(body: shapes.ResponsesRequest, request: Request):
        def to_json(text: str, done: Done) -> dict:
            status = shapes.response_status(done.finish_reason)
            item = shapes.message_item(shapes.new_id("msg"), text,
                                       "completed" if status == "completed" else "incomplete")
            return shapes.response_object(body, shapes.new_id("resp"), int(time.time()), status=status,
                                          output=[item], usage=done.usage)

        return await serve_job(request, "responses", body.model, shapes.job_request_from_responses(body),
                               shapes.ResponsesStream(body) if body.stream else None, to_json)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: shapes.ChatRequest, request: Request):
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return await serve_job(
            request, "chat_completions", body.model, shapes.job_request_from_chat(body),
            shapes.ChatStream(body.model, include_usage) if body.stream else None,
            lambda text, done: shapes.chat_completion(body.model, text, done.finish_reason, done.usage))

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": engine.model_list()}

    # -- health --------------------------------------------------------------------------------------
    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/ready")
    async def ready():
        if engine.ready():
            return {"status": "ready"}
        waiting = [n for n, e in engine.models.items() if e.cfg.load_on_start and e.state.value != "loaded"]
        return JSONResponse({"status": "not_ready", "waiting_for": waiting}, status_code=503)

    # -- admin ----------------------------------------------------------------------------------------
    @app.get("/admin/models")
    async def admin_models():
        return {"models": [engine.model_view(e) for e in engine.models.values()]}

    @app.post("/admin/models/{name}/load")
    async def admin_load(name: str):
        return engine.model_view(await engine.load(name))

    @app.post("/admin/models/{name}/unload")
    async def admin_unload(name: str):
        return engine.model_view(await engine.unload(name))

    @app.post("/admin/models/{name}/restart")
    async def admin_restart(name: str, replica: int | None = None):
        if replica is not None:
            check_replica(name, replica)
        return engine.model_view(await engine.restart(name, replica))

    @app.post("/admin/reload")
    async def admin_reload():
        """Re-read the config file and apply the difference (400 and no change for a bad one)."""
        return await engine.reload()

    @app.get("/admin/workers")
    async def admin_workers():
        replicas = [r for e in engine.models.values() if e.executor for r in e.executor.replicas]
        return {"workers": worker_views(replicas)}

    @app.get("/admin/models/{name}/logs")
    async def admin_logs(name: str, replica: int = 0, lines: int = 200):
        """The tail of one replica's log (the worker's and its backend's output)."""
        check_replica(name, replica)
        path = engine.log_dir / f"{name}-{replica}.log"
        if not path.is_file():
            raise PoolError(ErrorCode.INVALID_REQUEST, f"no log for {name}/{replica} yet", param="replica")
        return {"model": name, "replica": replica, "path": str(path),
                "lines": tail_lines(path, max(1, min(lines, 10000)))}

    def check_replica(name: str, replica: int) -> None:
        count = engine.entry(name).cfg.replicas
        if not 0 <= replica < count:
            shown = str(replica) if abs(replica) < 10**12 else "that big"
            raise PoolError(ErrorCode.INVALID_REQUEST, f"model {name!r} has no replica {shown} "
                            f"(it has 0 to {count - 1})", param="replica")

    return app


def tail_lines(path, count: int) -> list[str]:
    """The last `count` lines of a file, reading only its end."""
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        block = min(size, 256 * count)
        f.seek(size - block)
        return f.read().decode(errors="replace").splitlines()[-count:]
