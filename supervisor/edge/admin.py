"""The admin actions and views: models, tenants, workers, load, unload, restart, reload,
a replica's log. Under /admin/, so the guard's admin key and browser rules apply. The
engine comes from app.state (set by api.create_app)."""

from __future__ import annotations

import asyncio
import os

from fastapi import APIRouter, Request

from protocol.errors import ErrorCode, PoolError
from supervisor.edge import admin_feeds
from supervisor.models.health import shown_replicas
from supervisor.replicas.observe import worker_views

router = APIRouter()


@router.get("/admin/models")
async def admin_models(request: Request):
    engine = request.app.state.engine
    return {"models": [engine.model_view(e) for e in engine.models.values()]}


@router.get("/admin/tenants")
async def admin_tenants(request: Request):
    """The configured tenants (never their keys): the page's tenant filter, and their limits."""
    engine = request.app.state.engine
    return {"tenants": [{"name": t.name, "weight": t.spec.weight, "priority": t.spec.priority,
                         "models": list(t.spec.models), "rpm": t.spec.rpm, "tpm": t.spec.tpm,
                         "max_inflight": t.spec.max_inflight, "inflight": t.inflight}
                        for t in engine.tenants.by_name.values()]}


@router.post("/admin/models/{name}/load")
async def admin_load(request: Request, name: str):
    engine = request.app.state.engine
    return engine.model_view(await engine.load(name, by=admin_feeds.asked_by(request)))


@router.post("/admin/models/{name}/unload")
async def admin_unload(request: Request, name: str, hold: bool = False):
    """Drain and stop it; `hold=true`: no load on demand until an operator's load or a reload."""
    engine = request.app.state.engine
    return engine.model_view(await engine.unload(name, by=admin_feeds.asked_by(request), hold=hold))


@router.post("/admin/models/{name}/restart")
async def admin_restart(request: Request, name: str, replica: int | None = None, now: bool = False):
    """Drain (up to the model's drain_timeout_s), then restart; `now=true` cuts running jobs."""
    engine = request.app.state.engine
    if replica is not None:
        check_replica(engine, name, replica)
    return engine.model_view(await engine.restart(name, replica, now=now, by=admin_feeds.asked_by(request)))


@router.post("/admin/reload")
async def admin_reload(request: Request):
    """Re-read the config file and apply the difference (400 and no change for a bad one)."""
    engine = request.app.state.engine
    return await engine.reload()


@router.get("/admin/workers")
async def admin_workers(request: Request):
    engine = request.app.state.engine
    replicas = [r for e in engine.models.values() for r in shown_replicas(e)]  # a failed load's too
    views = await worker_views(replicas, engine.sampler)
    for view, r in zip(views, replicas):  # what the model's latency predictor learned of this replica
        entry = engine.models.get(r.cfg.name)
        view["prediction"] = entry.predictor.replica_view(r.name) if entry is not None else None
    return {"workers": views}


@router.get("/admin/models/{name}/logs")
async def admin_logs(request: Request, name: str, replica: int = 0, lines: int = 200):
    """The tail of one replica's log (the worker's and its backend's output)."""
    engine = request.app.state.engine
    check_replica(engine, name, replica)
    name = engine.entry(name).cfg.name  # an alias names the model's log too
    path = engine.log_dir / f"{name}-{replica}.log"
    # up to 2.5 MB read and split: in a thread, not on the event loop
    tail = await asyncio.to_thread(tail_lines, path, max(1, min(lines, 10000)))
    if tail is None:
        raise PoolError(ErrorCode.INVALID_REQUEST, f"no log for {name}/{replica} yet", param="replica")
    return {"model": name, "replica": replica, "path": str(path), "lines": tail}


def check_replica(engine, name: str, replica: int) -> None:
    count = engine.entry(name).cfg.replicas
    if not 0 <= replica < count:
        shown = str(replica) if abs(replica) < 10**12 else "that big"
        raise PoolError(ErrorCode.INVALID_REQUEST, f"model {name!r} has no replica {shown} "
                        f"(it has 0 to {count - 1})", param="replica")


def tail_lines(path, count: int) -> list[str] | None:
    """The last `count` lines of a file, reading only its end; None for no such file."""
    if not path.is_file():
        return None
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        block = min(size, 256 * count)
        f.seek(size - block)
        return f.read().decode(errors="replace").splitlines()[-count:]
