"""One replica: the supervisor-side handle of one runtime worker subprocess.

Owns that worker's lifecycle (spawn, ready, heartbeats, stop, restart after a
crash) and its in-flight table. Scheduling decisions are the executor's."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path
from typing import Protocol

import protocol as p
from protocol.errors import ErrorCode, PoolError
from supervisor.config import ModelConfig, ServerConfig
from supervisor.jobs import Job, JobState
from supervisor.process import spawn_worker, stop_process
from supervisor.restart_policy import CrashHistory, RestartPolicy, restart_delay
from supervisor.states import REPLICA_TRANSITIONS, ReplicaState, transition
from supervisor.transport import Transport

log = logging.getLogger("llm_pool.replica")


MISSED_BEATS = 3  # worker heartbeats without a job in flight here before it is deemed lost


class LoadFailed(Exception):
    pass


class ReplicaOwner(Protocol):
    """What a replica tells its executor."""

    def replica_changed(self) -> None: ...  # a slot freed or the state changed

    def requeue(self, job: Job) -> None: ...  # run this job again, ahead of the queue


def _error_code(value: str) -> ErrorCode:
    try:
        return ErrorCode(value)
    except ValueError:
        return ErrorCode.RUNTIME_ERROR


class Replica:
    def __init__(self, cfg: ModelConfig, server: ServerConfig, index: int, transport: Transport,
                 log_dir: Path, owner: ReplicaOwner, policy: RestartPolicy | None = None) -> None:
        self.cfg = cfg
        self.server = server
        self.index = index
        self.name = f"{cfg.name}/{index}"
        self.transport = transport
        self.log_path = log_dir / f"{cfg.name}-{index}.log"
        self.owner = owner
        self.policy = policy or RestartPolicy()
        self.state = ReplicaState.STOPPED
        self.identity = ""
        self.generation = 0
        self.proc: asyncio.subprocess.Process | None = None
        self.capacity = 0  # effective: min(configured, runtime capability)
        self.runtime_capacity: int | None = None
        self.info: dict = {}
        self.inflight: dict[str, Job] = {}
        self.started_at: float | None = None  # wall clock of the current process
        self.ready_at: float | None = None  # monotonic
        self.last_heard = 0.0
        self.restarts = 0
        self.last_exit_code: int | None = None
        self.last_error: str | None = None
        self.history = CrashHistory()
        self.unknown_job_replies = 0  # late or bogus replies, dropped by job id
        self.protocol_errors = 0
        self.unreachable = False  # a Submit could not be sent: out of rotation until the next start
        self._missed_beats: dict[str, int] = {}  # job id -> worker heartbeats in a row without it
        self._ready: asyncio.Future | None = None
        self._watcher: asyncio.Task | None = None
        self._restart_task: asyncio.Task | None = None

    # -- state ---------------------------------------------------------------
    def _set(self, new: ReplicaState) -> None:
        self.state = transition(REPLICA_TRANSITIONS, self.state, new)
        self.owner.replica_changed()

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc and self.proc.returncode is None else None

    @property
    def free_slots(self) -> int:
        if self.state is not ReplicaState.READY or self.unreachable:
            return 0
        return self.capacity - len(self.inflight)

    # -- lifecycle -------------------------------------------------------------
    async def start(self) -> None:
        """Spawn the worker and wait until its runtime is ready (or fails to load)."""
        self._set(ReplicaState.STARTING)
        self.generation += 1
        self.identity = f"{self.name}#{self.generation}"
        self.capacity = 0
        self.last_error = None
        self.unreachable = False
        self._ready = asyncio.get_running_loop().create_future()
        self.transport.register(self.identity, self._on_message)
        env = {}
        if self.cfg.replica_devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = self.cfg.replica_devices[self.index]
        self.proc = await spawn_worker([
            "--endpoint", self.transport.endpoint, "--replica", self.identity,
            "--backend", self.cfg.backend, "--options", json.dumps(self.cfg.options),
            "--target-inflight", str(self.cfg.target_inflight),
            "--heartbeat-s", str(self.server.heartbeat_s), "--liveness-s", str(self.server.liveness_s),
            "--stop-timeout-s", str(self.cfg.stop_timeout_s),
        ], self.log_path, env)
        self.started_at = time.time()
        self.last_heard = time.monotonic()
        self._watcher = asyncio.create_task(self._watch(self.proc), name=f"watch-{self.identity}")
        try:
            await asyncio.wait_for(asyncio.shield(self._ready), self.cfg.load_timeout_s)
        except TimeoutError:
            self.last_error = f"runtime not ready within load_timeout_s={self.cfg.load_timeout_s}"
            await self._kill()
            raise LoadFailed(self.last_error) from None
        except LoadFailed:
            await self._kill()
            raise

    async def stop(self) -> None:
        """Stop the worker now: a clean Shutdown, then SIGTERM/SIGKILL of its tree."""
        if self._restart_task:
            self._restart_task.cancel()
        if self.state is ReplicaState.STOPPED:
            return
        if self.state in (ReplicaState.BACKOFF, ReplicaState.FATAL):
            self._set(ReplicaState.STOPPED)
            return
        self._set(ReplicaState.STOPPING)
        proc = self.proc
        if proc and proc.returncode is None:
            self.transport.send(self.identity, p.Shutdown())
            try:
                await asyncio.wait_for(asyncio.shield(proc.wait()), self.cfg.stop_timeout_s)
            except TimeoutError:
                await stop_process(proc, 2.0)
        if self._watcher:
            await asyncio.gather(self._watcher, return_exceptions=True)

    async def _kill(self) -> None:
        if self.state is not ReplicaState.STOPPED:  # it may have exited already
            self._set(ReplicaState.STOPPING)
        if self.proc:
            await stop_process(self.proc, 2.0)
        if self._watcher:
            await asyncio.gather(self._watcher, return_exceptions=True)

    async def _watch(self, proc: asyncio.subprocess.Process) -> None:
        code = await proc.wait()
        self.transport.unregister(self.identity)
        self.last_exit_code = code
        up_since = self.ready_at
        self.ready_at = None
        self.capacity = 0
        expected = self.state is ReplicaState.STOPPING
        if self._ready and not self._ready.done():
            self._ready.set_exception(LoadFailed(
                self.last_error or f"worker exited with code {code} before it was ready; see {self.log_path}"))
        lost = list(self.inflight.values())
        self.inflight.clear()
        for job in lost:
            if self.cfg.retry_unstarted_on_crash and job.first_token_at is None and job.attempts < 2 \
                    and not job.cancel_requested:
                self.owner.requeue(job)  # nothing reached the client: safe to run once more
            else:
                job.finish(PoolError(ErrorCode.RUNTIME_CRASHED, f"the runtime of replica {self.name} "
                                     f"exited (code {code}) during the request"))
        if expected:
            self._set(ReplicaState.STOPPED)
            return
        log.error("replica %s exited unexpectedly with code %s", self.name, code)
        if up_since is None:  # crashed while loading: start() reports it; no restart loop
            self._set(ReplicaState.STOPPED)
            return
        delay = restart_delay(self.policy, self.history, now=time.monotonic(), up_since=up_since,
                              exit_code=code)
        if delay is None:
            self.last_error = self.last_error or f"too many crashes (last exit code {code})"
            self._set(ReplicaState.FATAL)
            return
        self._set(ReplicaState.BACKOFF)
        self._restart_task = asyncio.create_task(self._restart_after(delay))

    async def _restart_after(self, delay: float) -> None:
        await asyncio.sleep(delay)
        self.restarts += 1
        try:
            await self.start()
        except LoadFailed as exc:
            log.error("restart of %s failed: %s", self.name, exc)
            # a boot failure (bad model file) is final; anything else counts as one more crash
            delay = restart_delay(self.policy, self.history, now=time.monotonic(), up_since=None,
                                  exit_code=self.last_exit_code)
            if delay is None:
                self._set(ReplicaState.FATAL)
                return
            self._set(ReplicaState.BACKOFF)
            self._restart_task = asyncio.create_task(self._restart_after(delay))

    def drain(self) -> None:
        """No new jobs (the executor stops sending them); running ones finish."""
        if self.state is ReplicaState.READY:
            self._set(ReplicaState.DRAINING)

    async def restart(self) -> None:
        """Operator restart: stop whatever runs, clear fatal, start afresh."""
        await self.stop()
        self.history = CrashHistory()
        self.restarts += 1
        await self.start()

    # -- jobs --------------------------------------------------------------------
    def submit(self, job: Job) -> None:
        """Hand a job to the worker. If the frame cannot be sent (the worker is
        gone or not reading), the job goes back to the head of the queue and this
        replica takes no more work until its worker is replaced: one unreachable
        worker must not fail a whole queue."""
        job.state = JobState.SUBMITTED
        job.replica = self
        job.attempts += 1
        self.inflight[job.id] = job
        if self.transport.send_frame(self.identity, job.frame):
            return
        del self.inflight[job.id]
        job.attempts -= 1  # it never reached a worker
        self.owner.requeue(job)
        if not self.unreachable:
            self.unreachable = True
            log.error("replica %s is unreachable (gone, or not reading its socket): restarting it", self.name)
            if self.proc and self.proc.returncode is None:
                self.proc.kill()  # its exit takes the crash path: in-flight jobs end, a restart follows

    def cancel(self, job: Job) -> None:
        """Ask the worker to stop the job. It stays inflight (its slot busy) until
        the worker confirms, so capacity is never over-committed."""
        if job.id in self.inflight and not job.cancel_requested:
            job.cancel_requested = True
            self.transport.send(self.identity, p.Cancel(job=job.id))

    def heartbeat(self, now: float) -> None:
        """Called every heartbeat period by the engine: ping the worker, and kill
        it if it has been silent past the liveness window (hung or stopped)."""
        if self.state not in (ReplicaState.STARTING, ReplicaState.READY, ReplicaState.DRAINING):
            return
        if now - self.last_heard > self.server.liveness_s and self.proc and self.proc.returncode is None:
            log.error("replica %s silent for %.1fs: killing it", self.name, now - self.last_heard)
            self._fail_all(ErrorCode.RUNTIME_TIMEOUT, f"replica {self.name} stopped responding")
            self.proc.kill()  # SIGKILL: a stopped process ignores SIGTERM; its child has PDEATHSIG
            return
        self.transport.send(self.identity, p.Heartbeat(inflight=len(self.inflight)))

    def _fail_all(self, code: ErrorCode, message: str) -> None:
        jobs = list(self.inflight.values())
        self.inflight.clear()
        for job in jobs:
            job.finish(PoolError(code, message))
        self.owner.replica_changed()

    def _finish(self, job_id: str, outcome: p.Done | PoolError) -> None:
        job = self.inflight.pop(job_id, None)
        if job is None:
            self.unknown_job_replies += 1  # late reply for a job already ended: dropped
            return
        job.finish(outcome)
        self.owner.replica_changed()

    def _reconcile_jobs(self, running: list) -> None:
        """Compare the in-flight table with the jobs the worker's heartbeat lists
        (a backstop for a lost message: events can be missed). A job the worker
        has not listed in MISSED_BEATS heartbeats in a row will never get its Done:
        it ends with 502 and its slot frees. A job the worker runs that this
        side no longer has is cancelled there."""
        listed = {j for j in running if isinstance(j, str)}
        for job_id in listed - self.inflight.keys():
            self.transport.send(self.identity, p.Cancel(job=job_id))
        misses = {}
        for job_id in self.inflight.keys() - listed:
            misses[job_id] = self._missed_beats.get(job_id, 0) + 1
            if misses[job_id] >= MISSED_BEATS:
                del misses[job_id]
                log.error("replica %s: job %s is in flight here but its worker has not run it for %d "
                          "heartbeats; ending it and freeing its slot", self.name, job_id, MISSED_BEATS)
                self._finish(job_id, PoolError(ErrorCode.RUNTIME_ERROR,
                                               "the runtime worker lost track of the request"))
        self._missed_beats = misses

    def _on_message(self, msg: p.Message | p.ProtocolError) -> None:
        self.last_heard = time.monotonic()
        match msg:
            case p.Delta(job=job_id):
                if job := self.inflight.get(job_id):
                    job.push(msg)
                else:
                    self.unknown_job_replies += 1
            case p.Done(job=job_id):
                self._finish(job_id, msg)
            case p.Error(job=None, message=message):
                self.last_error = message
                if self._ready and not self._ready.done():
                    self._ready.set_exception(LoadFailed(message))
            case p.Error(job=job_id, code=code, message=message, param=param):
                code = _error_code(code)
                if code in (ErrorCode.UNSUPPORTED_ENDPOINT, ErrorCode.UNSUPPORTED_PARAMETER):
                    message = f"model {self.cfg.name!r}: {message}"  # the worker knows its backend, not its name
                self._finish(job_id, PoolError(code, message, param=param))
            case p.Ready(capacity=capacity, info=info):
                self.runtime_capacity = capacity
                self.capacity = max(0, min(self.cfg.target_inflight, capacity))
                self.info = info
                self.ready_at = time.monotonic()
                if self._ready and not self._ready.done():
                    self._ready.set_result(None)
                if self.state is ReplicaState.STARTING:
                    self._set(ReplicaState.READY)
            case p.ProtocolError(job=job_id, reason=reason):
                self.protocol_errors += 1
                log.error("replica %s sent a malformed frame: %s", self.name, reason)
                error = PoolError(ErrorCode.PROTOCOL_ERROR, f"malformed reply from the runtime: {reason}")
                if job_id in self.inflight:
                    self.transport.send(self.identity, p.Cancel(job=job_id))
                    self._finish(job_id, error)
                elif job_id is None and self.proc and self.proc.returncode is None:
                    # which job's stream is corrupt is unknown: fail them all, restart the worker
                    self._fail_all(error.code, error.message)
                    self.proc.kill()
            case p.Heartbeat(jobs=jobs):
                self._reconcile_jobs(jobs)
            case p.Hello():
                pass
