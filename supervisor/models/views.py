"""Admin views of the models: /v1/models and /admin/models. Read-only."""

from __future__ import annotations

import time

from supervisor.models.capabilities import capabilities
from supervisor.scheduling.deadlines import predict
from supervisor.models.lifecycle import Lifecycle
from supervisor.config.tenants import DEFAULT as DEFAULT_TENANT
from supervisor.models.health import UNHEALTHY, model_health, reason_text, tenth
from supervisor.models.memory import Memory
from supervisor.models.registry import ModelEntry, Registry
from supervisor.models.warm_swaps import SavedKv
from supervisor.states import ModelState, ReplicaState


def model_state(entry: ModelEntry) -> ModelState:
    """The model's state as ops see it: one of the six public names."""
    return entry.state.public


def served_context(entry) -> int | None:
    """The most tokens one request may hold on a model, where its runtime reports it (llama-server's
    context per slot, vLLM's max_model_len: `n_ctx_per_slot` in a replica's Ready info; the smallest
    of its replicas'); None where none does (not loaded, or a runtime that does not say)."""
    smallest = None  # one loop, no list: asked on every request's admission
    for r in entry.executor.replicas if entry.executor is not None else ():
        info = r.info
        n = info.get("n_ctx_per_slot") if type(info) is dict else None
        if type(n) is int and n > 0 and (smallest is None or n < smallest):  # type(): not a bool
            smallest = n
    return smallest


class Views:
    def __init__(self, registry: Registry, memory: Memory, lifecycle: Lifecycle, saved_kv: SavedKv) -> None:
        self.registry = registry
        self.memory = memory
        self.lifecycle = lifecycle
        self.saved_kv = saved_kv

    def model_list(self) -> list[dict]:
        """/v1/models: every configured model and alias, with its state."""
        out = []
        for entry in self.registry.configured():
            name = entry.cfg.name
            state = model_state(entry).value
            context = served_context(entry)
            sizes = {"context_length": context, "max_model_len": context} if context else {}
            serves = capabilities(entry.cfg)
            for id_ in (name, *entry.cfg.aliases):
                out.append({"id": id_, "object": "model", "created": 0, "owned_by": "llm-pool", "state": state,
                            **({"alias_of": name} if id_ != name else {}), **sizes, "capabilities": serves})
        return out

    def model_view(self, entry: ModelEntry) -> dict:
        ex = entry.executor
        memory, source = self.memory.footprint(entry)
        return {
            "name": entry.cfg.name,
            "backend": entry.cfg.backend,
            "context_length": served_context(entry),
            **(health := model_health(entry)),  # state, ready/configured, replica_errors (model_health.py)
            "replicas": entry.cfg.replicas,
            "replicas_ready": sum(r.state is ReplicaState.READY for r in ex.replicas) if ex else 0,
            "queue_depth": (ex.queue_depth if ex else 0) + len(entry.waiting),
            "runtime_inflight": ex.runtime_inflight if ex else 0,
            "configured_target_inflight": entry.cfg.target_inflight * entry.cfg.replicas,
            "effective_target_inflight": ex.effective_target_inflight if ex else 0,
            "accepting_new_requests": bool(ex and ex.accepting_new_requests),
            "max_queue": entry.cfg.max_queue,
            "load_seconds": entry.load_seconds,
            "error": entry.error or self._why(entry, health),
            "load_on_demand": entry.cfg.load_on_demand,
            # an operator's `unload --hold`: no load on demand until an operator's load or a reload
            "held": entry.held_by is not None, "held_by": entry.held_by,
            "pinned": entry.cfg.pinned,
            "aliases": list(entry.cfg.aliases),
            "last_used_at": entry.last_used_at,
            "idle_unload_in_s": tenth(self.lifecycle.idle_unload_in(entry, time.monotonic())),
            "memory_mb": tenth(memory),
            "memory_source": source,
            "gpu_memory_mb": {d: tenth(mb) for d, mb in self.memory.gpu_footprint(entry).items()} or None,
            "prediction": prediction_view(entry),
            "warm_swap": self.saved_kv.view(entry),
        }

    @staticmethod
    def _why(entry: ModelEntry, health: dict) -> str | None:
        """A degraded or down model's reason: each replica that is not ready, and why."""
        if health["state"] not in UNHEALTHY:
            return None
        why = reason_text(health) or "no error recorded"
        return f"no replica is running: {why}" if entry.state is ModelState.DOWN else why


def prediction_view(entry: ModelEntry) -> dict:
    """The model's latency predictor (latency_predictor.py): what it learned, its error, and
    what it predicts now for a new request of the default tenant with a 1 KiB body."""
    now = predict(entry, DEFAULT_TENANT, 1024)
    return {**entry.predictor.view(), "slo_ttft_ms": entry.cfg.slo_ttft_ms, "slo_tpot_ms": entry.cfg.slo_tpot_ms,
            "fallbacks": list(entry.cfg.fallbacks), "context_fallback": entry.cfg.context_fallback,
            "now": {"queue_position": now.position, "queue_wait_ms": round(now.wait_s * 1000),
                    "ttft_ms": round(now.ttft_s * 1000),
                    "tpot_ms": None if now.tpot_s is None else round(now.tpot_s * 1000, 2)}}
