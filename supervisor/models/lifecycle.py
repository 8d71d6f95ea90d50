"""Lifecycle: load, load on demand, unload (drain, then stop), automatic unload
(idle, evicted), operator restart, and the requests a model takes in each state.
Every state change goes through `ModelEntry.set_state` (the one table).

Lock order (deadlock-free by construction). Each model has one action lock
(registry.ActionLock) held by whoever loads, unloads or restarts it. The rule:
a task that waits for an action lock holds none. The only time a task holds two
is an eviction: the loader, holding its own model's lock, takes the victim's with
`take_now`, which never waits (it fails when the lock is held or wanted), and
runs the victim's unload itself. An unload waits only for jobs to end and
processes to stop, never for another model. So no task ever waits for a lock
while holding one, and no cycle of waits can form.

The same `take_now` opens every automatic action that changes state at once
(idle unload, eviction): the state changes and the lock is held in the same
loop turn, so no other action can slip in between."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from pathlib import Path

from protocol.errors import ErrorCode, PoolError
from supervisor.config import ServerConfig
from supervisor.events import EventKind, emit, tenant_actor
from supervisor.scheduling.jobs import Job
from supervisor.models.memory import Memory
from supervisor.models.registry import ModelEntry, Registry
from supervisor.replicas import exits
from supervisor.replicas.process import Launcher, spawn_worker
from supervisor.replicas.ray_placement import RayCluster
from supervisor.replicas.replica import Replica
from supervisor.scheduling.executor import Executor
from supervisor.states import (MODEL_AUTO_UNLOADING, MODEL_FAILED, MODEL_UNLOADED, MODEL_UNLOADING, RUNNING, JobState,
                               ModelState)
from supervisor.replicas.transport import Transport

log = logging.getLogger("llm_pool.engine")

LOAD_REASONS = ("start", "on_demand", "operator", "reload")
LOAD_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
UNLOADS = (ModelState.UNLOADING, ModelState.AUTO_UNLOADING)


class LoadDurations:
    """Load times as cumulative bucket counts, so /metrics costs the same after
    the thousandth load as after the first (no list of every load kept)."""

    def __init__(self) -> None:
        self.bucket_counts = [0] * len(LOAD_BUCKETS)  # loads <= each bound
        self.count = 0
        self.total_s = 0.0

    def observe(self, seconds: float) -> None:
        self.count += 1
        self.total_s += seconds
        for i, bound in enumerate(LOAD_BUCKETS):
            if seconds <= bound:
                self.bucket_counts[i] += 1


UNDONE_WINDOW_S = 10.0  # a load on demand this soon after an operator's unload is warned of


def unload_stop(why: str | None) -> tuple[str, str]:
    """How an unload's stop of a replica is told with its exit (replicas/exits.py): an
    operator's (engine.unload's "asked by ...") or one the pool planned (idle, evicted, shutdown)."""
    why = why or "unloaded"
    return f"unload: {why}", exits.BY_OPERATOR if why.startswith("asked by") else exits.BY_PLANNED


class Lifecycle:
    def __init__(self, registry: Registry, memory: Memory, server: Callable[[], ServerConfig], log_dir: Path,
                 spawn: Callable[[Coroutine], None], launcher: Launcher = spawn_worker,
                 transport: Transport | None = None, tenants=None, kv_dir: Path | None = None) -> None:
        self.registry = registry
        self.memory = memory
        self._server = server
        self.log_dir = log_dir
        self.kv_dir = kv_dir  # warm swaps' saved KV, a directory per model (None: nowhere to save)
        self._spawn = spawn  # a tracked background task (its failure is logged)
        self.launcher = launcher
        self.tenants = tenants  # supervisor/admission/tenants.py: their shares order each executor's queue
        self.transport = transport  # set when the engine starts (or injected by a test)
        self.cluster: RayCluster | None = None  # replicas on Ray nodes (placement = "ray"), once one loads
        self.shutting_down = False
        self.loads = dict.fromkeys(LOAD_REASONS, 0)  # counters for /metrics
        self.load_durations = LoadDurations()

    # -- requests ------------------------------------------------------------------------------
    def admit(self, entry: ModelEntry, job: Job) -> None:
        """Where a job waits, by the model's state now; raises the request's error. The one
        hand-over of a job to its model: whatever was checked before an await is checked
        again here, in the loop turn that queues it (the state, load_on_demand, shutdown)."""
        refused = self.refusal(entry)
        if refused is not None:
            raise refused
        state = entry.state
        if state is MODEL_AUTO_UNLOADING:  # wait for the next load on demand
            entry.waiting = [j for j in entry.waiting if j.state is JobState.QUEUED]  # gone ones hold no place
            if len(entry.waiting) >= entry.cfg.max_queue:
                raise PoolError(ErrorCode.QUEUE_FULL, f"model {entry.cfg.name!r} has {len(entry.waiting)} "
                                f"requests waiting for its next load (max_queue)", retry_after_s=1)
            entry.waiting.append(job)
        elif state is MODEL_UNLOADED or state is MODEL_FAILED:
            self.load_on_demand(entry, tenant_actor(job.tenant)).enqueue(job)
        else:
            entry.executor.enqueue(job)  # while loading, it waits in the queue for the replicas

    def refusal(self, entry: ModelEntry) -> PoolError | None:
        """Why a request for this model is refused in its state now; None if it is not."""
        if self.shutting_down:
            return PoolError(ErrorCode.MODEL_UNLOADING, "the pool is shutting down")
        if not self.registry.is_configured(entry):  # a reload removed it while the request was admitted
            return PoolError(ErrorCode.MODEL_NOT_FOUND, f"model {entry.cfg.name!r} was removed by a reload",
                             param="model")
        state = entry.state
        if state is MODEL_UNLOADING:
            return PoolError(ErrorCode.MODEL_UNLOADING, f"model {entry.cfg.name!r} is unloading", param="model",
                             retry_after_s=1)
        if state is not MODEL_UNLOADED and state is not MODEL_FAILED:
            return None
        if not entry.cfg.load_on_demand:
            return PoolError(ErrorCode.MODEL_NOT_LOADED,
                             f"model {entry.cfg.name!r} is {entry.state.value}; load it first", param="model")
        if entry.held_by:
            return PoolError(ErrorCode.MODEL_NOT_LOADED, f"model {entry.cfg.name!r} is held unloaded (`llm-pool "
                             f"unload --hold`, by {entry.held_by}); an operator's load releases it", param="model")
        return None

    # -- load ----------------------------------------------------------------------------------
    def _prepare_load(self, entry: ModelEntry) -> Executor:
        """LOADING, with an executor that queues jobs until its replicas are ready
        (no await: a request that sees `loading` always finds a queue)."""
        entry.error = None
        entry.failed_replicas = []
        entry.load_started = time.monotonic()
        executor = Executor(entry.cfg, on_replicas_changed=entry.replicas_changed, tenants=self.tenants)
        if entry.cfg.remote and self.cluster is None:
            self.cluster = RayCluster(self._server(), self.transport)
        launcher = self.cluster.launcher(entry.cfg) if entry.cfg.remote else self.launcher
        # every model's key variable: each worker sees its own model's alone
        key_env = frozenset(e.cfg.options["api_key_env"] for e in self.registry.configured()
                            if e.cfg.options.get("api_key_env"))
        executor.replicas = [Replica(entry.cfg, self._server(), i, self.transport, self.log_dir, executor,
                                     launcher=launcher, secret_env=key_env, kv_dir=self.kv_dir)
                             for i in range(entry.cfg.replicas)]
        executor.start()
        entry.executor = executor
        entry.set_state(ModelState.LOADING)
        return executor

    async def load(self, name: str, reason: str = "operator", by: str | None = None) -> ModelEntry:
        """Load a model; waits for a load, unload or restart of it under way first."""
        entry = self.registry.lookup(name)
        if reason == "operator":  # an operator's load (or restart of an unloaded model) releases a hold
            entry.held_by = None
        async with entry.action:
            if entry.state in RUNNING:
                return entry
            if self.shutting_down:
                raise PoolError(ErrorCode.MODEL_UNLOADING, "the pool is shutting down")
            if entry.state in UNLOADS:  # an unload asked before this load waits for the lock behind it
                raise PoolError(ErrorCode.MODEL_UNLOADING, f"model {name!r} is unloading; load it when that "
                                f"is done", param="model", retry_after_s=1)
            if entry.state is not ModelState.LOADING:  # else a request prepared it (load on demand)
                self._prepare_load(entry)
            await self._run_load(entry, reason, by)
            return entry

    async def load_quietly(self, name: str, reason: str) -> None:
        try:
            await self.load(name, reason)
        except PoolError as exc:
            log.error("load of %s failed: %s", name, exc.message)

    def load_on_demand(self, entry: ModelEntry, by: str) -> Executor:
        """Load for a request; `by`: whose (tenant_actor), for the timeline."""
        executor = self._prepare_load(entry)
        emit(EventKind.LOADING, f"model {entry.cfg.name}: loading (on demand: a request for it)",
             model=entry.cfg.name, by=by)
        since = None if entry.operator_unload_at is None else time.monotonic() - entry.operator_unload_at
        if since is not None and since <= UNDONE_WINDOW_S:  # the operator's unload achieved nothing: say so
            entry.operator_unload_at = None
            emit(EventKind.UNLOAD_UNDONE, f"model {entry.cfg.name} was loaded on demand {since:.0f}s after an "
                 f"operator's unload: requests keep coming; `llm-pool unload {entry.cfg.name} --hold` keeps it "
                 "unloaded", model=entry.cfg.name, by=by, level=logging.WARNING)

        async def run() -> None:
            async with entry.action:
                if entry.executor is executor and entry.state is ModelState.LOADING:
                    try:
                        await self._run_load(entry, "on_demand", by)
                    except PoolError as exc:
                        log.error("load of %s on demand failed: %s", entry.cfg.name, exc.message)
        self._spawn(run())
        return executor

    async def _run_load(self, entry: ModelEntry, reason: str,
                        by: str | None = None) -> None:  # holds entry.action, state LOADING
        name, executor = entry.cfg.name, entry.executor
        try:
            await self.memory.make_room(entry, reason == "on_demand",
                                        lambda victim, why: self._evict(victim, why, for_whom=by),
                                        lambda: self.shutting_down)
        except PoolError as exc:
            if entry.state is ModelState.LOADING:  # else an unload took it over, and ends it
                executor.fail_queued(exc)
                entry.error = exc.message
                self._detach(entry)
                entry.set_state(ModelState.UNLOADED)
                emit(EventKind.LOAD_FAILED, f"model {name}: not loaded: {exc.message}", model=name, by=by,
                     level=logging.ERROR)
                await executor.close()
            raise
        if entry.state is not ModelState.LOADING:  # an unload came while it waited for memory: it wins
            raise PoolError(ErrorCode.MODEL_UNLOADING, f"model {name!r} was unloaded while it loaded")
        try:
            if entry.cfg.remote:
                await self.cluster.connect()
        except OSError as exc:
            errors = [str(exc)]
        else:
            results = await asyncio.gather(*(r.start() for r in executor.replicas), return_exceptions=True)
            errors = [f"{r.name}: {res}" for r, res in zip(executor.replicas, results)
                      if isinstance(res, BaseException)]
        if errors and entry.state is not ModelState.LOADING:  # an unload's stop failed them: the unload ends it
            raise PoolError(ErrorCode.MODEL_UNLOADING, f"model {name!r} was unloaded while it loaded")
        if errors:
            entry.error = "; ".join(errors)
            error = PoolError(ErrorCode.LOAD_FAILED, f"model {name!r} failed to load: {entry.error}")
            executor.fail_queued(error)
            await asyncio.gather(*(r.stop() for r in executor.replicas), return_exceptions=True)
            if entry.state is not ModelState.LOADING:  # an unload came while they stopped: it ends it
                raise error
            executor.fail_queued(error)  # requests that came while the replicas stopped
            self._detach(entry)
            entry.failed_replicas = executor.replicas  # listed with their errors and logs until the next load
            entry.set_state(ModelState.FAILED)
            emit(EventKind.LOAD_FAILED, f"model {name}: load failed: {entry.error}", model=name, by=by,
                 level=logging.ERROR)
            await executor.close()
            raise error
        entry.load_seconds = time.monotonic() - entry.load_started
        if entry.state is ModelState.LOADING:  # else an unload came during the load: it drains and stops
            entry.set_state(ModelState.LOADED)
            entry.replicas_changed()  # a replica may have crashed between its start and now
        entry.used()
        self.loads[reason] = self.loads.get(reason, 0) + 1
        self.load_durations.observe(entry.load_seconds)
        self.memory.measure_soon(entry)  # its first footprint
        emit(EventKind.LOADED, f"model {name} loaded in {entry.load_seconds:.2f}s ({reason})", model=name, by=by)

    def _detach(self, entry: ModelEntry) -> None:
        """Its replicas are stopped: the executor goes (the caller sets the state that
        has none in the same loop turn, then closes it), its memory leaves the ledger, and a
        reload's new config takes its place (so the next load, whoever asks it, runs that)."""
        entry.executor = None
        self.memory.release(entry)
        if entry.next_cfg is not None:  # a reload's config: in effect now that nothing runs the old one
            entry.cfg, entry.next_cfg = entry.next_cfg, None
            entry.measured_mb = None

    # -- unload --------------------------------------------------------------------------------
    def stop_intake(self, entry: ModelEntry, why: str = "unloaded") -> None:
        """An unload begins: new requests get 503 from now on, before any lock is
        waited for, and no worker of the model starts from now on (Replica.wind_down: a load,
        a restart or a crash restart under way ends). An automatic unload it overrides lets
        its waiters go with 503."""
        if entry.state in RUNNING or entry.state in (ModelState.LOADING, ModelState.AUTO_UNLOADING):
            entry.unload_why = why
        if entry.state is ModelState.AUTO_UNLOADING:
            waiting, entry.waiting = entry.waiting, []
            error = PoolError(ErrorCode.MODEL_UNLOADING, f"model {entry.cfg.name!r} was unloaded ({why})")
            for job in waiting:
                job.finish(error)
            entry.set_state(ModelState.UNLOADING)
        elif entry.state in RUNNING or entry.state is ModelState.LOADING:
            entry.set_state(ModelState.UNLOADING)
        if entry.state is ModelState.UNLOADING:
            # the stop wins over any start under way (a load, a restart, a crash restart): no
            # worker starts from now on, and serving ones drain
            for r in entry.executor.replicas if entry.executor else ():
                r.wind_down(*unload_stop(why))

    async def unload(self, name: str, drain_timeout_s: float | None = None, why: str = "unloaded") -> ModelEntry:
        """Drain and stop a model; waits for a load or restart of it under way first."""
        return await self.unload_entry(self.registry.lookup(name, removed_too=True), drain_timeout_s, why)

    async def unload_entry(self, entry: ModelEntry, drain_timeout_s: float | None = None,
                           why: str = "unloaded") -> ModelEntry:
        self.stop_intake(entry, why)
        async with entry.action:
            self.stop_intake(entry, why)  # loaded again while this waited (a load asked before it)
            await self._unload_now(entry, drain_timeout_s)
            return entry

    async def _unload_now(self, entry: ModelEntry, drain_timeout_s: float | None = None) -> None:
        """Holds entry.action. Ends an unload under way; a failed model is cleared."""
        if entry.state is ModelState.FAILED:
            entry.set_state(ModelState.UNLOADED)
            entry.failed_replicas = []
            return
        if entry.state not in UNLOADS:  # not loaded, or another unload ended it
            return
        executor = entry.executor
        for r in executor.replicas:
            # stop_intake did; a replica a restart brought back since is wound down too
            r.wind_down(*unload_stop(entry.unload_why))
        await executor.drain(drain_timeout_s if drain_timeout_s is not None else entry.cfg.request_timeout_s)
        await asyncio.gather(*(r.stop() for r in executor.replicas), return_exceptions=True)
        self._detach(entry)
        waiting, entry.waiting = [j for j in entry.waiting if j.state is JobState.QUEUED], []
        entry.set_state(ModelState.UNLOADED)
        emit(EventKind.UNLOADED, f"model {entry.cfg.name} unloaded", model=entry.cfg.name)
        if waiting:
            self._reload_for(entry, waiting)  # in this loop turn: a new request finds that load
        await executor.close()

    def _reload_for(self, entry: ModelEntry, waiting: list[Job]) -> None:
        """Requests that waited through an automatic unload start the next load."""
        if self.shutting_down or not self.registry.is_configured(entry):
            error = PoolError(ErrorCode.MODEL_UNLOADING, f"model {entry.cfg.name!r} was unloaded "
                              f"({'shutdown' if self.shutting_down else 'removed from the config'})")
            for job in waiting:
                job.finish(error)
            return
        log.info("model %s: %d requests waited through its unload; loading it again", entry.cfg.name, len(waiting))
        self.load_on_demand(entry, tenant_actor(waiting[0].tenant)).adopt(waiting)

    def _begin_auto_unload(self, entry: ModelEntry, reason: str, for_whom: str | None = None) -> None:
        """Holds entry.action (taken with take_now). Intake stops in this loop turn;
        a load_on_demand model's queued requests (and new ones) wait for its next load.
        `for_whom`: who asked for the load that evicts this model (the timeline's actor)."""
        evicted = reason.startswith("evicted")
        by = ("memory budget" + (f", for {for_whom}" if for_whom else "")) if evicted else "idle timer"
        emit(EventKind.EVICTED if evicted else EventKind.UNLOADING, f"model {entry.cfg.name}: unloading ({reason})",
             model=entry.cfg.name, by=by)
        entry.unload_why = reason
        if entry.cfg.load_on_demand:
            entry.waiting = entry.executor.take_queued()
            entry.set_state(ModelState.AUTO_UNLOADING)
        else:
            entry.set_state(ModelState.UNLOADING)

    def idle_unload(self, entry: ModelEntry, reason: str) -> bool:
        """Start an idle unload now; False if an action on the model holds it."""
        if entry.state not in RUNNING or not entry.action.take_now():
            return False
        self._begin_auto_unload(entry, reason)

        async def run() -> None:
            try:
                await self._unload_now(entry)
            finally:
                entry.action.release()
        self._spawn(run())
        return True

    async def _evict(self, victim: ModelEntry, reason: str, for_whom: str | None = None) -> bool:
        """Called by a loader that holds its own lock: take the victim's only if that
        needs no wait (the lock order rule), and unload it here."""
        if victim.state not in RUNNING or not victim.action.take_now():
            return False
        try:
            self._begin_auto_unload(victim, reason, for_whom)
            await self._unload_now(victim)
        finally:
            victim.action.release()
        return True

    # -- idle ----------------------------------------------------------------------------------
    def idle_unload_s(self, entry: ModelEntry) -> float | None:
        return entry.cfg.idle_unload_s or self._server().idle_unload_s

    def idle_unload_in(self, entry: ModelEntry, now: float) -> float | None:
        """Seconds until an idle unload; None when none is coming (not loaded, busy, pinned, never)."""
        idle_s = self.idle_unload_s(entry)
        if (idle_s is None or entry.cfg.pinned or entry.state not in RUNNING or not entry.idle
                or self.shutting_down or entry.action.locked()):
            return None
        return max(0.0, entry.last_used + idle_s - now)

    # -- restart ---------------------------------------------------------------------------------
    async def restart(self, name: str, replica: int | None = None, *, now: bool = False,
                      by: str | None = None) -> ModelEntry:
        """Restart a model's replicas (one, or all, one after another), or load it
        when it is not loaded. Each replica first drains: out of rotation, its
        running jobs get the model's drain_timeout_s to finish (`now`: cut at once).
        Refused (409) while a load, unload or restart of it is under way: it would
        cut draining jobs or fight the other action."""
        entry = self.registry.lookup(name)
        name = entry.cfg.name
        if entry.action.locked() or entry.state in (ModelState.LOADING, *UNLOADS):
            doing = {ModelState.LOADING: "loading", ModelState.UNLOADING: "unloading",
                     ModelState.AUTO_UNLOADING: "unloading"}.get(entry.state, "being restarted")
            raise PoolError(ErrorCode.MODEL_BUSY, f"model {name!r} is {doing}; restart refused "
                            f"(try again when that is done)", param="model")
        if self.shutting_down:
            raise PoolError(ErrorCode.MODEL_UNLOADING, "the pool is shutting down")
        if entry.state not in RUNNING:
            return await self.load(name, "operator", by)
        if not entry.action.take_now():  # cannot fail after the check above (no await since)
            raise PoolError(ErrorCode.MODEL_BUSY, f"model {name!r} is being restarted; restart refused")
        try:
            executor = entry.executor
            targets = executor.replicas if replica is None else [
                r for r in executor.replicas if r.index == replica]
            if not targets:
                raise PoolError(ErrorCode.INVALID_REQUEST, f"model {name!r} has no replica {replica}")
            drain_s = None if now else entry.cfg.drain_timeout_s
            failed = []
            real_failure = False  # a replica failed to restart while nothing stopped the model
            for r in targets:  # one at a time: the others keep serving
                if entry.state not in RUNNING or self.shutting_down:  # an unload or a stop came: it wins
                    failed.append(f"{r.name}: not restarted: the model is {entry.state.public.value}")
                    continue
                how = "now (running jobs are cut)" if now else f"after its running jobs finish (up to {drain_s:g}s)"
                emit(EventKind.RESTARTING, f"replica {r.name}: restarting {how}", model=name, replica=r.index, by=by)
                try:
                    await r.restart(drain_s)
                except Exception as exc:
                    failed.append(f"{r.name}: {exc}")
                    stopped_it = entry.state not in RUNNING or self.shutting_down  # an unload or a stop
                    real_failure = real_failure or not stopped_it
                    emit(EventKind.RESTART_FAILED, f"replica {r.name}: restart failed: {exc}", model=name,
                         replica=r.index, by=by, level=logging.ERROR)
                else:
                    emit(EventKind.RESTARTED, f"replica {r.name} restarted", model=name, replica=r.index, by=by)
            stopped = entry.state not in RUNNING or self.shutting_down  # an unload or a stop won meanwhile
        finally:
            entry.action.release()
        if failed:
            raise PoolError(ErrorCode.MODEL_UNLOADING if stopped and not real_failure else ErrorCode.LOAD_FAILED,
                            "; ".join(failed))
        return entry
