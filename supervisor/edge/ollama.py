"""Ollama's model listings (/api/version, /api/tags, /api/ps, /api/show), from the pool's own
views. Under /api/, so the guard asks for an inference key where keys are set, as on /v1/.
/api/chat and /api/generate are inference endpoints (edge/inference.py); shapes/ollama.py
has the shapes."""

from __future__ import annotations

import asyncio
import hashlib
import time
from datetime import datetime, timezone
from pathlib import Path

from fastapi import APIRouter, Request

from protocol.errors import ErrorCode, PoolError
from supervisor.edge.schemas import request_body
from supervisor.models.capabilities import capabilities
from supervisor.models.views import served_context
from supervisor.shapes.ollama import API_VERSION, ShowBody, model_name, tagged

router = APIRouter()

# Ollama's capability names, from the pool's (models/capabilities.py)
CAPABILITY_NAMES = {"chat": "completion", "tools": "tools", "embeddings": "embedding", "vision": "vision"}


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, timezone.utc).isoformat().replace("+00:00", "Z")


def _file_facts(path: str | None) -> tuple[int, float]:
    """(size, modification time) of a model's file; (0, 0) when it has none here. Blocking: a thread."""
    if not path:
        return 0, 0.0
    try:
        info = Path(path).expanduser().stat()
    except OSError:
        return 0, 0.0
    return info.st_size, info.st_mtime


async def _entry_fields(entry) -> dict:
    cfg = entry.cfg
    size, mtime = await asyncio.to_thread(_file_facts, cfg.options.get("model") if cfg.backend == "llama_server"
                                          else None)
    name = tagged(cfg.name)
    return {"name": name, "model": name, "modified_at": _iso(mtime), "size": size,
            "digest": hashlib.sha256(f"{cfg.name}:{size}:{mtime}".encode()).hexdigest(),
            "details": {"parent_model": "", "format": "gguf" if cfg.backend == "llama_server" else cfg.backend,
                        "family": "", "families": None, "parameter_size": "", "quantization_level": ""}}


@router.get("/api/version")
async def ollama_version():
    return {"version": API_VERSION}


@router.get("/api/tags")
async def ollama_tags(request: Request):
    """Every configured model (an alias is another name for one: listed as its model)."""
    engine = request.app.state.engine
    return {"models": [await _entry_fields(entry) for entry in engine.registry.configured()]}


@router.get("/api/ps")
async def ollama_ps(request: Request):
    """The loaded models: their memory as the pool measured it, and when an idle unload is due."""
    engine = request.app.state.engine
    out = []
    for entry in engine.registry.configured():
        view = engine.model_view(entry)
        if view["state"] not in ("loaded", "degraded"):
            continue
        memory = int((view["memory_mb"] or 0) * 2**20)
        gpu = int(sum((view["gpu_memory_mb"] or {}).values()) * 2**20)  # MB per GPU device
        unload_in = view["idle_unload_in_s"]
        expires = _iso(time.time() + unload_in) if unload_in is not None else _iso(0)
        out.append({**await _entry_fields(entry), "size": memory, "size_vram": gpu, "expires_at": expires,
                    "context_length": view["context_length"] or 0})
    return {"models": out}


@router.post("/api/show")
async def ollama_show(request: Request):
    engine = request.app.state.engine
    body, _ = request_body(await request.body(), request.headers.get("content-type"), ShowBody)
    asked = body.model or body.name
    if not asked:
        raise PoolError(ErrorCode.INVALID_REQUEST, "model: Field required", param="model")
    entry = engine.entry(model_name(asked, lambda n: _known(engine, n)))
    fields = await _entry_fields(entry)
    context = served_context(entry)
    serves = capabilities(entry.cfg)
    return {"modelfile": "", "parameters": "", "template": "", "details": fields["details"],
            "model_info": {"general.architecture": "", **({"llm_pool.context_length": context} if context else {})},
            "capabilities": sorted({CAPABILITY_NAMES[c] for c in serves if c in CAPABILITY_NAMES}),
            "modified_at": fields["modified_at"]}


def _known(engine, name: str) -> bool:
    try:
        engine.entry(name)
    except PoolError:
        return False
    return True
