"""A replica's link to its worker, as the supervisor sees it: jobs handed over
(`submit`, `cancel`) and every message the worker sends (`on_message`): deltas and
outcomes into the in-flight table, heartbeats checked against that table, malformed
frames counted. A collaborator of `Replica` (supervisor/replicas/replica.py), one per
replica, living across its workers: the replica owns the worker's lifecycle and its
state (ReplicaState), the link owns the conversation's state (the in-flight table, the
Submits sent, the token and error counters). What the conversation means for the
lifecycle (Ready, a dead runtime, an unreachable or corrupt worker, a job's end) the
link tells its replica through `LinkHost`; neither touches the other's private state."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import protocol as p
from protocol.errors import ErrorCode, PoolError
from supervisor.replicas.transport import Transport
from supervisor.states import JOB_SUBMITTED, JobState

if TYPE_CHECKING:  # the jobs the scheduler hands over (scheduling/ is above replicas/)
    from supervisor.replicas.replica import Replica
    from supervisor.scheduling.jobs import Job

log = logging.getLogger("llm_pool.replica")


class LoadFailed(Exception):
    pass


def _error_code(value: str) -> ErrorCode:
    try:
        return ErrorCode(value)
    except ValueError:
        return ErrorCode.RUNTIME_ERROR


class Run:
    """What execution holds of a job: its hand-over to a worker. Its one writer is this module:
    `WorkerLink.submit` gives the job a new record at each hand-over (one run again after its
    worker was lost keeps its first hand-over's time and counts its attempts), and only the
    link changes one after (a cancel asked, its runtime's tasks, a Submit that never left, a
    return to the queue). A job never handed over shares NOT_RUN, which nothing writes. Read
    by the executor, the replica (a crash's retry), `Job._refuse`, metrics, the request log
    and the predictor's rows."""

    __slots__ = ("replica", "submitted_at", "attempts", "submit_seq", "cancel_requested", "runtime_tasks")

    def __init__(self, replica: Replica | None = None, submitted_at: float | None = None, attempts: int = 0,
                 submit_seq: int = 0) -> None:
        self.replica = replica  # whose worker holds it (None: back in the queue)
        self.submitted_at = submitted_at  # monotonic; its first hand-over to a worker
        self.attempts = attempts  # submissions to a worker
        self.submit_seq = submit_seq  # its Submit's number among those sent to its current worker
        self.cancel_requested = False  # its worker was asked to stop it
        self.runtime_tasks: list | None = None  # [slot, task id] pairs its runtime said serve it (Delta.tasks)


NOT_RUN = Run()  # a job never handed over


class LinkHost(Protocol):
    """What a link tells its replica (Replica is the one implementation)."""

    name: str  # "model/index", for logs

    def worker_ready(self, capacity: int, info: dict) -> None: ...  # Ready: the runtime loaded

    def runtime_failed(self, code: str, message: str, exit_code: int | None) -> None: ...  # its runtime died

    def send_failed(self, job: Job) -> None: ...  # a Submit could not be sent: the job is out of the table

    def worker_corrupt(self, reason: str) -> None: ...  # a malformed frame no job owns

    def job_ended(self, job: Job) -> None: ...  # a job left the table with its outcome

    def kv_events(self, events: list, reset: bool) -> None: ...  # its engine's cache changed


class WorkerLink:
    """The conversation with the replica's current worker: `open` at each worker's start
    (a new routing identity; a new worker counts its Submits from 0), `close` at its exit."""

    def __init__(self, host: LinkHost, model: str, transport: Transport, clock: Callable[[], float],
                 setup: p.Setup) -> None:
        self.host = host
        self.setup = setup  # the answer to each worker's Hello
        self.model = model  # a job's unsupported-feature error names it (the worker knows its backend only)
        self.transport = transport
        self.clock = clock  # monotonic seconds
        self.identity = ""  # the current worker's routing id ("" before the first start)
        self.inflight: dict[str, Job] = {}
        self.light_inflight = 0  # of them, light calls handed past the queue (Routing.light): in no generation slot
        self.submits_sent = 0  # Submits sent to the current worker; its heartbeats say how many it got
        self.last_heard = 0.0  # monotonic: when the current worker last spoke (its liveness)
        self.connected = False  # the current worker has spoken: it can be sent to
        self.unknown_job_replies = 0  # late or bogus replies, dropped by job id
        self.protocol_errors = 0  # malformed frames, and replies a job may not hold (Job._refuse)
        # output tokens as they stream (the live tokens/s): what each delta says it carries; a
        # job's Done adds what its runtime's usage counts beyond that (settled_tokens, of these)
        self.streamed_tokens = 0
        self.settled_tokens = 0
        self._job_deltas: dict[str, int] = {}  # tokens each job's deltas carried (settled by its Done)
        self._drained: asyncio.Future | None = None  # a drain's wait (drain): resolved when it may end
        self._on_submit_failed = self._submit_failed  # bound once: a Submit's callback is made on every hand-over

    # -- the worker -------------------------------------------------------------
    def open(self, identity: str) -> None:
        """A new worker starts under `identity`: its messages come here from now on."""
        self.identity = identity
        self.submits_sent = 0
        self.connected = False
        self.transport.register(identity, self.on_message)

    def close(self) -> None:
        """The worker is gone (or never started): no more of its messages."""
        self.transport.unregister(self.identity)

    def send(self, msg: p.Message) -> None:
        self.transport.send(self.identity, msg)

    def ping(self) -> None:
        """A heartbeat to the worker, once it has spoken (before its Hello there is no peer to
        send to; a remote one takes seconds)."""
        if self.connected:
            self.transport.send(self.identity, p.Heartbeat(inflight=len(self.inflight)))

    def heard_now(self) -> None:
        """The worker's silence counts from now (its process just started)."""
        self.last_heard = self.clock()

    def excuse_silence(self, stalled_s: float) -> None:
        """The supervisor itself was stalled `stalled_s`: that much of the worker's
        silence is not the worker's (its words wait, unread, in the socket)."""
        self.last_heard += stalled_s

    # -- jobs ---------------------------------------------------------------------
    def submit(self, job: Job, replica: Replica) -> None:
        """Hand a job to the worker (`replica`: the job's, for its readers). If the frame
        cannot be sent, the job leaves the table and the host hears of it (send_failed)."""
        job.move_to(JOB_SUBMITTED)
        before = job.run
        self.submits_sent += 1  # a send that fails means a new worker, which counts from 0
        # submitted_at: beside created_at, whatever the link's clock; its runtime's tasks, this worker's to say
        job.run = Run(replica, before.submitted_at or time.monotonic(), before.attempts + 1, self.submits_sent)
        self.inflight[job.id] = job
        self.light_inflight += job.routing.light
        self.transport.send_frame(self.identity, job.frame, functools.partial(self._on_submit_failed, job))

    def _submit_failed(self, job: Job) -> None:
        """The Submit could not be sent. Sent after the loop turn that queued it
        (Transport batches them): by now the job may have ended, or its worker
        exited (the crash path has dealt with the job then)."""
        if self.inflight.get(job.id) is not job:
            return
        self.forget(job.id)
        job.run.attempts -= 1  # it never reached a worker
        self.host.send_failed(job)

    def let_go(self, job: Job) -> None:
        """`job`, lost with its worker before it produced anything, was given back to its
        model's queue: queued again, it is on no replica (ended there instead, it keeps the
        replica it ran on, for its request-log row)."""
        if job.state is JobState.QUEUED:
            job.run.replica = None

    def cancel(self, job: Job, malformed: bool = False) -> None:
        """Ask the worker to stop the job. It stays inflight (its slot busy) until
        the worker confirms, so capacity is never over-committed. `malformed`: the
        job is stopped for what its runtime sent (counted in protocol_errors)."""
        if malformed:
            self.protocol_errors += 1
        if job.id in self.inflight and not job.run.cancel_requested:
            job.run.cancel_requested = True
            self.transport.send(self.identity, p.Cancel(job=job.id))

    @property
    def generating(self) -> int:
        """Jobs in flight in generation slots (a light call handed past the queue takes none)."""
        return len(self.inflight) - self.light_inflight

    def forget(self, job_id: str) -> Job | None:
        """The job out of the in-flight table (None: it was not there); its slot or light place is free."""
        job = self.inflight.pop(job_id, None)
        if job is not None and job.routing.light:
            self.light_inflight -= 1
        return job

    def take_all(self) -> list[Job]:
        """Every job out of the table (its worker is gone or being killed), for the replica to end."""
        jobs = list(self.inflight.values())
        self.inflight.clear()
        self.light_inflight = 0
        self._job_deltas.clear()
        return jobs

    def fail_all(self, code: ErrorCode, message: str) -> None:
        """Every job in the table ends with this error (its worker is being killed)."""
        for job in self.take_all():
            job.finish(PoolError(code, message))
        self.end_drain()

    async def drain(self, timeout_s: float) -> bool:
        """Wait until the in-flight table is empty, or end_drain cuts the wait, `timeout_s` at
        most: False when it timed out."""
        self._drained = drained = asyncio.get_running_loop().create_future()
        try:
            await asyncio.wait_for(asyncio.shield(drained), timeout_s)
            return True
        except TimeoutError:
            return False
        finally:
            self._drained = None

    def end_drain(self) -> None:
        """A drain under way (drain) ends now: the table is empty, or a stop does not wait for it."""
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

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
        if not self.inflight:  # a drain is over
            self.end_drain()
        self.host.job_ended(job)

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
                if job.run.submit_seq <= beat.submits_seen and job.id not in listed]
        for job in lost:
            log.error("replica %s: job %s is in flight here but its worker no longer runs it and sent no "
                      "result; ending it and freeing its slot", self.host.name, job.id)
            self._finish(job.id, PoolError(ErrorCode.RUNTIME_ERROR, "the runtime worker lost track of the request"))

    # -- messages -------------------------------------------------------------------
    def on_message(self, msg: p.Message | p.ProtocolError) -> None:
        self.last_heard = self.clock()
        self.connected = True
        match msg:
            case p.Delta(job=job_id):
                if job := self.inflight.get(job_id):
                    if msg.tasks:  # the runtime's tasks of the job (its story shows their log lines)
                        job.run.runtime_tasks = msg.tasks
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
                self.host.runtime_failed(code, message, exit_code)
            case p.Error(job=job_id, code=code, message=message, param=param):
                code = _error_code(code)
                if code in (ErrorCode.UNSUPPORTED_ENDPOINT, ErrorCode.UNSUPPORTED_PARAMETER):
                    message = f"model {self.model!r}: {message}"  # the worker knows its backend, not its name
                self._finish(job_id, PoolError(code, message, param=param))
            case p.Ready(capacity=capacity, info=info):
                self.host.worker_ready(capacity, info)
            case p.ProtocolError(job=job_id, reason=reason):
                self.protocol_errors += 1
                log.error("replica %s sent a malformed frame: %s", self.host.name, reason)
                if job_id in self.inflight:
                    self.transport.send(self.identity, p.Cancel(job=job_id))
                    self._finish(job_id, PoolError(ErrorCode.PROTOCOL_ERROR,
                                                   f"malformed reply from the runtime: {reason}"))
                elif job_id is None:  # which job's stream is corrupt is unknown
                    self.host.worker_corrupt(reason)
            case p.Heartbeat():
                self._reconcile_jobs(msg)
            case p.KvEvents(events=events, reset=reset):
                self.host.kv_events(events, reset)
            case p.Hello():
                self.transport.send(self.identity, self.setup)
