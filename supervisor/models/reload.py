"""Config reload: the difference between the running config and the file, and
how it is applied. Unchanged models keep their workers, queues and running
jobs; lifecycle keys change in place; other changes reload the model with a
drain; a removed model is 404 at once, then drained, unloaded and forgotten."""

from __future__ import annotations

import logging
from collections.abc import Callable, Coroutine
from dataclasses import dataclass

from protocol.errors import ErrorCode, PoolError
from supervisor.config import ModelConfig, PoolConfig
from supervisor.events import EventKind, emit
from supervisor.models.lifecycle import Lifecycle
from supervisor.models.registry import ModelEntry, Registry
from supervisor.states import RUNNING, ModelState

log = logging.getLogger("llm_pool.engine")

# [server] keys a reload applies; the others are bound when the pool starts
SERVER_KEYS_APPLIED_ON_RELOAD = frozenset({"memory_budget_mb", "gpu_memory_budget_mb", "idle_unload_s", "max_held_request_bytes",
                                           "max_swap_wait_s"})
# Keys a reload applies in place: they change when the model comes and goes, or which requests
# reach it (deadlines and fallbacks, read per request), not how it runs.
IN_PLACE_KEYS = frozenset({"aliases", "pinned", "idle_unload_s", "load_on_demand", "load_on_start", "memory_mb",
                           "slo_ttft_ms", "slo_tpot_ms", "fallbacks", "context_fallback"})


@dataclass
class ConfigDiff:
    added: list[str]
    removed: list[str]
    changed: list[str]
    kept: list[str]

    def summary(self) -> dict:
        return {"added": sorted(self.added), "removed": sorted(self.removed), "reloaded": sorted(self.changed),
                "kept": sorted(self.kept)}


def diff(old: PoolConfig, new: PoolConfig) -> ConfigDiff:
    """What a reload from `old` to `new` does; refused (400) when it changes a [server]
    key bound at start: refusing beats reporting a change that did not happen."""
    bound = {k for k, v in new.server.model_dump().items()
             if k not in SERVER_KEYS_APPLIED_ON_RELOAD and v != getattr(old.server, k)}
    if bound:
        raise PoolError(ErrorCode.INVALID_REQUEST, f"[server] {', '.join(sorted(bound))} take effect only "
                        f"when the pool restarts; reload refused, nothing changed")
    old_models = {m.name: m for m in old.models}
    new_models = {m.name: m for m in new.models}
    changed, kept = [], []
    for name in new_models.keys() & old_models.keys():
        same = new_models[name].model_dump(exclude=IN_PLACE_KEYS) == old_models[name].model_dump(
            exclude=IN_PLACE_KEYS)
        (kept if same else changed).append(name)
    return ConfigDiff(added=[n for n in new_models if n not in old_models],
                      removed=[n for n in old_models if n not in new_models], changed=changed, kept=kept)


class Reloader:
    def __init__(self, registry: Registry, lifecycle: Lifecycle, spawn: Callable[[Coroutine], None]) -> None:
        self.registry = registry
        self.lifecycle = lifecycle
        self._spawn = spawn

    def apply(self, change: ConfigDiff, new: PoolConfig) -> None:
        new_models = {m.name: m for m in new.models}
        for name in change.kept:
            self.registry.models[name].take_config(new_models[name])  # in place: nothing it runs differs
        removed = [self.registry.models[name] for name in change.removed]
        self.registry.configure(new.models)  # removed names are 404 from now on; a request cannot load them
        for name in change.added:
            self.registry.add(new_models[name])
        emit(EventKind.RELOADED, f"config reloaded: added {change.added}, removed {change.removed}, "
             f"reloaded {change.changed}, kept {change.kept}")
        for entry in removed:
            self.lifecycle.stop_intake(entry, "removed from the config")  # 503 from this loop turn on
            self._spawn(self._retire(entry))
        for name in change.changed:
            entry = self.registry.models[name]
            was_loaded = entry.state in RUNNING or entry.state is ModelState.LOADING
            entry.take_config(new_models[name], in_place=False)  # in the same loop turn as its intake stops
            self.lifecycle.stop_intake(entry, "its config changed")
            self._spawn(self._reload_model(entry, new_models[name], was_loaded))
        for name in change.added:
            if new_models[name].load_on_start:
                self._spawn(self.lifecycle.load_quietly(name, "reload"))

    async def _retire(self, entry: ModelEntry) -> None:
        """A model gone from the config: drain, unload, forget."""
        log.info("model %s: unloading (removed from the config)", entry.cfg.name)
        await self.lifecycle.unload_entry(entry, why="removed from the config")
        self.registry.forget(entry)

    async def _reload_model(self, entry: ModelEntry, cfg: ModelConfig, was_loaded: bool) -> None:
        """A changed model: drain and unload it with its old config (the new one takes effect as
        its executor goes), then load the new one if it was loaded (or loads on start)."""
        log.info("model %s: reloading (its config changed)", entry.cfg.name)
        await self.lifecycle.unload_entry(entry, why="its config changed")
        if was_loaded or cfg.load_on_start:
            await self.lifecycle.load_quietly(cfg.name, "reload")
