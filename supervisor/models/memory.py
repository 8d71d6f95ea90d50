"""Memory: each model's footprint (declared, measured, estimated), the budgets
(host RAM, GPU memory per device), the ledger of models that passed the budget's
gate, the choice of what to evict, and the swap-aware wait for room.

The ledger is this module's: a model enters it when its load passes the gate
and leaves it when its replicas are stopped (unload, failed load)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from protocol.errors import ErrorCode, PoolError
from supervisor.config import ModelConfig, ServerConfig
from supervisor.config.models import llama_cache_ram_mb, vllm_kv_offload_mb
from supervisor.models.registry import ModelEntry, Registry
from supervisor.replicas.observe import ProcessSampler, replica_view
from supervisor.states import RUNNING, ModelState

MEASURE_EVERY_S = 5.0  # a footprint walks the process tree (and asks NVML): not on every heartbeat
KV_MB_PER_TOKEN = 0.125  # rough context cost for an estimate before the first load (a 7B f16 KV is ~0.5)

# Evicts one model to make room: True once it is unloaded, False if it could not be taken now.
Evict = Callable[[ModelEntry, str], Awaitable[bool]]


def estimate_mb(cfg: ModelConfig) -> float | None:
    """Before the first load: the model file, its context and its host prompt cache (llama_server);
    the host buffer of its KV offloading (vllm_serve: the rest of it is unknown until measured);
    else unknown."""
    if cfg.backend == "vllm_serve":
        return kv_offload_floor_mb(cfg) or None
    if cfg.backend != "llama_server":
        return None
    try:
        size = Path(cfg.options["model"]).expanduser().stat().st_size
    except (KeyError, OSError):
        return None
    ctx = cfg.options.get("ctx_size") or 2048 * (cfg.target_inflight + cfg.newcomer_slots)  # llama-server's default
    return cfg.replicas * (size / 2**20 + ctx * KV_MB_PER_TOKEN + llama_cache_ram_mb(cfg.options))


def kv_offload_floor_mb(cfg: ModelConfig) -> float:
    """The host buffer a vllm_serve model's KV offloading allocates at its start, all replicas: its
    footprint is never counted below it (a process's RSS need not show pinned memory)."""
    return cfg.replicas * vllm_kv_offload_mb(cfg.options) if cfg.backend == "vllm_serve" else 0.0


class Memory:
    def __init__(self, registry: Registry, server: Callable[[], ServerConfig], sampler: ProcessSampler) -> None:
        self.registry = registry
        self.sampler = sampler  # process trees sampled off the loop: a footprint reads its last sample
        self._server = server  # the current [server] (a reload may change its budgets)
        self._held: set[ModelEntry] = set()  # the ledger: models counted against the budgets
        self.evictions = 0
        self.swaps = 0  # loads that had to evict another model first

    # -- the ledger ---------------------------------------------------------------------------
    def holds(self, entry: ModelEntry) -> bool:
        return entry in self._held

    def release(self, entry: ModelEntry) -> None:
        self._held.discard(entry)

    # -- footprints ---------------------------------------------------------------------------
    def footprint(self, entry: ModelEntry) -> tuple[float | None, str | None]:
        """The model's memory in MB and where the figure comes from."""
        if entry.cfg.memory_mb is not None:
            return entry.cfg.memory_mb, "declared"
        if entry.measured_mb is not None:
            return max(entry.measured_mb, kv_offload_floor_mb(entry.cfg)), "measured"
        estimate = estimate_mb(entry.cfg)
        return (estimate, "estimated") if estimate is not None else (None, None)

    def measure_due(self, entry: ModelEntry, now: float) -> None:
        if entry.state in RUNNING and now - entry.measured_at >= MEASURE_EVERY_S:
            entry.measured_at = now
            self.measure(entry)

    def measure(self, entry: ModelEntry) -> None:
        """Process-tree RSS of every replica (the worker and its runtime), and its GPU
        memory per device, from the last process sample (local) or actor view (Ray)."""
        views = [(r, replica_view(self.sampler, r)) for r in (entry.executor.replicas if entry.executor else [])]
        seen = [v for _, v in views if v and v.get("rss_bytes") is not None]
        if seen:
            entry.measured_mb = sum(v["rss_bytes"] + sum(c["rss_bytes"] for c in v["children"]) for v in seen) / 2**20
        if (self._server().gpu_memory_budget_mb is not None and entry.cfg.replica_devices and entry.executor
                and self.sampler.sample.gpu_known):
            per_device: dict[str, float] = {}
            for r, v in views:
                used = ((v or {}).get("gpu_memory_bytes") or 0) / 2**20
                devices = entry.cfg.replica_devices[r.index].split(",")
                for d in devices:
                    per_device[d] = per_device.get(d, 0) + used / len(devices)
            entry.measured_gpu_mb = per_device

    def measure_soon(self, entry: ModelEntry) -> None:
        """Measure once the next process sample (which starts now) has been taken."""
        self.sampler.request().add_done_callback(lambda _: self.measure(entry))

    def gpu_footprint(self, entry: ModelEntry) -> dict[str, float]:
        """GPU MB per device: declared per replica (split over its devices), else measured."""
        devices = entry.cfg.replica_devices
        if entry.cfg.gpu_memory_mb is not None and devices:
            out: dict[str, float] = {}
            for entry_devices in devices:
                split = entry_devices.split(",")
                for d in split:
                    out[d] = out.get(d, 0) + entry.cfg.gpu_memory_mb / len(split)
            return out
        return dict(entry.measured_gpu_mb or {})

    def _usage(self, entry: ModelEntry) -> dict[str, float]:
        """What the model takes from each budget: "host", and "GPU <device>" per device."""
        if entry.cfg.remote:  # on Ray nodes, which Ray fills by their resources
            return {}
        usage = {"host": self.footprint(entry)[0] or 0}
        if self._server().gpu_memory_budget_mb is not None:
            usage.update({f"GPU {d}": mb for d, mb in self.gpu_footprint(entry).items()})
        return usage

    def in_use(self, but: ModelEntry | None = None, budget: str = "host") -> float:
        return sum(self._usage(e).get(budget, 0) for e in self._held if e is not but)

    def short(self, entry: ModelEntry) -> list[str]:
        """The budgets this model does not fit in now."""
        server = self._server()
        limits = {"host": server.memory_budget_mb}
        short = []
        for key, need in self._usage(entry).items():
            limit = limits.get(key, server.gpu_memory_budget_mb if key != "host" else None)
            if limit is not None and need > 0 and self.in_use(entry, key) + need > limit:
                short.append(key)
        return short

    # -- what may go ----------------------------------------------------------------------------
    def evictable(self, entry: ModelEntry, short: list[str]) -> list[ModelEntry]:
        """Idle loaded models that may go, least recently used first: never one with
        queued or running work, a pinned one, or one loading or being acted on; only
        ones that free some of a budget this model is short of."""
        return sorted((e for e in self._candidates(entry, short) if e.idle), key=lambda e: e.last_used)

    def yieldable(self, entry: ModelEntry, short: list[str]) -> list[ModelEntry]:
        """Busy loaded models that may make way for a load that waited max_swap_wait_s,
        least work first: never a pinned one, or one loading or being acted on. Their
        running jobs finish (never cut); their queued ones wait for their next load."""
        return sorted(self._candidates(entry, short),
                      key=lambda e: (e.executor.queue_depth + e.executor.runtime_inflight, e.last_used))

    def _candidates(self, entry: ModelEntry, short: list[str]) -> list[ModelEntry]:
        # a model whose action lock is held is skipped here, and the evictor takes the lock
        # only with take_now as well: see the lock order in lifecycle.py
        return [e for e in self._held
                if e is not entry and e.state in RUNNING and not e.cfg.pinned and not e.action.locked()
                and any(self._usage(e).get(key, 0) > 0 for key in short)]

    def fit_text(self, entry: ModelEntry, short: list[str]) -> str:
        """For each budget it is short of: what it needs, the budget, and what holds it."""
        server = self._server()
        usage = self._usage(entry)
        parts = []
        for key in short:
            limit = server.memory_budget_mb if key == "host" else server.gpu_memory_budget_mb
            name = "memory_budget_mb" if key == "host" else f"gpu_memory_budget_mb ({key})"
            held = ", ".join(f"{e.cfg.name} ({self._usage(e).get(key, 0):g} MB)" for e in self._ordered_held()
                             if e is not entry and self._usage(e).get(key, 0) > 0) or "nothing"
            parts.append(f"it needs {usage[key]:g} MB of {name} {limit:g}, in use by {held}")
        return "; ".join(parts)

    def _ordered_held(self) -> list[ModelEntry]:
        return [e for e in self.registry.models.values() if e in self._held] + [
            e for e in self._held if self.registry.models.get(e.cfg.name) is not e]

    # -- the gate --------------------------------------------------------------------------------
    async def make_room(self, entry: ModelEntry, waiters_only: bool, evict: Evict,
                        stopping: Callable[[], bool]) -> None:
        """Pass the memory gate (the caller holds `entry`'s action lock, state LOADING):
        evict idle models (LRU) until this one fits, or wait (up to the queue timeout)
        for one to become evictable. A load on demand gives up as soon as no request
        waits for it any more; any load gives up once an unload took it over."""
        wait_s = entry.cfg.queue_timeout_s or entry.cfg.request_timeout_s
        started = time.monotonic()
        deadline = started + wait_s
        max_swap_wait_s = self._server().max_swap_wait_s
        evicted = False
        while short := self.short(entry):
            if entry.state is not ModelState.LOADING:
                raise PoolError(ErrorCode.MODEL_UNLOADING, f"model {entry.cfg.name!r} is unloading")
            victims = self.evictable(entry, short)
            if not victims and max_swap_wait_s is not None and time.monotonic() - started >= max_swap_wait_s:
                victims = self.yieldable(entry, short)  # waited long enough: a busy model makes way
            gone = False
            for victim in victims:
                if await evict(victim, f"evicted to make room for {entry.cfg.name} in "
                                       f"{self.fit_text(entry, short)}"):
                    self.evictions += 1
                    evicted = gone = True
                    break
            if gone:
                continue
            error = PoolError(ErrorCode.INSUFFICIENT_MEMORY, f"model {entry.cfg.name!r} does not fit: "
                              f"{self.fit_text(entry, short)}; nothing loaded there can be unloaded now",
                              retry_after_s=1)
            executor = entry.executor
            executor.mark_queued(error)  # a waiter that times out says why it waited
            if time.monotonic() >= deadline or stopping() or (waiters_only and not executor.queue):
                raise error
            await asyncio.sleep(min(self._server().heartbeat_s, 0.25))
        if entry.state is not ModelState.LOADING:
            raise PoolError(ErrorCode.MODEL_UNLOADING, f"model {entry.cfg.name!r} is unloading")
        entry.executor.mark_queued(None)
        if evicted:
            self.swaps += 1
        self._held.add(entry)
