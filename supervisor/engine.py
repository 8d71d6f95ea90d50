"""ModelRouterEngine: the composition root of the model lifecycle. It builds the
owners in supervisor/models/ (registry, memory, lifecycle, reload, views) and
wires them; it owns the transport, the heartbeat loop over all replicas, the
entry point for jobs, and the pool's start, drain and shutdown."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
import os
import time

from protocol import Done
from protocol.errors import ErrorCode, PoolError
from supervisor.config import ConfigError, PoolConfig, load_config
from supervisor.scheduling.deadlines import Prediction, learn, predict
from supervisor.telemetry.request_context import REQUEST_ID
from supervisor.events import EventKind, emit
from supervisor.scheduling.jobs import Job
from supervisor.models.health import readiness
from supervisor.models import reload as reloading
from supervisor.models.lifecycle import Lifecycle, LoadDurations
from supervisor.models.memory import Memory
from supervisor.models.registry import ModelEntry, Registry
from supervisor.models.views import Views
from supervisor.replicas.observe import ProcessSampler
from supervisor.replicas.process import Launcher, spawn_worker, sweep_stale_workers
from supervisor.admission.prompt_bounds import check_prompt_bounds
from supervisor.admission.prompt_tokens import PromptTokenizer
from supervisor.request_bounds import check_request_bounds
from supervisor.state_dir import make_private_dir, pool_state_dir
from supervisor.models.warm_swaps import SavedKv
from supervisor.states import ReplicaState
from supervisor.admission.tenants import DEFAULT as DEFAULT_TENANT
from supervisor.tasks import TaskSet
from supervisor.admission.tenants import Tenants
from supervisor.replicas.transport import Transport, sweep_stale_socket_dirs

log = logging.getLogger("llm_pool.engine")



class ModelRouterEngine:
    def __init__(self, config: PoolConfig, launcher: Launcher = spawn_worker,
                 transport: Transport | None = None, tenants: Tenants | None = None) -> None:
        """`launcher` and `transport` are injected by the model-machine tests (fakes)."""
        self.config = config
        self.tenants = tenants or Tenants(config)  # their shares order each model's queue; a reload updates them
        self.state_dir = pool_state_dir(config.server.state_dir)  # see supervisor/state_dir.py
        self.log_dir = self.state_dir / "logs"
        self.kv_dir = self.state_dir / "kv"  # warm swaps (runtime_worker/warm_swap.py)
        server = lambda: self.config.server  # noqa: E731  (a reload replaces the config)
        self.registry = Registry(config.models)
        self.sampler = ProcessSampler()  # psutil and NVML, off the loop: footprints read its cache
        self.memory = Memory(self.registry, server, self.sampler)
        self.lifecycle = Lifecycle(self.registry, self.memory, server, self.log_dir, self.spawn,
                                   launcher=launcher, transport=transport, tenants=self.tenants, kv_dir=self.kv_dir)
        self.reloader = reloading.Reloader(self.registry, self.lifecycle, self.spawn)
        self.saved_kv = SavedKv(self.kv_dir, server)
        self.views = Views(self.registry, self.memory, self.lifecycle, self.saved_kv)
        self._drain: asyncio.Future | None = None  # the one drain of a graceful stop
        self._closed = False
        self._tasks = TaskSet()
        self.starting: set[str] = set()  # models whose start-up load has not ended yet (/ready waits)
        self.tokenizer = PromptTokenizer()  # token ids for the exact prefix index (routing "prefix" on vLLM)

    # -- what other modules read (names kept from before the split) ------------------------------
    @property
    def models(self) -> dict[str, ModelEntry]:
        return self.registry.models

    @property
    def aliases(self) -> dict[str, str]:
        return self.registry.aliases

    @property
    def shutting_down(self) -> bool:
        return self.lifecycle.shutting_down

    @property
    def loads(self) -> dict[str, int]:
        return self.lifecycle.loads

    @property
    def load_durations(self) -> LoadDurations:
        return self.lifecycle.load_durations

    @property
    def evictions(self) -> int:
        return self.memory.evictions

    @property
    def swaps(self) -> int:
        return self.memory.swaps

    def entry(self, name: str, removed_too: bool = False) -> ModelEntry:
        return self.registry.lookup(name, removed_too)

    def model_view(self, entry: ModelEntry) -> dict:
        return self.views.model_view(entry)

    def model_list(self) -> list[dict]:
        return self.views.model_list()

    async def load(self, name: str, reason: str = "operator", by: str | None = None) -> ModelEntry:
        return await self.lifecycle.load(name, reason, by)

    async def unload(self, name: str, drain_timeout_s: float | None = None, by: str | None = None,
                     hold: bool = False) -> ModelEntry:
        """`hold`: it stays unloaded (no load on demand) until an operator's load or a reload."""
        entry = self.registry.lookup(name, removed_too=True)
        if by:  # an operator's unload: the timeline says who asked
            held = " and holding it unloaded" if hold else ""
            emit(EventKind.UNLOADING, f"model {entry.cfg.name}: unloading{held}", model=entry.cfg.name, by=by)
        if hold:  # before the unload begins: no request loads it again from now on
            entry.held_by = by or "an operator"
        entry = await self.lifecycle.unload(name, drain_timeout_s, why=f"asked by {by}" if by else "unloaded")
        if by:
            entry.operator_unload_at = time.monotonic()  # a load on demand soon after is warned of
        return entry

    async def restart(self, name: str, replica: int | None = None, *, now: bool = False,
                      by: str | None = None) -> ModelEntry:
        return await self.lifecycle.restart(name, replica, now=now, by=by)

    # -- process-wide lifecycle ----------------------------------------------------------
    async def start(self) -> None:
        # replica logs, and the request log with any bodies it keeps: for this user only
        make_private_dir(self.log_dir)
        make_private_dir(self.kv_dir)  # saved KV holds what conversations said
        swept = sweep_stale_workers()
        if swept:
            log.warning("swept %d stale worker(s) of a dead supervisor", len(swept))
        for path in sweep_stale_socket_dirs():
            log.warning("removed %s, the socket directory of a dead supervisor", path)
        self.lifecycle.transport = Transport()
        self.lifecycle.transport.start()
        self.sampler.start()
        self.spawn(self._heartbeat_loop(), "heartbeats")
        configured = self.registry.configured()
        for entry in configured:
            if entry.cfg.load_on_start:
                self.starting.add(entry.cfg.name)
                self.spawn(self._start_load(entry.cfg.name), f"start-load-{entry.cfg.name}")
        emit(EventKind.STARTED, f"supervisor started (pid {os.getpid()}; {len(configured)} models configured, "
             f"{len(self.starting)} loading)")
        if not self.starting:
            self._started()

    async def _start_load(self, name: str) -> None:
        """One model's start-up load; /ready waits for all of them to end, however they end."""
        try:
            await self.lifecycle.load_quietly(name, "start")
        finally:
            self.starting.discard(name)
            if not self.starting:
                self._started()

    def _started(self) -> None:
        """The start-up loads settled: the timeline says what serves and what does not."""
        answer = readiness(self)
        if "serving" not in answer:  # stopping already
            return
        broken = f"; not serving: {', '.join(answer['not_serving'])}" if answer["not_serving"] else ""
        emit(EventKind.READY, f"supervisor {'ready' if answer['ready'] else 'not ready'}: "
             f"{len(answer['serving'])} of {len(answer['serving']) + len(answer['not_serving'])} models can serve"
             f"{broken}", level=logging.INFO if answer["ready"] else logging.ERROR)

    async def drain_all(self, grace_s: float, by: str | None = None) -> None:
        """First step of a graceful stop: /ready turns 503, every model starts its
        unload (new and queued requests get 503), submitted ones get up to `grace_s`
        to finish (or until `stop_draining`). Called again, it waits for the same
        drain: the grace is spent once."""
        self.lifecycle.shutting_down = True
        if self._drain is None:
            busy = sum(e.executor.runtime_inflight for e in self.models.values() if e.executor)
            emit(EventKind.STOPPING, f"supervisor stopping: {busy} requests running get up to {grace_s:g}s to "
                 "finish", by=by)
            for entry in self.models.values():
                self.lifecycle.stop_intake(entry, "shutdown")
            executors = [e.executor for e in self.models.values() if e.executor]
            for ex in executors:
                for r in ex.replicas:
                    r.wind_down("shutdown")  # no worker starts again; a crash now is final
            self._drain = asyncio.ensure_future(asyncio.gather(
                *(ex.drain(grace_s) for ex in executors), return_exceptions=True))
        await asyncio.shield(self._drain)

    def stop_draining(self) -> None:
        """A second signal: submitted jobs get no more time."""
        for entry in self.models.values():
            if entry.executor:
                entry.executor.stop_draining()

    async def shutdown(self, grace_s: float) -> None:
        """Stop accepting everywhere, let submitted work finish within `grace_s`
        (unless drain_all spent it already), then stop every worker, each within
        its stop timeout. Leaves no process behind. Safe to call twice."""
        await self.drain_all(grace_s)
        if not self._closed:
            self._closed = True
            # stop every replica at once, starting ones included (a load or restart then fails fast)
            entries = [e for e in self.models.values() if e.executor]
            await asyncio.gather(*(r.stop("shutdown") for e in entries for r in e.executor.replicas),
                                 return_exceptions=True)
            await asyncio.gather(*(self.lifecycle.unload_entry(e, drain_timeout_s=0, why="shutdown")
                                   for e in entries), return_exceptions=True)
            await self._tasks.close()
            if self.lifecycle.transport:
                await self.lifecycle.transport.close()
            if self.lifecycle.cluster:
                await self.lifecycle.cluster.close()
            await self.tokenizer.close()
            self.sampler.stop()
            emit(EventKind.STOPPED, "supervisor stopped (every worker stopped)")

    def ready(self) -> bool:
        """/ready: start-up loads settled (loaded or failed) and a model can serve (model_health.readiness)."""
        return readiness(self)["ready"]

    def spawn(self, coro, name: str | None = None) -> asyncio.Task:
        """Run `coro` in the background, held until it ends (cancelled at shutdown); a failure is logged."""
        return self._tasks.spawn(coro, name)

    async def _heartbeat_loop(self) -> None:
        period = self.config.server.heartbeat_s
        last = time.monotonic()
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            stalled_s, last = now - last - period, now
            try:
                if stalled_s > period:  # this process was stalled (or stopped): the silence was its own
                    for entry in self.models.values():
                        for r in entry.executor.replicas if entry.executor else ():
                            r.excuse_silence(stalled_s)
                self.tick(now)
            except Exception:  # one bad tick must not end the heartbeats
                log.exception("heartbeat tick failed")

    def tick(self, now: float) -> None:
        """Every heartbeat period: ping (and liveness-check) every worker, then
        reconcile each executor: re-derive what a missed event should have caused."""
        self.saved_kv.refresh_due(now, self.spawn)
        for entry in list(self.models.values()):
            if entry.executor:
                for r in entry.executor.replicas:
                    r.heartbeat(now)
                entry.executor.reconcile()
                entry.replicas_changed()  # a missed replica event: the model's state follows anyway
                if not entry.idle:
                    entry.used(now)
                self.memory.measure_due(entry, now)
            idle_s = self.lifecycle.idle_unload_in(entry, now)
            if idle_s is not None and idle_s <= 0:
                self.lifecycle.idle_unload(entry, f"idle for {self.lifecycle.idle_unload_s(entry):g}s")

    # -- jobs -------------------------------------------------------------------------------------
    def wants_prompt_tokens(self, entry: ModelEntry) -> bool:
        """Whether the model's routing is "prefix", where a request's token ids choose its
        replica (the default only with several replicas; set by hand on one, the exact index
        still shows what its cache holds)."""
        return entry.executor is not None and entry.executor.choice.routing == "prefix"

    def prompt_tokens(self, entry: ModelEntry, request: dict,
                      endpoint: str = "chat") -> Awaitable[list[int] | None] | None:
        """What asks for the request's prompt as token ids, where its model's routing needs them
        (prefix routing): an awaitable of them (None when no ready replica can say). None, and
        no coroutine made, where routing needs none: every other request."""
        if not self.wants_prompt_tokens(entry):
            return None
        return self._prompt_tokens(entry, request, endpoint)

    async def _prompt_tokens(self, entry: ModelEntry, request: dict, endpoint: str) -> list[int] | None:
        """From a ready replica's tokenizer, when the model's replicas report their cache (KV events)."""
        url = next((r.info.get("tokenize_url") for r in entry.executor.replicas
                    if r.state is ReplicaState.READY and isinstance(r.info, dict) and r.info.get("kv_events")), None)
        if not isinstance(url, str):
            return None
        return await self.tokenizer.tokens(url, request, endpoint)

    def make_job(self, entry: ModelEntry, request: dict, endpoint: str = "chat",
                 tenant: str = DEFAULT_TENANT, headers: dict | None = None) -> Job:
        """The job for `request` on `entry`, not yet queued: 400 for a request out of bounds,
        409/503 for a model that refuses work in its state."""
        check_request_bounds(request, endpoint)
        refused = self.lifecycle.refusal(entry)  # early, before the body's bounds; enqueue asks again
        if refused is not None:
            raise refused
        check_prompt_bounds(entry.cfg, request)
        job = Job(entry.cfg.name, request, entry.cfg.request_timeout_s, entry.cfg.queue_timeout_s, endpoint,
                  self.config.server.max_job_output_bytes, tenant=tenant,
                  max_unsent_bytes=self.config.server.max_unsent_output_bytes, headers=headers)
        job.request_id = REQUEST_ID.get()  # the edge's, in this request's context: in-flight rows show it
        if entry.cfg.log_bodies:
            job.transcript = []
        return job

    def enqueue(self, entry: ModelEntry, job: Job) -> None:
        """Queue `job` on its model (a load started when it needs one)."""
        entry.used()
        self.lifecycle.admit(entry, job)

    def learn(self, job: Job, done: Done) -> None:
        """A request served: its model's predictor learns from it (latency_predictor.py)."""
        entry = self.models.get(job.model)
        if entry is not None and job.run.submitted_at is not None:
            learn(entry.predictor, job, done, time.monotonic())

    def predict(self, entry: ModelEntry, tenant: str, frame_bytes: int) -> Prediction:
        return predict(entry, tenant, frame_bytes)

    def waiting(self, job: Job) -> Prediction | None:
        """A queued job's place and predicted wait from now (None: it is not queued)."""
        entry = self.models.get(job.model)
        if entry is None:
            return None
        if job in entry.waiting:
            position = entry.waiting.index(job)
        else:
            position = entry.executor.position(job) if entry.executor is not None else None
        return None if position is None else predict(entry, job.tenant, len(job.frame), ahead=position)

    def cancel(self, job: Job) -> None:
        entry = self.models.get(job.model)
        if entry and entry.executor:
            entry.executor.cancel(job)
        elif job.run.replica:
            job.run.replica.cancel(job)

    # -- config reload ----------------------------------------------------------------------------
    async def reload(self) -> dict:
        """Re-read the config file and apply the difference (models/reload.py). A bad
        file is refused whole (400, serve's message) and nothing changes."""
        if self.config.source is None:
            raise PoolError(ErrorCode.INVALID_REQUEST, "this pool was not started from a config file")
        try:
            new = self.config.keep_overrides(load_config(self.config.source))  # serve --port stays
        except ConfigError as exc:
            raise PoolError(ErrorCode.INVALID_REQUEST, f"config error: {exc}") from None
        if self.shutting_down:
            raise PoolError(ErrorCode.MODEL_UNLOADING, "the pool is shutting down")
        change = reloading.diff(self.config, new)
        try:
            self.tenants.apply(new)  # weights, scopes, limits and keys; no worker is touched
        except ConfigError as exc:
            raise PoolError(ErrorCode.INVALID_REQUEST, f"config error: {exc}") from None
        self.config = new
        for entry in self.registry.configured():  # a reload releases every unload's hold
            entry.held_by = None
        self.reloader.apply(change, new)
        return change.summary()
