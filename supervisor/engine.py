"""ModelRouterEngine: the registry of public models, their states, load and
unload, and the entry point for jobs. It owns the transport, one executor per
loaded model, and the heartbeat loop over all replicas."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

from protocol.errors import ErrorCode, PoolError
from supervisor.config import ModelConfig, PoolConfig
from supervisor.jobs import Job
from supervisor.process import sweep_stale_workers
from supervisor.replica import Replica
from supervisor.scheduler import Executor
from supervisor.states import MODEL_TRANSITIONS, ModelState, ReplicaState, transition
from supervisor.transport import Transport, sweep_stale_socket_dirs

log = logging.getLogger("llm_pool.engine")


def default_state_dir() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "llm-pool"


@dataclass
class ModelEntry:
    cfg: ModelConfig
    state: ModelState = ModelState.UNLOADED
    executor: Executor | None = None
    error: str | None = None
    load_started: float | None = None
    load_seconds: float | None = None
    busy: asyncio.Lock | None = None  # one load/unload/restart at a time

    def set_state(self, new: ModelState) -> None:
        self.state = transition(MODEL_TRANSITIONS, self.state, new)


def _chars(value) -> int:
    """Characters of text in a prompt value: a string, or a list of strings,
    of token ids or of token-id lists (a token counts as one)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, list):
        return sum(len(v) if isinstance(v, (str, list)) else 1 for v in value)
    return 0


def check_prompt_bounds(cfg: ModelConfig, request: dict) -> None:
    """400 for a prompt over the model's max_messages or max_prompt_chars (chat
    messages, or a legacy completion's prompt)."""
    messages = request.get("messages") or []
    if len(messages) > cfg.max_messages:
        raise PoolError(ErrorCode.INVALID_REQUEST, f"{len(messages)} messages, over model {cfg.name!r}'s "
                        f"max_messages ({cfg.max_messages})", param="messages")
    chars = _text_chars(request.get("prompt"))
    for m in messages:
        if isinstance(m, dict):
            chars += _text_chars(m.get("content"))
    if chars > cfg.max_prompt_chars:
        raise PoolError(ErrorCode.INVALID_REQUEST, f"the prompt has {chars} characters, over model "
                        f"{cfg.name!r}'s max_prompt_chars ({cfg.max_prompt_chars})",
                        param="messages" if messages else "prompt")


def _text_chars(content) -> int:
    """Characters of text in a message's content or a prompt: a string, or a list
    of strings or of content parts."""
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(len(part) if isinstance(part, str) else len(part.get("text") or "")
                   for part in content if isinstance(part, (str, dict)))
    return 0


class ModelRouterEngine:
    def __init__(self, config: PoolConfig) -> None:
        self.config = config
        self.models = {m.name: ModelEntry(m, busy=asyncio.Lock()) for m in config.models}
        self.transport: Transport | None = None
        self.log_dir = Path(config.server.state_dir or default_state_dir()) / "logs"
        self.shutting_down = False
        self._drain: asyncio.Future | None = None  # the one drain of a graceful stop
        self._closed = False
        self._tasks: set[asyncio.Task] = set()

    # -- process-wide lifecycle ----------------------------------------------------------
    async def start(self) -> None:
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
                self._spawn(self._load_quietly(entry.cfg.name))

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
        for entry in self.models.values():
            if entry.executor:
                for r in entry.executor.replicas:
                    r.heartbeat(now)
                entry.executor.reconcile()

    # -- load / unload ----------------------------------------------------------------------
    def entry(self, name: str) -> ModelEntry:
        entry = self.models.get(name)
        if entry is None:
            raise PoolError(ErrorCode.MODEL_NOT_FOUND, f"model {name!r} does not exist", param="model")
        return entry

    async def _load_quietly(self, name: str) -> None:
        try:
            await self.load(name)
        except PoolError as exc:
            log.error("load of %s failed: %s", name, exc.message)

    async def load(self, name: str) -> ModelEntry:
        """Load a model; waits for a load, unload or restart of it under way first."""
        entry = self.entry(name)
        async with entry.busy:
            if entry.state is ModelState.LOADED:
                return entry
            if self.shutting_down:
                raise PoolError(ErrorCode.MODEL_UNLOADING, "the pool is shutting down")
            entry.set_state(ModelState.LOADING)
            entry.error = None
            entry.load_started = time.monotonic()
            executor = Executor(entry.cfg)
            executor.replicas = [Replica(entry.cfg, self.config.server, i, self.transport, self.log_dir,
                                         executor)
                                 for i in range(entry.cfg.replicas)]
            entry.executor = executor
            results = await asyncio.gather(*(r.start() for r in executor.replicas), return_exceptions=True)
            errors = [f"{r.name}: {res}" for r, res in zip(executor.replicas, results)
                      if isinstance(res, BaseException)]
            if errors:
                await asyncio.gather(*(r.stop() for r in executor.replicas), return_exceptions=True)
                entry.executor = None
                entry.error = "; ".join(errors)
                entry.set_state(ModelState.FAILED)
                raise PoolError(ErrorCode.LOAD_FAILED, f"model {name!r} failed to load: {entry.error}")
            executor.start()
            entry.load_seconds = time.monotonic() - entry.load_started
            entry.set_state(ModelState.LOADED)
            log.info("model %s loaded in %.2fs", name, entry.load_seconds)
            return entry

    async def unload(self, name: str, drain_timeout_s: float | None = None) -> ModelEntry:
        """Drain and stop a model; waits for a load or restart of it under way first."""
        entry = self.entry(name)
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
            entry.set_state(ModelState.UNLOADED)
            return entry

    async def restart(self, name: str, replica: int | None = None) -> ModelEntry:
        """Restart a model's replicas (one, or all), or load it when it is not
        loaded. Refused (409) while a load, unload or restart of it is under way:
        it would cut draining jobs or fight the other action."""
        entry = self.entry(name)
        if entry.busy.locked():
            doing = {ModelState.LOADING: "loading", ModelState.UNLOADING: "unloading"}.get(
                entry.state, "being restarted")
            raise PoolError(ErrorCode.MODEL_BUSY, f"model {name!r} is {doing}; restart refused "
                            f"(try again when that is done)", param="model")
        if self.shutting_down:
            raise PoolError(ErrorCode.MODEL_UNLOADING, "the pool is shutting down")
        if entry.executor is None:
            return await self.load(name)
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
    def submit(self, model: str, request: dict, endpoint: str = "chat") -> Job:
        entry = self.entry(model)
        if self.shutting_down:
            raise PoolError(ErrorCode.MODEL_UNLOADING, "the pool is shutting down")
        executor = entry.executor
        if entry.state is ModelState.LOADING:  # (issue 14 makes it wait in the queue instead)
            raise PoolError(ErrorCode.MODEL_LOADING, f"model {model!r} is loading; retry when it is loaded",
                            param="model", retry_after_s=1)
        if entry.state is ModelState.UNLOADING or (executor and not executor.accepting_new_requests):
            raise PoolError(ErrorCode.MODEL_UNLOADING, f"model {model!r} is unloading", param="model")
        if entry.state is not ModelState.LOADED or executor is None:
            raise PoolError(ErrorCode.MODEL_NOT_LOADED,
                            f"model {model!r} is {entry.state.value}; load it first", param="model")
        check_prompt_bounds(entry.cfg, request)
        job = Job(model, request, entry.cfg.request_timeout_s, entry.cfg.queue_timeout_s, endpoint)
        if entry.cfg.log_bodies:
            job.transcript = []
        executor.enqueue(job)
        return job

    def cancel(self, job: Job) -> None:
        entry = self.models.get(job.model)
        if entry and entry.executor:
            entry.executor.cancel(job)
        elif job.replica:
            job.replica.cancel(job)

    # -- views --------------------------------------------------------------------------------------
    def model_view(self, entry: ModelEntry) -> dict:
        ex = entry.executor
        return {
            "name": entry.cfg.name,
            "backend": entry.cfg.backend,
            "state": self.model_state(entry).value,
            "replicas": entry.cfg.replicas,
            "replicas_ready": sum(r.state is ReplicaState.READY for r in ex.replicas) if ex else 0,
            "queue_depth": ex.queue_depth if ex else 0,
            "runtime_inflight": ex.runtime_inflight if ex else 0,
            "configured_target_inflight": entry.cfg.target_inflight * entry.cfg.replicas,
            "effective_target_inflight": ex.effective_target_inflight if ex else 0,
            "accepting_new_requests": bool(ex and ex.accepting_new_requests),
            "max_queue": entry.cfg.max_queue,
            "load_seconds": entry.load_seconds,
            "error": entry.error or self._replica_errors(entry),
        }

    def _replica_errors(self, entry: ModelEntry) -> str | None:
        if self.model_state(entry) is not ModelState.FAILED or entry.executor is None:
            return None
        return "no replica is running: " + "; ".join(
            f"{r.name} {r.state.value}: {r.last_error or 'no error recorded'}" for r in entry.executor.replicas)
