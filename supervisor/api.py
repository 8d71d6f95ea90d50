"""HTTP API: the app is wired here: its error handlers, health and /v1/models. The
inference surface is supervisor/edge/inference.py, the admin actions edge/admin.py,
the admin feeds and the page in admin_feeds.py and ui.py. Queueing and scheduling live in the
engine and its executors."""

from __future__ import annotations

import logging
import os
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from protocol.errors import ERROR_TYPE, ErrorCode, PoolError
from supervisor import ui
from supervisor.edge import admin_feeds
from supervisor.edge import admin
from supervisor.edge import ollama
from supervisor.admission.admit import DEFAULT_TENANT, Admission
from supervisor.config import PoolConfig
from supervisor.shapes.anthropic import anthropic_model_page
from supervisor.engine import ModelRouterEngine
from supervisor.edge.guard import TENANT_KEY, HttpEdge, error_response, internal_error, tenant_name
from supervisor.edge.inference import InferenceSurface
from supervisor.edge.schemas import serve_document
from supervisor.telemetry.live import Activity
from supervisor.telemetry.loop_lag import LoopLag
from supervisor.telemetry.metrics import Metrics
from supervisor.models.health import pool_health, readiness
from supervisor.replicas.observe import SAMPLE_EVERY_S
from supervisor.printable import LOG_FORMAT, PrintableFormatter
from supervisor.request_bounds import clip
from supervisor.admission.tenants import Tenants

log = logging.getLogger("llm_pool.api")


def create_app(config: PoolConfig) -> HttpEdge:
    """The ASGI app to serve: the edge (HttpEdge) in front of the FastAPI app (`.app`), so
    that an inference POST passes no layer but the edge's and its own surface's."""
    api_key = config.server.api_key or os.environ.get("LLM_POOL_API_KEY")
    admin_key = config.server.admin_key or os.environ.get("LLM_POOL_ADMIN_KEY")
    engine = ModelRouterEngine(config, tenants=Tenants(config, api_key, admin_key))

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        lag.start()
        activity.start()  # first: the timeline records the supervisor's start
        await engine.start()
        yield
        await engine.shutdown(config.server.shutdown_grace_s)
        await activity.close()
        await lag.close()

    # FastAPI's OpenTelemetry hooks off: unused here (metrics are Prometheus), and checking
    # whether a provider is configured costs on every request
    # openapi_url=None: the document and its pages are served by edge.schemas.serve_document
    app = FastAPI(title="llm-pool", version="0.1.0", lifespan=lifespan, openapi_url=None,
                  telemetry={"tracing": False, "metrics": False, "logs": False, "operation_spans": False})
    app.state.engine = engine
    app.state.activity = activity = Activity(engine)  # the request log and the live samples
    activity.supervisor_log.setFormatter(PrintableFormatter(LOG_FORMAT))  # the page's log lines: one line a record
    metrics = Metrics(engine, on_finished=activity.finished)
    lag = LoopLag(metrics.lag)
    admission = Admission(engine, engine.tenants, lambda: engine.config.server.max_held_request_bytes)
    inference = InferenceSurface(app, engine, admission, metrics, config).endpoints
    app.include_router(admin.router)
    app.include_router(admin_feeds.router)
    app.include_router(ollama.router)
    app.include_router(ui.router)
    edge = HttpEdge(app, server=config.server, admission=admission, admin_key=admin_key,
                    inference=inference,
                    on_key_refused=metrics.key_refused,  # counted; logged at a bounded rate
                    on_failure=lambda path, err, tenant: metrics.request(None, path, err.status, error=err,
                                                                         tenant=tenant))

    _answer_errors(app, metrics)
    _serve_probes(app, engine, admission, metrics)
    serve_document(app)
    return edge


def _answer_errors(app: FastAPI, metrics: Metrics) -> None:
    """Every error of the FastAPI app's routes in the contract's envelope, counted."""
    @app.exception_handler(PoolError)
    async def _pool_error(request: Request, exc: PoolError):
        return error_response(exc, request.url.path)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception):
        # Starlette answers with this, then raises on: the edge logs it and writes its row
        return error_response(internal_error(exc), request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        err = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        if err.get("type") == "json_invalid":  # its loc is ("body", offset): name the body, not the offset
            where = err.get("loc", ())[-1]
            reason = (err.get("ctx") or {}).get("error", "")
            error = PoolError(ErrorCode.INVALID_REQUEST, f"body: not valid JSON at offset {where}: {reason}",
                              param="body")
        else:
            loc = [str(x) for x in err.get("loc", ()) if x != "body"]
            param = clip(".".join(loc)) or None  # a location holds the client's own keys
            error = PoolError(ErrorCode.INVALID_REQUEST, f"{param or 'body'}: {clip(str(err.get('msg')))}",
                              param=param)
        # the request log names the model the body asked for (clipped there), with the code and message
        named = exc.body.get("model") if isinstance(exc.body, dict) else None
        metrics.request(named if isinstance(named, str) else None, request.url.path, 400, error=error,
                        tenant=tenant_name(request.scope))
        return error_response(error)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 400:  # FastAPI could not parse the body (e.g. JSON nested too deep)
            error = PoolError(ErrorCode.INVALID_REQUEST, f"body: {exc.detail}", param="body")
            metrics.request(None, request.url.path, 400, error=error, tenant=tenant_name(request.scope))
            return error_response(error)
        return JSONResponse({"error": {"message": str(exc.detail), "type": ERROR_TYPE.get(exc.status_code,
                                       "invalid_request_error"), "param": None, "code": None}},
                            status_code=exc.status_code, headers=exc.headers)


def _serve_probes(app: FastAPI, engine: ModelRouterEngine, admission: Admission, metrics: Metrics) -> None:
    """/v1/models, and what probes and scrapers ask: /metrics, /health, /ready."""
    @app.get("/v1/models")
    async def list_models(request: Request, limit: int = 20, after_id: str | None = None):
        """OpenAI's list; Anthropic's Models API shape for a client that sends anthropic-version."""
        listed = admission.model_list(request.scope.get(TENANT_KEY, DEFAULT_TENANT))
        if "anthropic-version" in request.headers:
            return anthropic_model_page(listed, limit, after_id)
        return {"object": "list", "data": listed}

    # -- health --------------------------------------------------------------------------------------
    @app.get("/metrics")
    async def prometheus_metrics():
        await engine.sampler.fresh(SAMPLE_EVERY_S)  # process figures at most one period old
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/health")
    async def health():
        """200 while the process serves; the body is the whole picture (model_health.pool_health)."""
        return pool_health(engine)

    @app.get("/ready")
    async def ready():
        """200 once the start-up loads settled and while a model can serve; 503 while starting,
        stopping, or when no model can serve (model_health.readiness)."""
        answer = readiness(engine)
        return JSONResponse(answer, status_code=200 if answer.pop("ready") else 503)
