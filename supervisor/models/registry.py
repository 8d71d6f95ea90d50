"""Names and aliases, and each model's record: its state (changed only by
`ModelEntry.set_state`, through the one table), its executor, its action lock.

A model removed from the config by a reload is no longer a public name here
(404 at once) but keeps its record in `models` until its unload ends: being
removed is the registry's fact, not a flag on the model."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from protocol.errors import ErrorCode, PoolError
from supervisor.config import ModelConfig
from supervisor.scheduling.jobs import Job
from supervisor.scheduling.latency_predictor import ModelPredictor
from supervisor.request_bounds import echo
from supervisor.scheduling.executor import Executor
from supervisor.states import (HAS_EXECUTOR, INTAKE_OPEN, MODEL_TRANSITIONS, RUNNING, IllegalTransition, ModelState,
                               ReplicaState, transition)

log = logging.getLogger("llm_pool.engine")


class ActionLock:
    """One lifecycle action (load, unload, restart) on a model at a time, first
    come first served. `take_now` takes it only when that needs no wait: the
    lock order rule (lifecycle.py) is built on it."""

    def __init__(self) -> None:
        self._held = False
        self._waiters: deque[asyncio.Future] = deque()

    def locked(self) -> bool:
        return self._held

    def take_now(self) -> bool:
        if self._held or self._waiters:
            return False
        self._held = True
        return True

    async def acquire(self) -> None:
        if self.take_now():
            return
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.release()  # it was handed to us as we were cancelled: pass it on
            elif waiter in self._waiters:  # a release may have dropped it already
                self._waiters.remove(waiter)
            raise

    def release(self) -> None:
        while self._waiters:  # hand it to the next waiter: it stays held, nobody slips in between
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self._held = False

    async def __aenter__(self) -> None:
        await self.acquire()

    async def __aexit__(self, *exc) -> None:
        self.release()


@dataclass(eq=False)
class ModelEntry:
    cfg: ModelConfig
    state: ModelState = ModelState.UNLOADED
    executor: Executor | None = None  # exactly in the states of HAS_EXECUTOR
    error: str | None = None
    load_started: float | None = None
    load_seconds: float | None = None
    action: ActionLock = field(default_factory=ActionLock)  # one load/unload/restart at a time
    last_used: float = field(default_factory=time.monotonic)  # a job queued or running
    last_used_at: float | None = None  # wall clock, for views
    measured_mb: float | None = None  # process-tree RSS of its replicas, once loaded
    measured_gpu_mb: dict[str, float] | None = None  # GPU memory (NVML) per device, once loaded
    measured_at: float = 0.0  # monotonic: the footprint's last measurement
    waiting: list[Job] = field(default_factory=list)  # AUTO_UNLOADING only: requests for the next load
    failed_replicas: list = field(default_factory=list)  # of the last load that failed: still shown (ops)
    # a reload's changed config while the old one still runs: it becomes `cfg` when the executor goes
    # (Lifecycle._detach), so `cfg` is always the config its workers run
    next_cfg: ModelConfig | None = None
    unload_why: str | None = None  # the unload under way: why (planned work, shown apart from faults)
    # an operator's `unload --hold`: no load on demand until an operator's load or a reload; who held it
    held_by: str | None = None
    operator_unload_at: float | None = None  # monotonic: an operator's last unload (a load on demand soon after warns)
    predictor: ModelPredictor = field(default_factory=ModelPredictor)  # learned speeds, kept across loads
    # told (entry, old, new) after every change of state: the registry's watchers (events, metrics)
    observer: Callable[[ModelEntry, ModelState, ModelState], None] | None = field(default=None, repr=False)

    def used(self, now: float | None = None) -> None:
        self.last_used = now if now is not None else time.monotonic()
        self.last_used_at = time.time()

    @property
    def idle(self) -> bool:
        ex = self.executor
        return ex is None or (not ex.queue and ex.runtime_inflight == 0)

    def set_state(self, new: ModelState) -> None:
        """The one way a model's state changes: the table decides, and the executor's
        intake follows the state (never set beside it)."""
        state = transition(MODEL_TRANSITIONS, self.state, new)
        if (self.executor is not None) != (state in HAS_EXECUTOR):
            raise IllegalTransition(f"{self.state} -> {state} with{'out' if self.executor is None else ''} "
                                    f"an executor")
        if self.waiting and state is not ModelState.AUTO_UNLOADING:
            raise IllegalTransition(f"{self.state} -> {state} with {len(self.waiting)} requests still waiting")
        old, self.state = self.state, state
        if self.executor is not None:
            self.executor.accepting_new_requests = state in INTAKE_OPEN
            self.executor.loading = state is ModelState.LOADING
        if self.observer is not None and state is not old:
            self.observer(self, old, state)

    def take_config(self, cfg: ModelConfig, in_place: bool = True) -> None:
        """A reload's config for this model. `in_place`: only keys read per request or per
        lifecycle action changed (reload.IN_PLACE_KEYS), so it applies now. Otherwise it waits
        in `next_cfg` while an executor runs the old one, and applies at once when none does."""
        if in_place and self.next_cfg is not None:  # an earlier reload's change still waits: this joins it
            self.next_cfg = cfg
        elif in_place or self.executor is None:
            self.cfg, self.next_cfg = cfg, None
            if not in_place:
                self.measured_mb = None
        else:
            self.next_cfg = cfg

    def replicas_changed(self) -> None:
        """A loaded model follows its replicas: LOADED with all ready (or in an operator's
        restart of a serving replica), DEGRADED with fewer, DOWN with none running or about
        to restart."""
        if self.state not in RUNNING:
            return
        replicas = self.executor.replicas
        ready = sum(r.state is ReplicaState.READY for r in replicas)
        # a replica in an operator's restart (it served when asked) is planned work, not a fault
        planned = sum(r.state is not ReplicaState.READY and r.in_operator_restart for r in replicas)
        if ready + planned >= self.cfg.replicas and self.state is not ModelState.DOWN:
            new = ModelState.LOADED
        elif any(r.live for r in replicas):
            new = ModelState.DEGRADED
        else:
            new = ModelState.DOWN
        if new is not self.state:
            self.set_state(new)


class Registry:
    def __init__(self, models: list[ModelConfig]) -> None:
        self._watchers: list[Callable[[ModelEntry, ModelState, ModelState], None]] = []
        self.models: dict[str, ModelEntry] = {}
        for m in models:
            self.add(m)
        self.aliases: dict[str, str] = {}
        self._configured: set[str] = set()
        self.configure(models)

    def watch(self, watcher: Callable[[ModelEntry, ModelState, ModelState], None]) -> None:
        """Call `watcher(entry, old, new)` after every model's change of state (an events
        timeline, a metric). A watcher that raises is logged; the change stands."""
        self._watchers.append(watcher)

    def _changed(self, entry: ModelEntry, old: ModelState, new: ModelState) -> None:
        for watcher in self._watchers:
            try:
                watcher(entry, old, new)
            except Exception:
                log.exception("a watcher of model %s (%s -> %s) failed", entry.cfg.name, old, new)

    def configure(self, models: list[ModelConfig]) -> None:
        """The configured names and aliases from now on (start, reload)."""
        self._configured = {m.name for m in models}
        self.aliases = {a: m.name for m in models for a in m.aliases}

    def is_configured(self, entry: ModelEntry) -> bool:
        """False once a reload removed it (or a new model of its name replaced it)."""
        return entry.cfg.name in self._configured and self.models.get(entry.cfg.name) is entry

    def lookup(self, name: str, removed_too: bool = False) -> ModelEntry:
        """A configured model by name, else by alias; a removed one still draining only
        with `removed_too` (its name never shadows an alias that took it over)."""
        entry = self.models.get(name)
        if entry is None or not self.is_configured(entry):
            entry = self.models.get(self.aliases.get(name, "")) or (entry if removed_too else None)
        if entry is None or not (removed_too or self.is_configured(entry)):
            raise PoolError(ErrorCode.MODEL_NOT_FOUND, f"model {echo(name)} does not exist", param="model")
        return entry

    def add(self, cfg: ModelConfig) -> ModelEntry:
        entry = self.models[cfg.name] = ModelEntry(cfg, observer=self._changed)
        return entry

    def forget(self, entry: ModelEntry) -> None:
        """A removed model's unload ended: its record goes (unless a new one took its name)."""
        if self.models.get(entry.cfg.name) is entry and not self.is_configured(entry):
            del self.models[entry.cfg.name]

    def configured(self) -> list[ModelEntry]:
        return [e for e in self.models.values() if self.is_configured(e)]
