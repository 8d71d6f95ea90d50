"""ModelRouterEngine: the registry of public models (and their aliases), their
states, load and unload, and the entry point for jobs. It owns the transport,
one executor per loaded (or loading) model, and the heartbeat loop over all
replicas. Models come and go here too: load on demand (a request's job waits in
the queue of the loading model), idle unload, the memory budgets with LRU
eviction and swap-aware waiting, and config reload."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from protocol.errors import ErrorCode, PoolError
from supervisor.config import ConfigError, ModelConfig, PoolConfig, load_config
from supervisor.jobs import Job, JobState
from supervisor.observe import gpu_memory_by_pid
from supervisor.process import spawn_worker, sweep_stale_workers
from supervisor.ray_placement import RayCluster
from supervisor.replica import Replica
from supervisor.scheduler import Executor
from supervisor.states import MODEL_TRANSITIONS, ModelState, ReplicaState, transition
from supervisor.tenants import DEFAULT as DEFAULT_TENANT
from supervisor.tenants import Tenants
from supervisor.transport import Transport, sweep_stale_socket_dirs

log = logging.getLogger("llm_pool.engine")


# [server] keys a reload applies; the others are bound when the pool starts
SERVER_KEYS_APPLIED_ON_RELOAD = frozenset({"memory_budget_mb", "gpu_memory_budget_mb", "idle_unload_s",
                                           "max_swap_wait_s"})
MEASURE_EVERY_S = 5.0  # a footprint walks the process tree (and asks NVML): not on every heartbeat


def default_state_dir() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "llm-pool"


# Keys a reload applies in place: they change when the model comes and goes, not how it runs.
IN_PLACE_KEYS = frozenset({"aliases", "pinned", "idle_unload_s", "load_on_demand", "load_on_start", "memory_mb"})
LOAD_REASONS = ("start", "on_demand", "operator", "reload")
LOAD_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
KV_MB_PER_TOKEN = 0.125  # rough context cost for an estimate before the first load (a 7B f16 KV is ~0.5)


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


@dataclass
class ModelEntry:
    cfg: ModelConfig
    state: ModelState = ModelState.UNLOADED
    executor: Executor | None = None
    error: str | None = None
    load_started: float | None = None
    load_seconds: float | None = None
    busy: asyncio.Lock | None = None  # one load/unload/restart at a time
    last_used: float = field(default_factory=time.monotonic)  # a job queued or running
    last_used_at: float | None = None  # wall clock, for views
    holds_memory: bool = False  # passed the memory budget's gate; counts until unloaded
    measured_mb: float | None = None  # process-tree RSS of its replicas, once loaded
    measured_gpu_mb: dict[str, float] | None = None  # GPU memory (NVML) per device, once loaded
    removed: bool = False  # gone from the config by a reload: draining, then forgotten
    # During an automatic unload (idle, evicted): requests that wait for the next load on demand.
    pending: list[Job] | None = None
    measured_at: float = 0.0  # monotonic: the footprint's last measurement

    def used(self, now: float | None = None) -> None:
        self.last_used = now if now is not None else time.monotonic()
        self.last_used_at = time.time()

    @property
    def idle(self) -> bool:
        ex = self.executor
        return ex is None or (not ex.queue and ex.runtime_inflight == 0)

    def set_state(self, new: ModelState) -> None:
        self.state = transition(MODEL_TRANSITIONS, self.state, new)


def check_prompt_bounds(cfg: ModelConfig, request: dict) -> None:
    """400 for a prompt over the model's max_messages or max_prompt_chars (chat
    messages, a legacy completion's prompt, or an embedding's input)."""
    messages = request.get("messages") or []
    if len(messages) > cfg.max_messages:
        raise PoolError(ErrorCode.INVALID_REQUEST, f"{len(messages)} messages, over model {cfg.name!r}'s "
                        f"max_messages ({cfg.max_messages})", param="messages")
    chars = _text_chars(request.get("prompt")) + _text_chars(request.get("input"))
    for m in messages:
        if isinstance(m, dict):
            chars += _text_chars(m.get("content"))
    if chars > cfg.max_prompt_chars:
        raise PoolError(ErrorCode.INVALID_REQUEST, f"the prompt has {chars} characters, over model "
                        f"{cfg.name!r}'s max_prompt_chars ({cfg.max_prompt_chars})",
                        param="messages" if messages else "prompt" if "prompt" in request else "input")


def _text_chars(content) -> int:
    """Size of a message's content or a prompt: a string's characters, a list of
    strings, content parts (their text), token ids (one each) or token-id lists."""
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(_text_chars(part) if isinstance(part, (str, list))
                   else len(part.get("text") or "") if isinstance(part, dict) else 1 for part in content)
    return 0


class ModelRouterEngine:
    def __init__(self, config: PoolConfig, tenants: Tenants | None = None) -> None:
        self.config = config
        self.tenants = tenants or Tenants(config)  # their shares order each model's queue; a reload updates them
        self.models = {m.name: ModelEntry(m, busy=asyncio.Lock()) for m in config.models}
        self.aliases = {a: m.name for m in config.models for a in m.aliases}
        self.loads = dict.fromkeys(LOAD_REASONS, 0)  # counters for /metrics
        self.evictions = 0
        self.swaps = 0  # loads that had to evict another model first
        self.load_durations = LoadDurations()
        self.transport: Transport | None = None
        self.cluster: RayCluster | None = None  # replicas on Ray nodes (placement = "ray"), once one loads
        self.log_dir = Path(config.server.state_dir or default_state_dir()) / "logs"
        self.shutting_down = False
        self._drain: asyncio.Future | None = None  # the one drain of a graceful stop
        self._closed = False
        self._tasks: set[asyncio.Task] = set()

    # -- process-wide lifecycle ----------------------------------------------------------
    async def start(self) -> None:
        # replica logs, and the request log with any bodies it keeps: for this user only
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for path in (self.log_dir.parent, self.log_dir):
            os.chmod(path, 0o700)
        swept = sweep_stale_workers()
        if swept:
            log.warning("swept %d stale worker(s) of a dead supervisor", len(swept))
        for path in sweep_stale_socket_dirs():
            log.warning("removed %s, the socket directory of a dead supervisor", path)
        self.transport = Transport()
        self.transport.start()
        self._spawn(self._heartbeat_loop())
        for entry in self.models.values():
            if entry.cfg.load_on_start:
                self._spawn(self._load_quietly(entry.cfg.name, "start"))

    async def drain_all(self, grace_s: float) -> None:
        """First step of a graceful stop: /ready turns 503, new and queued
        requests get 503, submitted ones get up to `grace_s` to finish (or until
        `stop_draining`). Called again, it waits for the same drain: the grace
        is spent once."""
        self.shutting_down = True
        if self._drain is None:
            executors = [e.executor for e in self.models.values() if e.executor]
            for ex in executors:
                for r in ex.replicas:
                    r.drain()  # a crash now is final: no restart while the pool stops
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
            replicas = [r for e in self.models.values() if e.executor for r in e.executor.replicas]
            await asyncio.gather(*(r.stop() for r in replicas), return_exceptions=True)
            names = [n for n, e in self.models.items() if e.executor]
            await asyncio.gather(*(self.unload(n, drain_timeout_s=0) for n in names), return_exceptions=True)
            for t in list(self._tasks):
                t.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            if self.transport:
                await self.transport.close()
            if self.cluster:
                await self.cluster.close()

    def model_state(self, entry: ModelEntry) -> ModelState:
        """The model's state as ops should see it: `loaded` only while some replica
        lives (runs, starts, or will restart); with every one fatal or stopped it
        serves nothing, and shows `failed`."""
        if entry.state is ModelState.LOADED and entry.executor and not any(
                r.live for r in entry.executor.replicas):
            return ModelState.FAILED
        return entry.state

    def ready(self) -> bool:
        return not self.shutting_down and all(
            self.model_state(e) is ModelState.LOADED for e in self.models.values() if e.cfg.load_on_start)

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("engine task %s failed", task.get_name(), exc_info=task.exception())

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.server.heartbeat_s)
            try:
                self.tick(time.monotonic())
            except Exception:  # one bad tick must not end the heartbeats
                log.exception("heartbeat tick failed")

    def tick(self, now: float) -> None:
        """Every heartbeat period: ping (and liveness-check) every worker, then
        reconcile each executor: re-derive what a missed event should have caused."""
        for entry in list(self.models.values()):
            if entry.executor:
                for r in entry.executor.replicas:
                    r.heartbeat(now)
                entry.executor.reconcile()
                if not entry.idle:
                    entry.used(now)
                if entry.state is ModelState.LOADED and now - entry.measured_at >= MEASURE_EVERY_S:
                    entry.measured_at = now
                    self._measure(entry)
            idle_s = self.idle_unload_in(entry, now)
            if idle_s is not None and idle_s <= 0:
                self._auto_unload(entry, f"idle for {self._idle_unload_s(entry):g}s")

    def _idle_unload_s(self, entry: ModelEntry) -> float | None:
        return entry.cfg.idle_unload_s or self.config.server.idle_unload_s

    def idle_unload_in(self, entry: ModelEntry, now: float) -> float | None:
        """Seconds until an idle unload; None when none is coming (not loaded, busy, pinned, never)."""
        idle_s = self._idle_unload_s(entry)
        if (idle_s is None or entry.cfg.pinned or entry.state is not ModelState.LOADED or not entry.idle
                or self.shutting_down or not entry.executor.accepting_new_requests or entry.busy.locked()):
            return None
        return max(0.0, entry.last_used + idle_s - now)

    def _auto_unload(self, entry: ModelEntry, reason: str, spawn: bool = True) -> None:
        """Unload with the usual drain; intake stops now, so no request slips in
        between. Requests that come meanwhile (and any still queued) wait for the
        next load on demand, which starts when the unload ends."""
        log.info("model %s: unloading (%s)", entry.cfg.name, reason)
        executor = entry.executor
        executor.accepting_new_requests = False
        if entry.cfg.load_on_demand:
            entry.pending = executor.take_queued()
        if spawn:
            self._spawn(self.unload(entry.cfg.name))

    def _after_auto_unload(self, entry: ModelEntry) -> None:
        """Requests that waited through an automatic unload start the next load."""
        waiting = [j for j in entry.pending or [] if j.state is JobState.QUEUED]
        entry.pending = None
        if not waiting:
            return
        if self.shutting_down or entry.removed:
            error = PoolError(ErrorCode.MODEL_UNLOADING, f"model {entry.cfg.name!r} was unloaded "
                              f"({'shutdown' if self.shutting_down else 'removed from the config'})")
            for job in waiting:
                job.finish(error)
            return
        log.info("model %s: %d requests waited through its unload; loading it again", entry.cfg.name, len(waiting))
        self._load_on_demand(entry).adopt(waiting)

    # -- load / unload ----------------------------------------------------------------------
    def entry(self, name: str, removed_too: bool = False) -> ModelEntry:
        entry = self.models.get(name) or self.models.get(self.aliases.get(name, ""))
        if entry is None or (entry.removed and not removed_too):
            raise PoolError(ErrorCode.MODEL_NOT_FOUND, f"model {name!r} does not exist", param="model")
        return entry

    async def _load_quietly(self, name: str, reason: str) -> None:
        try:
            await self.load(name, reason)
        except PoolError as exc:
            log.error("load of %s failed: %s", name, exc.message)

    def _prepare_load(self, entry: ModelEntry) -> Executor:
        """LOADING, with an executor that queues jobs until its replicas are ready
        (no await: a request that sees `loading` always finds a queue)."""
        entry.set_state(ModelState.LOADING)
        entry.error = None
        entry.load_started = time.monotonic()
        executor = Executor(entry.cfg, self.tenants)
        if entry.cfg.remote and self.cluster is None:
            self.cluster = RayCluster(self.config.server, self.transport)
        launcher = self.cluster.launcher(entry.cfg) if entry.cfg.remote else spawn_worker
        executor.replicas = [Replica(entry.cfg, self.config.server, i, self.transport, self.log_dir, executor,
                                     launcher=launcher) for i in range(entry.cfg.replicas)]
        executor.loading = True
        executor.start()
        entry.executor = executor
        return executor

    async def load(self, name: str, reason: str = "operator") -> ModelEntry:
        """Load a model; waits for a load, unload or restart of it under way first."""
        entry = self.entry(name)
        async with entry.busy:
            if entry.state is ModelState.LOADED:
                return entry
            if self.shutting_down:
                raise PoolError(ErrorCode.MODEL_UNLOADING, "the pool is shutting down")
            if entry.state is not ModelState.LOADING:  # else a request prepared it (load on demand)
                self._prepare_load(entry)
            await self._run_load(entry, reason)
            return entry

    def _load_on_demand(self, entry: ModelEntry) -> Executor:
        executor = self._prepare_load(entry)
        log.info("model %s: loading (on demand: a request for it)", entry.cfg.name)

        async def run() -> None:
            async with entry.busy:
                if entry.executor is executor and entry.state is ModelState.LOADING:
                    try:
                        await self._run_load(entry, "on_demand")
                    except PoolError as exc:
                        log.error("load of %s on demand failed: %s", entry.cfg.name, exc.message)
        self._spawn(run())
        return executor

    async def _run_load(self, entry: ModelEntry, reason: str) -> None:  # holds entry.busy, state LOADING
        name, executor = entry.cfg.name, entry.executor
        try:
            await self._make_room(entry, waiters_only=reason == "on_demand")
        except PoolError as exc:
            self._fail_waiters(executor, exc)
            await executor.close()
            entry.executor = None
            entry.error = exc.message
            entry.set_state(ModelState.UNLOADING)
            entry.set_state(ModelState.UNLOADED)
            raise
        try:
            if entry.cfg.remote:
                await self.cluster.connect()
        except OSError as exc:
            errors = [str(exc)]
        else:
            results = await asyncio.gather(*(r.start() for r in executor.replicas), return_exceptions=True)
            errors = [f"{r.name}: {res}" for r, res in zip(executor.replicas, results)
                      if isinstance(res, BaseException)]
        if errors:
            entry.error = "; ".join(errors)
            error = PoolError(ErrorCode.LOAD_FAILED, f"model {name!r} failed to load: {entry.error}")
            self._fail_waiters(executor, error)
            await asyncio.gather(*(r.stop() for r in executor.replicas), return_exceptions=True)
            await executor.close()
            entry.executor = None
            entry.holds_memory = False
            entry.set_state(ModelState.FAILED)
            raise error
        executor.loading = False
        entry.load_seconds = time.monotonic() - entry.load_started
        entry.set_state(ModelState.LOADED)
        entry.used()
        self.loads[reason] = self.loads.get(reason, 0) + 1
        self.load_durations.observe(entry.load_seconds)
        self._measure(entry)
        log.info("model %s loaded in %.2fs (%s)", name, entry.load_seconds, reason)

    @staticmethod
    def _fail_waiters(executor: Executor, error: PoolError) -> None:
        executor.accepting_new_requests = False
        executor.fail_queued(error)

    # -- memory budget -------------------------------------------------------------------------
    def footprint(self, entry: ModelEntry) -> tuple[float | None, str | None]:
        """The model's memory in MB and where the figure comes from."""
        if entry.cfg.memory_mb is not None:
            return entry.cfg.memory_mb, "declared"
        if entry.measured_mb is not None:
            return entry.measured_mb, "measured"
        estimate = estimate_mb(entry.cfg)
        return (estimate, "estimated") if estimate is not None else (None, None)

    def _measure(self, entry: ModelEntry) -> None:
        """Process-tree RSS of every replica (the worker and its runtime)."""
        total, seen = 0, False
        for r in entry.executor.replicas if entry.executor else []:
            if r.pid is None:
                continue
            if r.cfg.remote:  # on its node, as its actor saw it last
                view = r.proc.view
                if view.get("rss_bytes") is not None:
                    total += view["rss_bytes"] + sum(c["rss_bytes"] for c in view["children"])
                    seen = True
                continue
            try:
                proc = psutil.Process(r.pid)
                total += proc.memory_info().rss + sum(c.memory_info().rss for c in proc.children(recursive=True))
                seen = True
            except psutil.Error:
                pass
        if seen:
            entry.measured_mb = total / 2**20
        if self.config.server.gpu_memory_budget_mb is not None and entry.cfg.replica_devices and entry.executor:
            gpu = gpu_memory_by_pid()
            if gpu is not None:
                per_device: dict[str, float] = {}
                for r in entry.executor.replicas:
                    try:
                        proc = psutil.Process(r.pid) if r.pid else None
                        tree = [proc, *proc.children(recursive=True)] if proc else []
                    except psutil.Error:
                        tree = []
                    used = sum(gpu.get(p.pid, 0) for p in tree) / 2**20
                    devices = entry.cfg.replica_devices[r.index].split(",")
                    for d in devices:
                        per_device[d] = per_device.get(d, 0) + used / len(devices)
                entry.measured_gpu_mb = per_device

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
        if self.config.server.gpu_memory_budget_mb is not None:
            usage.update({f"GPU {d}": mb for d, mb in self.gpu_footprint(entry).items()})
        return usage

    def memory_in_use(self, but: ModelEntry | None = None, budget: str = "host") -> float:
        return sum(self._usage(e).get(budget, 0) for e in self.models.values() if e.holds_memory and e is not but)

    def _short(self, entry: ModelEntry) -> list[str]:
        """The budgets this model does not fit in now."""
        limits = {"host": self.config.server.memory_budget_mb}
        short = []
        for key, need in self._usage(entry).items():
            limit = limits.get(key, self.config.server.gpu_memory_budget_mb if key != "host" else None)
            if limit is not None and need > 0 and self.memory_in_use(entry, key) + need > limit:
                short.append(key)
        return short

    def _evictable(self, entry: ModelEntry, short: list[str]) -> list[ModelEntry]:
        """Idle loaded models that may go, least recently used first: never one with
        queued or running work, a pinned one, or one loading or being acted on; only
        ones that free some of a budget this model is short of."""
        return sorted((e for e in self._candidates(entry, short) if e.idle), key=lambda e: e.last_used)

    def _yieldable(self, entry: ModelEntry, short: list[str]) -> list[ModelEntry]:
        """Busy loaded models that may make way for a load that waited max_swap_wait_s,
        least work first: never a pinned one, or one loading or being acted on. Their
        running jobs finish (never cut); their queued ones wait for their next load."""
        return sorted(self._candidates(entry, short),
                      key=lambda e: (e.executor.queue_depth + e.executor.runtime_inflight, e.last_used))

    def _candidates(self, entry: ModelEntry, short: list[str]) -> list[ModelEntry]:
        return [e for e in self.models.values()
                if e is not entry and e.holds_memory and e.state is ModelState.LOADED and not e.cfg.pinned
                and not e.busy.locked() and e.executor.accepting_new_requests
                and any(self._usage(e).get(key, 0) > 0 for key in short)]

    def _fit_text(self, entry: ModelEntry, short: list[str]) -> str:
        """For each budget it is short of: what it needs, the budget, and what holds it."""
        usage = self._usage(entry)
        parts = []
        for key in short:
            limit = self.config.server.memory_budget_mb if key == "host" else self.config.server.gpu_memory_budget_mb
            name = "memory_budget_mb" if key == "host" else f"gpu_memory_budget_mb ({key})"
            held = ", ".join(f"{e.cfg.name} ({self._usage(e).get(key, 0):g} MB)" for e in self.models.values()
                             if e.holds_memory and e is not entry and self._usage(e).get(key, 0) > 0) or "nothing"
            parts.append(f"it needs {usage[key]:g} MB of {name} {limit:g}, in use by {held}")
        return "; ".join(parts)

    async def _make_room(self, entry: ModelEntry, waiters_only: bool) -> None:
        """Pass the memory gate: evict idle models (LRU) until this one fits, or
        wait (up to the queue timeout) for one to become evictable. A load on
        demand gives up as soon as no request waits for it any more."""
        wait_s = entry.cfg.queue_timeout_s or entry.cfg.request_timeout_s
        started = time.monotonic()
        deadline = started + wait_s
        max_swap_wait_s = self.config.server.max_swap_wait_s
        evicted = False
        while short := self._short(entry):
            victims = self._evictable(entry, short)
            if not victims and max_swap_wait_s is not None and time.monotonic() - started >= max_swap_wait_s:
                victims = self._yieldable(entry, short)  # waited long enough: a busy model makes way
            if victims:
                victim = victims[0]
                self.evictions += 1
                evicted = True
                self._auto_unload(victim, f"evicted to make room for {entry.cfg.name} in {self._fit_text(entry, short)}",
                                  spawn=False)
                await self.unload(victim.cfg.name)
                continue
            error = PoolError(ErrorCode.INSUFFICIENT_MEMORY, f"model {entry.cfg.name!r} does not fit: "
                              f"{self._fit_text(entry, short)}; nothing loaded there can be unloaded now",
                              retry_after_s=1)
            executor = entry.executor
            executor.mark_queued(error)  # a waiter that times out says why it waited
            if time.monotonic() >= deadline or self.shutting_down or (waiters_only and not executor.queue):
                raise error
            await asyncio.sleep(min(self.config.server.heartbeat_s, 0.25))
        entry.executor.mark_queued(None)
        if evicted:
            self.swaps += 1
        entry.holds_memory = True

    async def unload(self, name: str, drain_timeout_s: float | None = None) -> ModelEntry:
        """Drain and stop a model; waits for a load or restart of it under way first."""
        entry = self.entry(name, removed_too=True)
        if entry.executor is not None:
            # Stop intake before taking the lock, so requests arriving meanwhile get 503.
            entry.executor.accepting_new_requests = False
        async with entry.busy:
            executor = entry.executor
            if executor is None:  # not loaded, its load failed, or another unload won
                if entry.state is ModelState.FAILED:
                    entry.set_state(ModelState.UNLOADING)
                    entry.set_state(ModelState.UNLOADED)
                return entry
            entry.set_state(ModelState.UNLOADING)
            for r in executor.replicas:
                r.drain()
            await executor.drain(drain_timeout_s if drain_timeout_s is not None
                                 else entry.cfg.request_timeout_s)
            await asyncio.gather(*(r.stop() for r in executor.replicas), return_exceptions=True)
            await executor.close()
            entry.executor = None
            entry.holds_memory = False
            entry.set_state(ModelState.UNLOADED)
            log.info("model %s unloaded", name)
            self._after_auto_unload(entry)
            return entry

    async def restart(self, name: str, replica: int | None = None) -> ModelEntry:
        """Restart a model's replicas (one, or all), or load it when it is not
        loaded. Refused (409) while a load, unload or restart of it is under way:
        it would cut draining jobs or fight the other action."""
        entry = self.entry(name)
        # the lock, and the states an automatic load or unload sets a loop turn before taking it
        if entry.busy.locked() or entry.state in (ModelState.LOADING, ModelState.UNLOADING) \
                or entry.pending is not None:
            doing = {ModelState.LOADING: "loading", ModelState.UNLOADING: "unloading"}.get(
                entry.state, "being restarted")
            raise PoolError(ErrorCode.MODEL_BUSY, f"model {name!r} is {doing}; restart refused "
                            f"(try again when that is done)", param="model")
        if self.shutting_down:
            raise PoolError(ErrorCode.MODEL_UNLOADING, "the pool is shutting down")
        if entry.executor is None:
            return await self.load(name, "operator")
        async with entry.busy:  # free (checked above, no await since): taken at once
            executor = entry.executor
            targets = executor.replicas if replica is None else [
                r for r in executor.replicas if r.index == replica]
            if not targets:
                raise PoolError(ErrorCode.INVALID_REQUEST, f"model {name!r} has no replica {replica}")
            results = await asyncio.gather(*(r.restart() for r in targets), return_exceptions=True)
        failed = [f"{r.name}: {res}" for r, res in zip(targets, results) if isinstance(res, BaseException)]
        if failed:
            raise PoolError(ErrorCode.LOAD_FAILED, "; ".join(failed))
        return entry

    # -- jobs -------------------------------------------------------------------------------------
    def submit(self, model: str, request: dict, endpoint: str = "chat", tenant: str = DEFAULT_TENANT) -> Job:
        entry = self.entry(model)
        if self.shutting_down:
            raise PoolError(ErrorCode.MODEL_UNLOADING, "the pool is shutting down")
        executor = entry.executor
        if entry.pending is not None:  # an automatic unload: wait for the next load on demand
            check_prompt_bounds(entry.cfg, request)
            entry.pending = [j for j in entry.pending if j.state is JobState.QUEUED]  # gone ones hold no place
            if len(entry.pending) >= entry.cfg.max_queue:
                raise PoolError(ErrorCode.QUEUE_FULL, f"model {entry.cfg.name!r} has {len(entry.pending)} "
                                f"requests waiting for its next load (max_queue)", retry_after_s=1)
            job = self._job(entry, request, endpoint, tenant)
            entry.pending.append(job)
            return job
        if entry.state is ModelState.UNLOADING or (executor and not executor.accepting_new_requests):
            raise PoolError(ErrorCode.MODEL_UNLOADING, f"model {entry.cfg.name!r} is unloading", param="model",
                            retry_after_s=1)
        if executor is None:  # unloaded, or its last load failed
            if not entry.cfg.load_on_demand:
                raise PoolError(ErrorCode.MODEL_NOT_LOADED,
                                f"model {entry.cfg.name!r} is {entry.state.value}; load it first", param="model")
            check_prompt_bounds(entry.cfg, request)
            job = self._job(entry, request, endpoint, tenant)  # a request that cannot travel starts no load
            self._load_on_demand(entry).enqueue(job)
            return job
        check_prompt_bounds(entry.cfg, request)
        job = self._job(entry, request, endpoint, tenant)
        executor.enqueue(job)  # while loading, it waits in the queue for the replicas
        return job

    def _job(self, entry: ModelEntry, request: dict, endpoint: str, tenant: str) -> Job:
        job = Job(entry.cfg.name, request, entry.cfg.request_timeout_s, entry.cfg.queue_timeout_s, endpoint, tenant)
        if entry.cfg.log_bodies:
            job.transcript = []
        entry.used()
        return job

    def cancel(self, job: Job) -> None:
        entry = self.models.get(job.model)
        if entry and entry.executor:
            entry.executor.cancel(job)
        elif job.replica:
            job.replica.cancel(job)

    # -- config reload ----------------------------------------------------------------------------
    async def reload(self) -> dict:
        """Re-read the config file and apply the difference. A bad file is refused
        whole (400, serve's message) and nothing changes. Unchanged models keep their
        workers, queues and running jobs; lifecycle keys (aliases, pinned, ...)
        change in place; other changes reload the model with a drain."""
        if self.config.source is None:
            raise PoolError(ErrorCode.INVALID_REQUEST, "this pool was not started from a config file")
        try:
            new = load_config(self.config.source)
        except ConfigError as exc:
            raise PoolError(ErrorCode.INVALID_REQUEST, f"config error: {exc}") from None
        if self.shutting_down:
            raise PoolError(ErrorCode.MODEL_UNLOADING, "the pool is shutting down")
        bound = {k for k, v in new.server.model_dump().items()
                 if k not in SERVER_KEYS_APPLIED_ON_RELOAD and v != getattr(self.config.server, k)}
        if bound:  # keys, limits, timings: fixed at start; refusing beats reporting a change that did not happen
            raise PoolError(ErrorCode.INVALID_REQUEST, f"[server] {', '.join(sorted(bound))} take effect only "
                            f"when the pool restarts; reload refused, nothing changed")
        try:
            self.tenants.apply(new)  # weights, scopes, limits and keys; no worker is touched
        except ConfigError as exc:
            raise PoolError(ErrorCode.INVALID_REQUEST, f"config error: {exc}") from None
        old_models = {m.name: m for m in self.config.models}
        new_models = {m.name: m for m in new.models}
        added = [n for n in new_models if n not in old_models]
        removed = [n for n in old_models if n not in new_models]
        changed, kept = [], []
        for name in new_models.keys() & old_models.keys():
            same = new_models[name].model_dump(exclude=IN_PLACE_KEYS) == old_models[name].model_dump(
                exclude=IN_PLACE_KEYS)
            (kept if same else changed).append(name)
            if same:
                self.models[name].cfg = new_models[name]  # the executor's copy differs in nothing it reads
        self.config = new
        self.aliases = {a: m.name for m in new.models for a in m.aliases}
        for name in added:
            self.models[name] = ModelEntry(new_models[name], busy=asyncio.Lock())
        log.info("config reloaded: added %s, removed %s, reloaded %s, kept %s", added, removed, changed, kept)
        for name in removed:
            self.models[name].removed = True  # 404 from now on; a new request cannot load it
            self._spawn(self._retire(name))
        for name in changed:
            self._spawn(self._reload_model(name, new_models[name]))
        for name in added:
            if new_models[name].load_on_start:
                self._spawn(self._load_quietly(name, "reload"))
        return {"added": sorted(added), "removed": sorted(removed), "reloaded": sorted(changed),
                "kept": sorted(kept)}

    async def _retire(self, name: str) -> None:
        """A model gone from the config: drain, unload, forget."""
        entry = self.models[name]
        log.info("model %s: unloading (removed from the config)", name)
        await self.unload(name)
        if self.models.get(name) is entry:
            del self.models[name]

    async def _reload_model(self, name: str, cfg: ModelConfig) -> None:
        """A changed model: drain and unload it with its old config, then load the new one
        if it was loaded (or loads on start)."""
        entry = self.models[name]
        was_loaded = entry.executor is not None
        log.info("model %s: reloading (its config changed)", name)
        await self.unload(name)
        async with entry.busy:
            entry.cfg = cfg
            entry.measured_mb = None
            if entry.state is ModelState.FAILED:
                entry.set_state(ModelState.UNLOADING)
                entry.set_state(ModelState.UNLOADED)
        if was_loaded or cfg.load_on_start:
            await self._load_quietly(name, "reload")

    # -- views --------------------------------------------------------------------------------------
    def model_list(self) -> list[dict]:
        """/v1/models: every configured model and alias, with its state."""
        out = []
        for name, entry in self.models.items():
            if entry.removed:
                continue
            state = self.model_state(entry).value
            for id_ in (name, *entry.cfg.aliases):
                out.append({"id": id_, "object": "model", "created": 0, "owned_by": "llm-pool", "state": state,
                            **({"alias_of": name} if id_ != name else {})})
        return out

    def model_view(self, entry: ModelEntry) -> dict:
        ex = entry.executor
        memory, source = self.footprint(entry)
        return {
            "name": entry.cfg.name,
            "backend": entry.cfg.backend,
            "state": self.model_state(entry).value,
            "replicas": entry.cfg.replicas,
            "replicas_ready": sum(r.state is ReplicaState.READY for r in ex.replicas) if ex else 0,
            "queue_depth": (ex.queue_depth if ex else 0) + len(entry.pending or ()),
            "runtime_inflight": ex.runtime_inflight if ex else 0,
            "configured_target_inflight": entry.cfg.target_inflight * entry.cfg.replicas,
            "effective_target_inflight": ex.effective_target_inflight if ex else 0,
            "accepting_new_requests": bool(ex and ex.accepting_new_requests),
            "max_queue": entry.cfg.max_queue,
            "load_seconds": entry.load_seconds,
            "error": entry.error or self._replica_errors(entry),
            "load_on_demand": entry.cfg.load_on_demand,
            "pinned": entry.cfg.pinned,
            "aliases": list(entry.cfg.aliases),
            "last_used_at": entry.last_used_at,
            "idle_unload_in_s": _round(self.idle_unload_in(entry, time.monotonic())),
            "memory_mb": _round(memory),
            "memory_source": source,
            "gpu_memory_mb": {d: _round(mb) for d, mb in self.gpu_footprint(entry).items()} or None,
        }

    def _replica_errors(self, entry: ModelEntry) -> str | None:
        if self.model_state(entry) is not ModelState.FAILED or entry.executor is None:
            return None
        return "no replica is running: " + "; ".join(
            f"{r.name} {r.state.value}: {r.last_error or 'no error recorded'}" for r in entry.executor.replicas)


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


def estimate_mb(cfg: ModelConfig) -> float | None:
    """Before the first load: the model file plus its context (llama_server); else unknown."""
    if cfg.backend != "llama_server":
        return None
    try:
        size = Path(cfg.options["model"]).expanduser().stat().st_size
    except (KeyError, OSError):
        return None
    ctx = cfg.options.get("ctx_size") or 2048 * cfg.target_inflight
    return cfg.replicas * (size / 2**20 + ctx * KV_MB_PER_TOKEN)
