"""One replica: the supervisor-side handle of one runtime worker subprocess.

Owns that worker's lifecycle (spawn, ready, heartbeats, stop, restart after a
crash) and its state; its `link` (worker_link.WorkerLink) owns the conversation
with the worker and the in-flight table. Scheduling decisions are the executor's."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import protocol as p
from protocol.errors import ErrorCode, PoolError, exit_text
from protocol.redact import mask_values
from supervisor.config import ModelConfig, ServerConfig
from supervisor.events import EventKind, emit
from supervisor.replicas import exits
from supervisor.replicas.process import Launcher, WorkerProcess, spawn_worker, replica_env, worker_args, worker_setup
from supervisor.replicas.restart_policy import CrashHistory, PendingRestart, RestartPolicy, restart_delay
from supervisor.states import REPLICA_READY, REPLICA_TRANSITIONS, ReplicaState, transition
from supervisor.tasks import spawn
from supervisor.replicas.transport import Transport
from supervisor.replicas.worker_link import LoadFailed, WorkerLink

if TYPE_CHECKING:  # a replica runs the jobs the scheduler hands it (scheduling/ is above replicas/)
    from supervisor.scheduling.jobs import Job

log = logging.getLogger("llm_pool.replica")

TREE_REFRESH_S = 5.0  # how often a heartbeat re-reads a worker's process tree (also at Ready and kills)


_IDENTITY_SERIAL = itertools.count(1)


class ReplicaOwner(Protocol):
    """What a replica tells its executor."""

    def replica_changed(self) -> None: ...  # its state changed (or a job could not be handed to it)
    def requeue(self, job: Job) -> None: ...  # run this job again, ahead of the queue
    def job_finished(self, replica: Replica, job: Job) -> None: ...  # it ended there (any outcome): a slot freed
    def replica_restarted(self, replica: Replica) -> None: ...  # a new worker starts: its cache is empty
    def replica_kv_events(self, replica: Replica, events: list, reset: bool) -> None: ...  # its engine's cache
    def wants_workers(self) -> bool: ...  # its model takes work: a worker may start (else a stop was asked)


class Replica:
    """Implements worker_link.LinkHost for its link."""

    def __init__(self, cfg: ModelConfig, server: ServerConfig, index: int, transport: Transport,
                 log_dir: Path, owner: ReplicaOwner, policy: RestartPolicy | None = None,
                 launcher: Launcher = spawn_worker, clock: Callable[[], float] = time.monotonic,
                 secret_env: frozenset[str] = frozenset(), kv_dir: Path | None = None) -> None:
        self.cfg = cfg
        self.server = server
        self.index = index
        self.name = f"{cfg.name}/{index}"
        self.transport = transport
        self.log_path = log_dir / f"{cfg.name}-{index}.log"
        # warm swaps: where its model's KV is saved across planned stops (None: not saved; a disk
        # budget of 0 keeps nothing, so nothing is saved)
        self.kv_dir = kv_dir / cfg.name if kv_dir is not None and cfg.saves_kv and server.kv_disk_budget_mb else None
        self.owner = owner
        self.policy = policy or RestartPolicy()
        self.launcher = launcher
        self.secret_env = secret_env  # the models' api_key_env: its worker sees its own model's alone
        self.clock = clock  # monotonic seconds
        self.state = ReplicaState.STOPPED
        self.identity = ""
        self.proc: WorkerProcess | None = None
        self.capacity = 0  # effective: min(configured, runtime capability)
        self.newcomer_slots = 0  # effective: at most the runtime's room above `capacity`
        self.runtime_capacity: int | None = None
        self.info: dict = {}
        # its jobs in flight, its workers' messages
        self.link = WorkerLink(self, cfg.name, transport, clock, worker_setup(cfg, server, self.kv_dir))
        self.started_at: float | None = None  # wall clock of the current process
        self.ready_at: float | None = None  # monotonic
        self.restarts = 0
        self.planned_restarts = 0  # of them, an operator's (the rest: after a crash)
        # the last exit shown: the runtime's own when its worker reported it died (SIGKILL), else
        # the worker's; the restart policy reads the worker's (a boot failure is its code 3)
        self.last_exit_code: int | None = None
        self.worker_exit_code: int | None = None
        self.runtime_exit_code: int | None = None  # of the current worker's runtime, once it died
        self.last_error: str | None = None
        # who ended the last worker and why (exits.py): "pool", "operator", "planned", "outside", "self"
        self.last_exit_by: str | None = None
        self.last_exit_why: str | None = None
        self.crashes: dict[str, int] = {}  # unplanned exits, by who ended them (apart from restarts)
        self.kill_why: str | None = None  # the pool is killing the current worker: why
        self.load_failure: tuple[bool, str] | None = None  # its load failed: (timed out, why)
        self.runtime_killed_by_worker = False  # its worker killed its runtime (a cancel not honoured)
        self.stop_by, self.stop_why = exits.BY_PLANNED, None  # who asked a planned stop of it, and why
        self.history = CrashHistory()
        # an operator's restart of this replica while it served, from its drain to its new worker's start (planned work:
        # its model is not degraded by it): the monotonic time its drain ends, a countdown shown to operators; None when
        # none is under way. Whether the restart goes on is the state's alone (RESTARTING; a stop moves it to STOPPING).
        self.operator_restart_until: float | None = None
        # One lifecycle action at a time (start, stop, operator or crash restart), so a
        # replica never has two workers and a stop never races a start.
        self._lock = asyncio.Lock()
        self._ready: asyncio.Future | None = None
        self._watcher: asyncio.Task | None = None
        self._backoff = PendingRestart()  # a crash restart backing off (BACKOFF)

    # -- state ---------------------------------------------------------------
    def _set(self, new: ReplicaState) -> None:
        self.state = transition(REPLICA_TRANSITIONS, self.state, new)
        self.owner.replica_changed()

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc and self.proc.returncode is None else None

    @property
    def live(self) -> bool:
        """Running, or about to run again (a crash restart is pending)."""
        return self.state in (ReplicaState.STARTING, ReplicaState.READY, ReplicaState.DRAINING,
                              ReplicaState.RESTARTING, ReplicaState.BACKOFF)

    @property
    def in_operator_restart(self) -> bool:
        return self.operator_restart_until is not None

    @property
    def restart_drain_left_s(self) -> float | None:
        """Seconds left of an operator restart's drain (the countdown to drain_timeout_s)."""
        if self.operator_restart_until is None or self.state is not ReplicaState.RESTARTING:
            return None
        return max(0.0, self.operator_restart_until - self.clock())

    @property
    def restart_in_s(self) -> float | None:
        """Seconds until a crash restart backing off starts (its countdown); None when none is pending."""
        if self.state is not ReplicaState.BACKOFF or not self.restart_pending:
            return None
        return max(0.0, self._backoff.due - self.clock())

    @property
    def free_slots(self) -> int:
        return self.capacity - self.link.generating if self.state is REPLICA_READY else 0

    @property
    def free_newcomer_slots(self) -> int:
        """Free slots above `capacity`, for a tenant with nothing running on the model."""
        if self.state is not REPLICA_READY or not self.newcomer_slots:
            return 0
        return min(self.newcomer_slots, self.capacity + self.newcomer_slots - self.link.generating)

    @property
    def restart_pending(self) -> bool:
        """A restart of this replica is scheduled (backing off after a crash)."""
        return self._backoff.pending

    # -- its jobs, through its link ----------------------------------------------
    @property
    def inflight(self) -> dict[str, Job]:
        """Its jobs in flight, by id: the link's table (read here, written there)."""
        return self.link.inflight

    @property
    def light_inflight(self) -> int:
        return self.link.light_inflight

    def submit(self, job: Job) -> None:
        self.link.submit(job, self)

    def cancel(self, job: Job, malformed: bool = False) -> None:
        self.link.cancel(job, malformed)

    def forget(self, job_id: str) -> Job | None:
        return self.link.forget(job_id)

    # -- what its link tells it (worker_link.LinkHost) -----------------------------
    def worker_ready(self, capacity: int, info: dict) -> None:
        self.runtime_capacity = capacity
        self.capacity = max(0, min(self.cfg.target_inflight, capacity))
        self.newcomer_slots = max(0, min(self.cfg.newcomer_slots, capacity - self.capacity))
        if self.newcomer_slots < self.cfg.newcomer_slots:
            log.warning("replica %s: %d of %d newcomer_slots (the runtime runs %d at once, target_inflight "
                        "%d)", self.name, self.newcomer_slots, self.cfg.newcomer_slots, capacity, self.capacity)
        self.info = mask_values(info)  # shown in /admin/workers: no credentials in a URL
        self.ready_at = self.clock()
        if self.proc:
            self.proc.snapshot()  # the runtime's processes exist by now
        # only the start that waits for it makes the replica ready: not one aborted, timed out or killed
        if self._ready and not self._ready.done() and self.state is ReplicaState.STARTING:
            self._ready.set_result(None)
            self._set(ReplicaState.READY)

    def runtime_failed(self, code: str, message: str, exit_code: int | None) -> None:
        self.last_error = message
        self.runtime_exit_code = exit_code  # its runtime died: that exit is the one to show
        # runtime_timeout: its worker killed it (busy after a cancel left it no job)
        self.runtime_killed_by_worker = code == ErrorCode.RUNTIME_TIMEOUT
        if self._ready and not self._ready.done():
            self._ready.set_exception(LoadFailed(message))

    def send_failed(self, job: Job) -> None:
        """A Submit could not be sent (the worker is gone or not reading): the job goes back
        to the head of the queue and this replica takes no more work until its worker is
        replaced: one unreachable worker must not fail a whole queue."""
        if job.run.cancel_requested:  # its client left meanwhile: nothing to run again
            job.finish(PoolError(ErrorCode.INVALID_REQUEST, "cancelled by the client"))
        else:
            self.owner.requeue(job)
            self.link.let_go(job)  # queued again: on no replica
        self.owner.replica_changed()  # the driver looks again: another replica may take it
        if self.state not in (ReplicaState.STARTING, ReplicaState.READY, ReplicaState.DRAINING):
            return  # already on its way out
        log.error("replica %s is unreachable (gone, or not reading its socket): restarting it", self.name)
        self._kill_worker("unreachable: its socket took no frames")  # its jobs end or run again at its exit

    def worker_corrupt(self, reason: str) -> None:
        """Which job's stream is corrupt is unknown: fail them all, restart the worker."""
        if self.proc and self.proc.returncode is None:
            self._crash_kill(ErrorCode.PROTOCOL_ERROR, f"malformed reply from the runtime: {reason}",
                             f"malformed frames from its worker ({reason})")

    def job_ended(self, job: Job) -> None:
        self.owner.job_finished(self, job)

    def kv_events(self, events: list, reset: bool) -> None:
        self.owner.replica_kv_events(self, events, reset)

    # -- lifecycle -------------------------------------------------------------
    async def start(self) -> None:
        """Spawn the worker and wait until its runtime is ready (or fails to load)."""
        async with self._lock:
            await self._start()

    async def stop(self, why: str | None = None, by: str = exits.BY_PLANNED) -> None:
        """Stop the worker now: a clean Shutdown, then SIGTERM/SIGKILL of its tree.
        Whatever start is under way (a load, a crash restart, any phase of an operator
        restart) ends without a new worker (wind_down)."""
        self.wind_down(why, by)
        await self._backoff.cancel_and_wait()
        async with self._lock:
            await self._stop()

    def wind_down(self, why: str | None = None, by: str = exits.BY_PLANNED) -> None:
        """A stop is wanted (unload, shutdown, a reload's change), in this loop turn: no worker of this replica starts
        from now on. A start under way is abandoned (its worker killed), an operator restart ends in any phase
        (STOPPING: it starts nothing after its drain or its stop), a pending crash restart is cancelled, a crash kill's
        exit becomes final; a serving worker drains (its running jobs finish, its exit is final). `why`, `by`: who asked
        the stop and why (exits.py), shown with its exit."""
        if why is not None:
            self.stop_by, self.stop_why = by, why
        if self.state is ReplicaState.READY:
            self.drain()
        elif self.state in (ReplicaState.RESTARTING, ReplicaState.KILLING):
            self._set(ReplicaState.STOPPING)
        elif self.state is ReplicaState.BACKOFF:
            self._backoff.cancel(forget=True)
            self._set(ReplicaState.STOPPED)
        self.link.end_drain()
        if self._ready and not self._ready.done():
            self._ready.set_exception(LoadFailed("stopped before it was ready"))

    async def restart(self, drain_timeout_s: float | None = None) -> None:
        """Operator restart: out of rotation, running jobs get `drain_timeout_s`
        to finish (None: cut at once), then stop whatever runs, clear fatal,
        start afresh. A replica draining for an unload is left alone."""
        if self.state is ReplicaState.DRAINING:
            raise LoadFailed(f"replica {self.name} is draining; not restarted")
        await self._backoff.cancel_and_wait()
        async with self._lock:
            if self.state is ReplicaState.DRAINING:
                raise LoadFailed(f"replica {self.name} is draining; not restarted")
            self.stop_by, self.stop_why = exits.BY_OPERATOR, "restarted by the operator"
            if self.state is ReplicaState.READY:  # a serving replica's restart is planned work; a broken one's a repair
                self.operator_restart_until = self.clock() + (drain_timeout_s or 0.0)
            try:
                await self._operator_restart(drain_timeout_s)
            finally:  # done or failed: the model's state follows its replicas again
                self.operator_restart_until = None
                self.owner.replica_changed()

    async def _operator_restart(self, drain_timeout_s: float | None) -> None:  # holds self._lock
        if self.state in (ReplicaState.STARTING, ReplicaState.READY, ReplicaState.KILLING):
            # out of rotation, its model's queue kept for it; its exit from now on is planned
            self._set(ReplicaState.RESTARTING)
        if self.state is ReplicaState.RESTARTING and drain_timeout_s and self.inflight:
            if not await self.link.drain(drain_timeout_s):
                log.warning("replica %s: %d jobs still running after drain_timeout_s=%g; cutting them",
                            self.name, len(self.inflight), drain_timeout_s)
            if self.state is not ReplicaState.RESTARTING:
                # stopped (shutdown, unload) meanwhile; a crash meanwhile leaves it RESTARTING: restarted
                raise LoadFailed(f"replica {self.name} was stopped while it drained; not restarted")
            if self.inflight:
                self.link.fail_all(ErrorCode.RUNTIME_RESTARTED, f"replica {self.name} was restarted by the "
                                   f"operator; the request did not finish within drain_timeout_s "
                                   f"({drain_timeout_s:g}s)")
                self.owner.replica_changed()
        restarting = self.state is ReplicaState.RESTARTING
        await self._stop()  # RESTARTING stays so through the old worker's exit (_watch)
        if restarting and self.state is not ReplicaState.RESTARTING:
            # a stop came while the old worker stopped (wind_down): it wins, nothing starts
            raise LoadFailed(f"replica {self.name} was stopped during its restart; not restarted")
        self.history = CrashHistory()
        self.restarts += 1
        self.planned_restarts += 1
        await self._start()

    def drain(self) -> None:
        """No new jobs (the executor stops sending them); running ones finish. From now on an exit is final."""
        if self.state is ReplicaState.READY:
            self._set(ReplicaState.DRAINING)

    async def _start(self) -> None:  # holds self._lock
        if not self.owner.wants_workers():  # an unload or shutdown was asked before this start ran
            raise LoadFailed(f"replica {self.name}: not started, its model is stopping")
        self._set(ReplicaState.STARTING)
        # unique in this process: a model removed by a reload may still drain while a new
        # one of the same name starts, and a routing id must never be shared
        self.identity = f"{self.name}#{next(_IDENTITY_SERIAL)}"
        self.owner.replica_restarted(self)
        self.capacity = 0
        self.last_error = None
        self.runtime_exit_code = None
        self.kill_why, self.runtime_killed_by_worker, self.load_failure = None, False, None
        self.stop_by, self.stop_why = exits.BY_PLANNED, None
        self._ready = ready = asyncio.get_running_loop().create_future()
        self.link.open(self.identity)
        env = replica_env(self.cfg, self.index, self.secret_env)  # at each start: a reload may add a tenant's key_env
        try:
            # a remote replica's workers dial the ROUTER's CURVE TCP endpoint (ray_placement.py)
            endpoint = self.launcher.endpoint if self.cfg.remote else self.transport.endpoint
            self.proc = await self.launcher(worker_args(self.cfg, self.server, endpoint, self.identity),
                                            self.log_path, env)
        except OSError as exc:  # nothing to wait for or restart: fatal until an operator acts
            self.link.close()
            self.proc = None
            self.last_error = f"cannot spawn the worker: {exc}"
            self._set(ReplicaState.FATAL)
            emit(EventKind.FATAL, f"replica {self.name} is fatal: {self.last_error}", model=self.cfg.name,
                 replica=self.index, level=logging.ERROR)
            raise LoadFailed(self.last_error) from None
        self.started_at = time.time()
        self.link.heard_now()
        self._watcher = spawn(self._watch(self.proc), f"watch-{self.identity}")
        try:
            await asyncio.wait_for(asyncio.shield(ready), self.cfg.load_timeout_s)
        except (TimeoutError, LoadFailed, asyncio.CancelledError) as exc:
            # failed to load, timed out, aborted by stop(), or a cancelled crash restart:
            # leave no worker behind, whatever else is cancelled meanwhile
            ready.cancel()
            self._ready = None
            if isinstance(exc, TimeoutError):
                self.last_error = f"runtime not ready within load_timeout_s={self.cfg.load_timeout_s}"
            if not isinstance(exc, asyncio.CancelledError) and self.last_error:  # its exit tells the cause
                self.load_failure = (isinstance(exc, TimeoutError), self.last_error)
            await asyncio.shield(self._kill())
            if isinstance(exc, TimeoutError):
                raise LoadFailed(self.last_error) from None
            raise
        self._ready = None

    async def _stop(self) -> None:  # holds self._lock
        self._backoff.cancel()
        if self.state is ReplicaState.STOPPED:
            return
        if self.state in (ReplicaState.BACKOFF, ReplicaState.FATAL):
            self._set(ReplicaState.STOPPED)
            return
        if self.state not in (ReplicaState.STOPPING, ReplicaState.RESTARTING):  # an operator restart's stays so
            self._set(ReplicaState.STOPPING)
        proc = self.proc
        if proc and proc.returncode is None:
            self.link.send(p.Shutdown())
            # a worker saving its KV (warm swaps) first gets kv_save_timeout_s more
            wait_s = self.cfg.stop_timeout_s + (self.server.kv_save_timeout_s if self.kv_dir else 0.0)
            try:
                await asyncio.wait_for(asyncio.shield(proc.wait()), wait_s)
            except TimeoutError:
                await proc.stop(2.0)
        if self._watcher:
            await asyncio.gather(self._watcher, return_exceptions=True)

    async def _kill(self) -> None:
        """Stop a worker that failed to start: no restart follows."""
        if self.state not in (ReplicaState.STOPPED, ReplicaState.STOPPING):  # it may have exited already
            self._set(ReplicaState.STOPPING)
        if self.proc:
            await self.proc.stop(2.0)
        if self._watcher:
            await asyncio.gather(self._watcher, return_exceptions=True)

    def _crash_kill(self, code: ErrorCode, message: str, why: str) -> None:
        """The worker is hung or corrupt: fail its jobs, take it out of rotation, kill its whole tree. Its exit then
        takes the crash path (a restart), except in an unload's drain (final) or an operator's restart (which goes on).
        `why`: the pool's reason, which its exit is reported with (not a mysterious SIGKILL)."""
        self.link.fail_all(code, message)
        self.owner.replica_changed()
        self._kill_worker(why)

    def _kill_worker(self, why: str) -> None:
        """Out of rotation (KILLING: its exit a crash; STOPPING for a draining one), then its whole
        tree killed. Its exit takes the crash path (a restart), and is reported with `why`."""
        self.kill_why = self.kill_why or why
        if self.state in (ReplicaState.STARTING, ReplicaState.READY):
            self._set(ReplicaState.KILLING)
        elif self.state is ReplicaState.DRAINING:
            self._set(ReplicaState.STOPPING)
        if self.proc:
            self.proc.kill_tree()

    async def _watch(self, proc: WorkerProcess) -> None:
        code = await proc.wait()
        proc.kill_tree()  # whatever it left behind (a native child, vLLM's engine processes)
        self.link.close()
        self.last_exit_by, self.last_exit_why = await exits.explain(exits.facts_of(self, code), proc.pid, self.log_path)
        self.worker_exit_code = code
        self.last_exit_code = code if self.runtime_exit_code is None else self.runtime_exit_code
        up_since = self.ready_at
        self.ready_at = None
        self.capacity = 0
        if self._ready and not self._ready.done():
            self._ready.set_exception(LoadFailed(
                self.last_error or f"worker {self.last_exit_why} before it was ready; see {self.log_path}"))
        # what the exit means is the state's alone (states.ReplicaState)
        planned = self.state in (ReplicaState.STOPPING, ReplicaState.RESTARTING)
        for job in self.link.take_all():
            if self.cfg.retry_unstarted_on_crash and job.first_token_at is None and job.run.attempts < 2 \
                    and not job.run.cancel_requested:
                self.owner.requeue(job)  # nothing reached the client: safe to run once more
                self.link.let_go(job)
            else:
                job.finish(exits.lost_job_error(self.state, self.name, self.last_exit_why or exit_text(code)))
        if not planned or self.kill_why:  # a kill in a drain is a fault too
            self.crashes[self.last_exit_by] = self.crashes.get(self.last_exit_by, 0) + 1
            rest = self.last_error.splitlines()[1:] if self.last_error else []  # a runtime's further lines
            self.last_error = "\n".join([self.last_exit_why, *rest])
            emit(EventKind.CRASHED, f"replica {self.name} {self.last_exit_why}", model=self.cfg.name,
                 replica=self.index, level=logging.ERROR)
        if self.state in (ReplicaState.READY, ReplicaState.KILLING) and up_since is not None:
            self._crashed(up_since)  # it served, and nobody stopped it: back off and restart
            return
        # stopped on purpose, drained (an unload: never restarted), or crashed while loading (start() reports that; no
        # restart loop); an operator's restart stays RESTARTING: it starts the next worker itself
        if self.state is not ReplicaState.RESTARTING:
            self._set(ReplicaState.STOPPED)
        self.link.end_drain()

    def _crashed(self, up_since: float | None) -> None:
        """A crash of a wanted replica: back off and restart, or give up (fatal)."""
        delay = restart_delay(self.policy, self.history, now=self.clock(), up_since=up_since,
                              exit_code=self.worker_exit_code)
        if delay is None:
            self.last_error = f"too many crashes (last: {self.last_exit_why or exit_text(self.last_exit_code)})"
            self._set(ReplicaState.FATAL)
            emit(EventKind.FATAL, f"replica {self.name} is fatal: {self.last_error}; it is not restarted "
                 "until an operator restarts it", model=self.cfg.name, replica=self.index, level=logging.ERROR)
            return
        self._set(ReplicaState.BACKOFF)
        self._backoff.start(self._restart_after(delay), self.clock() + delay, f"restart-{self.name}")

    async def _restart_after(self, delay: float) -> None:
        await asyncio.sleep(delay)
        async with self._lock:
            if self.state is not ReplicaState.BACKOFF or not self._backoff.is_current():
                return  # stopped, or restarted by the operator, meanwhile
            self.restarts += 1
            try:
                await self._start()
            except LoadFailed as exc:
                log.error("restart of %s failed: %s", self.name, exc)
                if self.state is ReplicaState.STOPPED and self._backoff.is_current():
                    # a boot failure (bad model file) is final; anything else counts as one more crash
                    self._crashed(None)

    def excuse_silence(self, stalled_s: float) -> None:
        """The supervisor itself was stalled `stalled_s` (WorkerLink.excuse_silence)."""
        self.link.excuse_silence(stalled_s)

    def heartbeat(self, now: float) -> None:
        """Called every heartbeat period by the engine: ping the worker, and kill
        it if it has been silent past the liveness window (hung or stopped)."""
        if self.state not in (ReplicaState.STARTING, ReplicaState.READY, ReplicaState.DRAINING,
                              ReplicaState.RESTARTING):
            return
        if self.proc and self.proc.returncode is None:
            self.proc.snapshot(max_age_s=TREE_REFRESH_S)  # its tree, remembered for a kill after it died
            silent_s = now - self.link.last_heard
            if silent_s > self.server.liveness_s:
                log.error("replica %s silent for %.1fs: killing it", self.name, silent_s)
                # SIGKILL of the tree: a stopped process ignores SIGTERM
                self._crash_kill(ErrorCode.RUNTIME_TIMEOUT, f"replica {self.name} stopped responding",
                                 f"no heartbeat for {silent_s:.0f}s (liveness_s="
                                 f"{self.server.liveness_s:g}): hung or stopped")
                return
        self.link.ping()

