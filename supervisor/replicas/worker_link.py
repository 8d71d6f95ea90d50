"""A replica's link to its worker, as the supervisor sees it: jobs handed over
(`submit`, `cancel`), and every message the worker sends (`_on_message`): deltas and
outcomes into the in-flight table, Ready, errors, heartbeats checked against that
table, KV events. `Replica` (supervisor/replicas/replica.py) is its only user: it owns the
worker's lifecycle, this its conversation; the state they share is the Replica's."""

from __future__ import annotations

import functools
import logging
import time
from typing import TYPE_CHECKING

import protocol as p
from protocol.errors import ErrorCode, PoolError, exit_text
from protocol.redact import mask_values
from supervisor.states import JobState, ReplicaState

if TYPE_CHECKING:  # the jobs the scheduler hands over (scheduling/ is above replicas/)
    from supervisor.scheduling.jobs import Job

log = logging.getLogger("llm_pool.replica")


class LoadFailed(Exception):
    pass


def _error_code(value: str) -> ErrorCode:
    try:
        return ErrorCode(value)
    except ValueError:
        return ErrorCode.RUNTIME_ERROR


class WorkerLink:
    """The jobs and messages half of `Replica` (a base class of it, never used alone)."""

    def submit(self, job: Job) -> None:
        """Hand a job to the worker. If the frame cannot be sent (the worker is
        gone or not reading), the job goes back to the head of the queue and this
        replica takes no more work until its worker is replaced: one unreachable
        worker must not fail a whole queue."""
        job.move_to(JobState.SUBMITTED)
        job.replica = self
        job.runtime_tasks = None  # this worker's runtime says them, if at all
        job.submitted_at = job.submitted_at or time.monotonic()
        job.attempts += 1
        self.inflight[job.id] = job
        self.light_inflight += job.light
        self.submits_sent += 1  # a send that fails means a new worker, which counts from 0
        job.submit_seq = self.submits_sent
        self.transport.send_frame(self.identity, job.frame, functools.partial(self._submit_failed, job))

    def _submit_failed(self, job: Job) -> None:
        """The Submit could not be sent (see submit). Sent after the loop turn that
        queued it (Transport batches them): by now the job may have ended, or its
        worker exited (the crash path has dealt with the job then)."""
        if self.inflight.get(job.id) is not job:
            return
        self.forget(job.id)
        job.attempts -= 1  # it never reached a worker
        if job.cancel_requested:  # its client left meanwhile: nothing to run again
            job.finish(PoolError(ErrorCode.INVALID_REQUEST, "cancelled by the client"))
        else:
            self.owner.requeue(job)
        self.owner.replica_changed()  # the driver looks again: another replica may take it
        if self.state not in (ReplicaState.STARTING, ReplicaState.READY, ReplicaState.DRAINING):
            return  # already on its way out
        log.error("replica %s is unreachable (gone, or not reading its socket): restarting it", self.name)
        self.kill_why = self.kill_why or "unreachable: its socket took no frames"
        self._out_of_rotation()
        if self.proc:
            self.proc.kill_tree()  # its exit takes the crash path: jobs end or run again, a restart follows

    def cancel(self, job: Job) -> None:
        """Ask the worker to stop the job. It stays inflight (its slot busy) until
        the worker confirms, so capacity is never over-committed."""
        if job.id in self.inflight and not job.cancel_requested:
            job.cancel_requested = True
            self.transport.send(self.identity, p.Cancel(job=job.id))

    def _drain_over(self) -> None:
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    def forget(self, job_id: str) -> Job | None:
        """The job out of the in-flight table (None: it was not there); its slot or light place is free."""
        job = self.inflight.pop(job_id, None)
        if job is not None and job.light:
            self.light_inflight -= 1
        return job

    def _forget_all(self) -> list[Job]:
        jobs = list(self.inflight.values())
        self.inflight.clear()
        self.light_inflight = 0
        return jobs

    def _fail_all(self, code: ErrorCode, message: str) -> None:
        jobs = self._forget_all()
        self._job_deltas.clear()
        for job in jobs:
            job.finish(PoolError(code, message))
        self._drain_over()
        self.owner.replica_changed()

    def _lost_job_error(self, code: int) -> PoolError:
        """What a job still running when the worker exited is told, by the replica's state."""
        if self.state is ReplicaState.RESTARTING:
            return PoolError(ErrorCode.RUNTIME_RESTARTED, f"replica {self.name} was restarted by the operator "
                             "before the request finished")
        if self.state is ReplicaState.STOPPING:  # what a drain's grace did not let finish (unload, shutdown)
            return PoolError(ErrorCode.MODEL_UNLOADING, f"replica {self.name} was stopped (unload or shutdown) "
                             "before the request finished")
        return PoolError(ErrorCode.RUNTIME_CRASHED, f"the runtime of replica {self.name} exited "
                         f"({self.last_exit_why or exit_text(code)}) during the request")

    def _finish(self, job_id: str, outcome: p.Done | PoolError) -> None:
        job = self.forget(job_id)
        deltas = self._job_deltas.pop(job_id, 0)
        if job is None:
            self.unknown_job_replies += 1  # late reply for a job already ended: dropped
            return
        if isinstance(outcome, p.Done):  # the runtime's usage settles what the deltas did not carry
            settled = max(0, int(outcome.usage.get("output_tokens", 0) or 0) - deltas)
            self.streamed_tokens += settled
            self.settled_tokens += settled
        job.finish(outcome)
        if not self.inflight:  # a restart's drain is over
            self._drain_over()
        self.owner.job_finished(self, job)
        self.owner.replica_changed()

    def _reconcile_jobs(self, beat: p.Heartbeat) -> None:
        """Compare the in-flight table with the jobs the worker's heartbeat lists
        (a backstop for a lost message: events can be missed). Each direction of
        the socket keeps its order, so a job whose Submit the worker had received
        when it sent this heartbeat (`submits_seen`) and that it no longer runs
        has sent its Done or Error before the heartbeat, or never will: it is
        lost, so it ends with 502 and its slot frees. A job the worker runs that
        this side no longer has is cancelled there."""
        listed = {j for j in beat.jobs if isinstance(j, str)}
        for job_id in listed - self.inflight.keys():
            self.transport.send(self.identity, p.Cancel(job=job_id))
        lost = [job for job in self.inflight.values()
                if job.submit_seq <= beat.submits_seen and job.id not in listed]
        for job in lost:
            log.error("replica %s: job %s is in flight here but its worker no longer runs it and sent no "
                      "result; ending it and freeing its slot", self.name, job.id)
            self._finish(job.id, PoolError(ErrorCode.RUNTIME_ERROR, "the runtime worker lost track of the request"))

    def _on_message(self, msg: p.Message | p.ProtocolError) -> None:
        self.last_heard = self.clock()
        self.connected = True
        match msg:
            case p.Delta(job=job_id):
                if job := self.inflight.get(job_id):
                    if msg.tasks:  # the runtime's tasks of the job (its story shows their log lines)
                        job.runtime_tasks = msg.tasks
                        if not msg.text and not msg.parts:
                            return  # said on a delta of its own: no output
                    self.streamed_tokens += msg.tokens  # within 0..MAX_DELTA_TOKENS (the codec checked)
                    self._job_deltas[job_id] = self._job_deltas.get(job_id, 0) + msg.tokens
                    job.push(msg)
                else:
                    self.unknown_job_replies += 1
            case p.Done(job=job_id):
                self._finish(job_id, msg)
            case p.Error(job=None, code=code, message=message, exit_code=exit_code):
                self.last_error = message
                self.runtime_exit_code = exit_code  # its runtime died: that exit is the one to show
                # runtime_timeout: its worker killed it (busy after a cancel left it no job)
                self.runtime_killed_by_worker = code == ErrorCode.RUNTIME_TIMEOUT
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
                self.newcomer_slots = max(0, min(self.cfg.newcomer_slots, capacity - self.capacity))
                if self.newcomer_slots < self.cfg.newcomer_slots:
                    log.warning("replica %s: %d of %d newcomer_slots (the runtime runs %d at once, target_inflight "
                                "%d)", self.name, self.newcomer_slots, self.cfg.newcomer_slots, capacity,
                                self.capacity)
                self.info = mask_values(info)  # shown in /admin/workers: no credentials in a URL
                self.ready_at = self.clock()
                if self.proc:
                    self.proc.snapshot()  # the runtime's processes exist by now
                # only the start that waits for it makes the replica ready: not a start
                # already aborted, timed out or killed
                if self._ready and not self._ready.done() and self.state is ReplicaState.STARTING:
                    self._ready.set_result(None)
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
                    self._crash_kill(error.code, error.message, f"malformed frames from its worker ({reason})")
            case p.Heartbeat():
                self._reconcile_jobs(msg)
            case p.KvEvents(events=events, reset=reset):
                self.owner.replica_kv_events(self, events, reset)
            case p.Hello():
                self.transport.send(self.identity, self.setup())
