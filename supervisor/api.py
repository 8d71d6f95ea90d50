"""HTTP API: OpenAI-compatible inference, health, and the admin surface.

This layer only translates: request bodies to job requests, job events to
Responses / Chat Completions JSON and SSE, PoolErrors to the error envelope.
Queueing and scheduling live in the engine and its executors."""

from __future__ import annotations

import hmac
import logging
import os
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from protocol.errors import ErrorCode, PoolError
from supervisor.config import PoolConfig
from supervisor.engine import ModelRouterEngine
from supervisor.inference import ENDPOINTS, add_inference_routes
from supervisor.metrics import Metrics
from supervisor.observe import worker_views

log = logging.getLogger("llm_pool.api")


def _error_response(err: PoolError) -> JSONResponse:
    headers = {}
    if err.retry_after_s is not None:
        headers["Retry-After"] = str(int(err.retry_after_s))
    if err.code in (ErrorCode.LOAD_FAILED, ErrorCode.INVALID_REQUEST):
        headers["x-should-retry"] = "false"
    return JSONResponse(err.envelope(), status_code=err.status, headers=headers)


class BodySizeLimit:
    """Refuse request bodies over `limit` bytes with 413: at once when the
    Content-Length says so, else while reading (the body is buffered up to the
    limit and then replayed to the app)."""

    def __init__(self, app, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        def too_large() -> JSONResponse:
            return _error_response(PoolError(ErrorCode.REQUEST_TOO_LARGE, f"request body over {self.limit} bytes"))

        for name, value in scope.get("headers", ()):
            if name == b"content-length" and value.isdigit() and int(value) > self.limit:
                return await too_large()(scope, receive, send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left while sending
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:
                return await too_large()(scope, receive, send)
            if not message.get("more_body"):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()  # after the body: disconnect notices pass through

        return await self.app(scope, replay, send)


class KeyGate:
    """API keys, checked before anything reads the request: /v1/* needs the
    inference key or the admin key, /admin/* the admin key; a key that is not
    configured leaves its paths open. (An ASGI layer, not a FastAPI
    dependency: it is on every request's path, and costs less here.)"""

    def __init__(self, app, api_key: str | None, admin_key: str | None) -> None:
        self.app = app
        self.inference = [k.encode() for k in (api_key, admin_key) if k] if api_key else []
        self.admin = [admin_key.encode()] if admin_key else []

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            path = scope["path"]
            wanted = self.inference if path.startswith("/v1/") else self.admin if path.startswith("/admin/") else []
            if wanted and not self._allowed(scope["headers"], wanted):
                denied = _error_response(PoolError(ErrorCode.UNAUTHORIZED, "missing or wrong API key"))
                return await denied(scope, receive, send)
        return await self.app(scope, receive, send)

    @staticmethod
    def _allowed(headers, wanted: list[bytes]) -> bool:
        given = b""
        for name, value in headers:
            if name == b"authorization" and value[:7].lower() == b"bearer ":
                given = value[7:]
                break
            if name == b"x-api-key":
                given = value
        return any(hmac.compare_digest(given, k) for k in wanted)


def create_app(config: PoolConfig) -> FastAPI:
    engine = ModelRouterEngine(config)
    api_key = config.server.api_key or os.environ.get("LLM_POOL_API_KEY")
    admin_key = config.server.admin_key or os.environ.get("LLM_POOL_ADMIN_KEY")

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await engine.start()
        yield
        await engine.shutdown(config.server.shutdown_grace_s)

    app = FastAPI(title="llm-pool", version="0.1.0", lifespan=lifespan)
    app.state.engine = engine
    metrics = Metrics(engine)
    app.add_middleware(BodySizeLimit, limit=config.server.max_body_bytes)
    app.add_middleware(KeyGate, api_key=api_key, admin_key=admin_key)  # outermost: runs first

    # -- errors -------------------------------------------------------------------------------
    @app.exception_handler(PoolError)
    async def _pool_error(request: Request, exc: PoolError):
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        err = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        param = ".".join(loc) or None
        metrics.request("", ENDPOINTS.get(request.url.path, request.url.path), 400)
        return _error_response(PoolError(ErrorCode.INVALID_REQUEST,
                                         f"{param or 'body'}: {err.get('msg')}", param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        return JSONResponse({"error": {"message": str(exc.detail), "type": "invalid_request_error",
                                       "param": None, "code": None}}, status_code=exc.status_code)

    add_inference_routes(app, engine, metrics, config)

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": 0, "owned_by": "llm-pool",
             "state": entry.state.value} for name, entry in engine.models.items()]}

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
        return engine.model_view(await engine.restart(name, replica))

    @app.get("/admin/workers")
    async def admin_workers():
        replicas = [r for e in engine.models.values() if e.executor for r in e.executor.replicas]
        return {"workers": worker_views(replicas)}

    @app.get("/admin/models/{name}/logs")
    async def admin_logs(name: str, replica: int = 0, lines: int = 200):
        """The tail of one replica's log (the worker's and its backend's output)."""
        engine.entry(name)
        path = engine.log_dir / f"{name}-{replica}.log"
        if not path.is_file():
            raise PoolError(ErrorCode.INVALID_REQUEST, f"no log for {name}/{replica} yet", param="replica")
        return {"model": name, "replica": replica, "path": str(path),
                "lines": tail_lines(path, max(1, min(lines, 10000)))}

    return app


def tail_lines(path, count: int) -> list[str]:
    """The last `count` lines of a file, reading only its end."""
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        block = min(size, 256 * count)
        f.seek(size - block)
        return f.read().decode(errors="replace").splitlines()[-count:]
