"""Scheduling policy, in one place: the per-model executor.

An executor owns one public model's queue of jobs (supervisor/scheduling/fair_queue.py: FIFO
within a tenant, token-fair across tenants), its replicas, and one driver loop
that hands the next job of the queue to the replica with the lowest
occupancy (inflight / effective capacity), round-robin among equals, while any
replica has a free slot. Queued jobs are the scheduler's and can be dropped;
submitted jobs belong to a worker until it reports them finished.

Its intake (`accepting_new_requests`) and `loading` are the model's state
projected here: supervisor/models/registry.py `ModelEntry.set_state` sets them
on every transition; `start` opens the intake and `drain` closes it too (the
executor's own tests set them directly)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from protocol import LIGHT_CALLS_PER_WORKER, LIGHT_ENDPOINTS
from protocol.errors import ErrorCode, PoolError
from supervisor.config import ModelConfig
from supervisor.scheduling.deadlines import expired as slo_expired
from supervisor.scheduling.fair_queue import FairQueue
from supervisor.scheduling.job_queue import JobQueue
from supervisor.scheduling.jobs import NOT_ROUTED, Job, Routing
from supervisor.replicas.replica import Replica
from supervisor.scheduling.replica_choice import ReplicaChoice, make_replica_choice
from supervisor.states import JOB_QUEUED, JOB_SUBMITTED, REPLICA_FATAL, REPLICA_READY, JobState, ReplicaState
from supervisor.tasks import spawn

# replicas that serve now or will again: the queue waits for them (a crash kill restarts, and an
# operator's restart keeps its model's queue)
WILL_SERVE = frozenset({ReplicaState.READY, ReplicaState.STARTING, ReplicaState.BACKOFF, ReplicaState.KILLING,
                        ReplicaState.RESTARTING})

log = logging.getLogger("llm_pool.scheduler")

LIGHT = Routing(light=True)  # a light call's routing: past the queue, in no generation slot (jobs.Routing)


class Executor:
    def __init__(self, cfg: ModelConfig, on_replicas_changed: Callable[[], None] | None = None,
                 tenants=None) -> None:
        self.cfg = cfg
        self.replicas: list[Replica] = []
        # token-fair across tenants, FIFO within one (and so plain FIFO with one tenant); read-only
        # outside: changed only through the methods below
        self.queue: JobQueue = (FairQueue(tenants.share, tenants.output_weight) if tenants is not None
                                else FairQueue())
        self.choice: ReplicaChoice = make_replica_choice(cfg.replica_routing, cfg.prefix_cache_tokens)
        self.accepting_new_requests = False
        self.loading = False  # its replicas are being started: jobs wait, and a failure is the load's to report
        # the model's machine hears of every replica change (ready, crashed, ...): DEGRADED and back
        self._on_replicas_changed = on_replicas_changed
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()  # set whenever nothing is inflight
        self._idle.set()
        self._driver: asyncio.Task | None = None
        self._stop_draining = asyncio.Event()  # a drain ends now, whatever still runs
        self.drain_ends_at: float | None = None  # monotonic: when a drain under way stops waiting
        self._closed = False

    # -- figures for admin and metrics --------------------------------------------
    @property
    def effective_target_inflight(self) -> int:
        return sum(r.capacity for r in self.replicas if r.state is REPLICA_READY)

    @property
    def drain_left_s(self) -> float | None:
        """Seconds until a drain under way stops waiting for what still runs; None: no drain."""
        if self.drain_ends_at is None or self.accepting_new_requests:
            return None
        return max(0.0, self.drain_ends_at - time.monotonic())

    @property
    def runtime_inflight(self) -> int:
        inflight = 0  # a loop, not sum(genexpr): asked at every job's end
        for r in self.replicas:
            inflight += len(r.inflight)
        return inflight

    @property
    def queue_depth(self) -> int:
        return len(self.queue)

    def position(self, job: Job) -> int | None:
        """About how many queued jobs go before `job` (FairQueue.ahead); None: not queued here."""
        return self.queue.position(job)

    # -- intake ----------------------------------------------------------------------
    def start(self) -> None:
        self.accepting_new_requests = True
        self._start_driver()

    def _start_driver(self) -> None:
        # the driver only ends when closed; any other end is a bug, said loudly (tasks.watch)
        self._driver = spawn(self._drive(), f"driver-{self.cfg.name}", forever=True, on_failure=self._driver_ended,
                             what=f"model {self.cfg.name}: the dispatch loop")

    def _driver_ended(self, task: asyncio.Future) -> None:
        """The driver is started again, so that the queue keeps moving."""
        if task is not self._driver or self._closed:
            return
        self._start_driver()
        self._wake.set()

    def enqueue(self, job: Job) -> None:
        if not self.accepting_new_requests:
            raise PoolError(ErrorCode.MODEL_UNLOADING, f"model {self.cfg.name!r} is unloading")
        if self._all_fatal() and not self.loading:
            raise self._no_replica_error()
        if job.endpoint in LIGHT_ENDPOINTS and self._hand_over_light(job):
            return
        # full: only a tenant under its share of max_queue still gets in (so one tenant cannot fill
        # it for the others), up to twice max_queue in all
        if (len(self.queue) >= self.cfg.max_queue and not self._has_free_slot()
                and (len(self.queue) >= 2 * self.cfg.max_queue or self.queue.over_share(job.tenant, self.cfg.max_queue))):
            raise PoolError(ErrorCode.QUEUE_FULL,
                            f"model {self.cfg.name!r} has {len(self.queue)} requests queued, as many of them "
                            f"tenant {job.tenant!r}'s as its share allows (max_queue, shared by weight among the "
                            "tenants waiting)", retry_after_s=1)
        self.queue.push(job)
        self._dispatch()  # a free slot takes it now, without waiting for the driver's turn

    def cancel(self, job: Job) -> None:
        """The client is gone: drop a queued job, or ask its worker to stop it."""
        if job.state is JOB_QUEUED:
            self.queue.remove(job)
            job.finish(PoolError(ErrorCode.INVALID_REQUEST, "cancelled by the client"))
        elif job.state is JOB_SUBMITTED and job.run.replica:
            job.run.replica.cancel(job)

    def replica_changed(self) -> None:
        """A replica changed state: the model's state follows, and the driver looks again."""
        if self._on_replicas_changed is not None:
            try:
                self._on_replicas_changed()
            except Exception:  # a bug in the model's machine must not break the replica's
                log.exception("model %s: following a replica change failed", self.cfg.name)
        if self.runtime_inflight == 0:
            self._idle.set()
        if self.queue and self._all_fatal() and not self.loading:  # nothing will ever run them
            self.fail_queued(self._no_replica_error())
        if self.queue:  # else nothing waits for the slot: a job that comes takes it at once (enqueue)
            self._wake.set()

    def job_finished(self, replica: Replica, job: Job) -> None:
        """A job ended on `replica`: its slot is free. No replica changed state, so the model's
        state and the queue's fate stand (replica_changed is for that): on every request's path."""
        self.choice.finished(replica, job)
        if not self.runtime_inflight:
            self._idle.set()
        if self.queue:  # else nothing waits for the slot: a job that comes takes it at once (enqueue)
            self._wake.set()

    def replica_restarted(self, replica: Replica) -> None:
        """A new worker starts for `replica`: its cache starts empty."""
        self.choice.forget(replica)

    def wants_workers(self) -> bool:
        """Whether a replica may start a worker: only while the model takes work (an unload or
        a shutdown stops its intake in the loop turn it is asked, so no start follows it)."""
        return self.accepting_new_requests and not self._closed

    def replica_kv_events(self, replica: Replica, events: list, reset: bool) -> None:
        """The replica's engine says what its cache stored and dropped. Bad events are
        the index's to skip; a bug there must not break the replica's messages."""
        try:
            self.choice.kv_events(replica, events, reset)
        except Exception:
            log.exception("model %s: applying %s's KV events failed", self.cfg.name, replica.name)

    def requeue(self, job: Job) -> None:
        """A job lost with its crashed worker before producing anything: it goes
        back to the head of the queue (it was admitted first)."""
        if not self.accepting_new_requests:  # unload or shutdown: the queue was failed, so is this
            job.finish(self._unloading_error())
            return
        job.move_to(JobState.QUEUED)  # its replica's link lets go of it (WorkerLink.let_go)
        self.queue.push_front(job)
        self._wake.set()

    def fail_queued(self, error: PoolError) -> int:
        """End every queued job with `error`; how many there were."""
        jobs = self.queue.take_all()
        for job in jobs:
            job.finish(error)
        return len(jobs)

    def take_queued(self) -> list[Job]:
        """Remove and return the queued jobs (they wait for the model's next load)."""
        return self.queue.take_all()

    def adopt(self, jobs: list[Job]) -> None:
        """Jobs that waited through an earlier unload join this queue, in their order."""
        self.queue.extend(jobs)
        self._wake.set()

    def mark_queued(self, reason: PoolError | None) -> None:
        """Tell every queued job why it waits (None: for a slot, as usual)."""
        routing = NOT_ROUTED if reason is None else Routing(queue_reason=reason)
        for job in self.queue:
            job.routing = routing

    def _all_fatal(self) -> bool:
        for r in self.replicas:  # a loop, not all(genexpr): asked on every enqueue and freed slot
            if r.state is not REPLICA_FATAL:
                return False
        return bool(self.replicas)

    def _no_replica_error(self) -> PoolError:
        return PoolError(ErrorCode.NO_HEALTHY_REPLICA, f"every replica of model {self.cfg.name!r} is fatal; "
                         f"see /admin/workers and POST /admin/models/{self.cfg.name}/restart")

    # -- the driver loop -------------------------------------------------------------
    async def _drive(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            self._dispatch()

    def _dispatch(self) -> None:
        """Hand the head of the queue to a replica while one has a free slot.
        Never raises: a job whose hand-over fails ends with 502, the rest go on.
        Once intake stopped (an unload, even one waiting for a load), queued jobs
        never start: the drain fails them."""
        while self.queue and self.accepting_new_requests:
            job = self.queue.peek()
            if self._dropped_expired(job):
                continue
            replica = self.choice.choose(self.replicas, job)
            if replica is None:
                break
            self.queue.pop()
            self._hand_over(job, replica)
        if self.queue and self.accepting_new_requests and self.cfg.newcomer_slots:
            self._dispatch_newcomers()

    def _dispatch_newcomers(self) -> None:
        """Every regular slot is busy: a queued job of a tenant with nothing running on this
        model may take a newcomer slot (above target_inflight, where the runtime has room), so
        a light tenant does not wait for a flood's running request to end. Among such tenants
        the queue's own rule chooses; each takes one newcomer slot at most at a time."""
        while self.queue:
            spare = [r for r in self.replicas if r.free_newcomer_slots > 0]
            if not spare:
                return
            running = {job.tenant for r in self.replicas for job in r.inflight.values() if not job.routing.light}

            def newcomer(tenant: str) -> bool:
                return tenant not in running
            job = self.queue.peek(newcomer)
            if job is None:
                return
            if self._dropped_expired(job):
                continue
            self.queue.pop(newcomer)
            self._hand_over(job, max(spare, key=lambda r: r.free_newcomer_slots))

    def _dropped_expired(self, job: Job) -> bool:
        """A queued job whose TTFT deadline passed leaves the queue with that error, its slot
        never taken (deadlines.py): True when `job` did."""
        if job.admitted.slo_deadline is None or not job.expired(time.monotonic()):
            return False
        self.queue.remove(job)
        job.finish(slo_expired(job.model, job.admitted.slo_ttft_ms))
        return True

    def _hand_over(self, job: Job, replica: Replica, light: bool = False) -> None:
        """`light`: past the queue, beside the replica's slots (_hand_over_light)."""
        # a job run again after a crash is handed over anew; what the queue said of it is over
        job.routing = LIGHT if light else NOT_ROUTED
        self._idle.clear()
        try:
            replica.submit(job)
        except Exception as exc:  # a bug here must cost one job, never the loop or the slot
            log.exception("model %s: handing job %s to %s failed", self.cfg.name, job.id, replica.name)
            replica.forget(job.id)
            job.finish(PoolError(ErrorCode.RUNTIME_ERROR, f"the pool could not hand the request to "
                                 f"replica {replica.name}: {type(exc).__name__}"))
            self.replica_changed()

    def _hand_over_light(self, job: Job) -> bool:
        """A light call (tokenize, ...; protocol.LIGHT_ENDPOINTS) goes at once to the ready replica with
        the fewest jobs, past the queue: its runtime answers it outside the generation slots, so
        it need not wait behind generations (a client budgeting its context asks it first).
        At most LIGHT_CALLS_PER_WORKER at a time on a replica (its worker runs that many beside its
        slots); past that, or with no replica ready, it queues as any job and takes a slot."""
        ready = [r for r in self.replicas if r.state is ReplicaState.READY and
                 r.light_inflight < LIGHT_CALLS_PER_WORKER]
        if not ready or not self.accepting_new_requests:
            return False
        self._hand_over(job, min(ready, key=lambda r: len(r.inflight)), light=True)
        return True

    def _has_free_slot(self) -> bool:
        return any(r.free_slots > 0 for r in self.replicas)

    # -- unload ------------------------------------------------------------------------
    async def drain(self, timeout_s: float) -> None:
        """Stop accepting, fail every queued job with 503, wait for submitted
        jobs to finish (their own deadlines bound this; `timeout_s` is the
        backstop, and `stop_draining` ends it at once)."""
        self.accepting_new_requests = False
        self.fail_queued(self._unloading_error())
        ends = time.monotonic() + timeout_s  # a second drain (a shutdown during an unload) ends no later
        self.drain_ends_at = ends if self.drain_ends_at is None else min(self.drain_ends_at, ends)
        if self.runtime_inflight and not self._stop_draining.is_set():
            idle = asyncio.ensure_future(self._idle.wait())
            stop = asyncio.ensure_future(self._stop_draining.wait())
            try:
                await asyncio.wait({idle, stop}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
            finally:
                idle.cancel()
                stop.cancel()
            if self.runtime_inflight:
                log.error("model %s: %d jobs still running after the drain; stopping anyway",
                          self.cfg.name, self.runtime_inflight)

    def stop_draining(self) -> None:
        self._stop_draining.set()

    def _unloading_error(self) -> PoolError:
        return PoolError(ErrorCode.MODEL_UNLOADING,
                         f"model {self.cfg.name!r} stopped taking work (unload or shutdown) before this request ran")

    # -- reconcile (every heartbeat tick) -----------------------------------------
    def reconcile(self) -> None:
        """Re-derive what missed events should have caused: a drain whose jobs
        have all ended ends; a queue nothing will ever take is failed; a dead
        driver is restarted; a queue with a free slot is looked at again."""
        if self.runtime_inflight == 0:
            self._idle.set()
        if self.queue:
            error = self._stranded_error()
            if error is not None:
                log.error("model %s: failing %d queued jobs: %s", self.cfg.name, len(self.queue), error.message)
                self.fail_queued(error)
        self.ensure_driver()
        if self.queue:
            self._wake.set()

    def _stranded_error(self) -> PoolError | None:
        """Why nothing will ever run the queued jobs; None while something may."""
        if not self.accepting_new_requests:
            return self._unloading_error()
        if self.loading:  # the load fails them itself (load_failed), or they run
            return None
        if self._all_fatal():
            return self._no_replica_error()
        if self.replicas and not any(r.state in WILL_SERVE for r in self.replicas):
            return PoolError(ErrorCode.NO_HEALTHY_REPLICA, f"no replica of model {self.cfg.name!r} is running; "
                             f"see /admin/workers and POST /admin/models/{self.cfg.name}/restart")
        return None

    def driver_alive(self) -> bool:
        return self._driver is not None and not self._driver.done()

    def ensure_driver(self) -> None:
        """Restart the driver loop if it is gone (its done-callback restarts it at
        once; this is the backstop on the reconcile tick)."""
        if self._closed or self._driver is None or not self._driver.done():
            return
        exc = None if self._driver.cancelled() else self._driver.exception()
        log.error("model %s: the driver loop had ended (%r); restarting it", self.cfg.name, exc)
        self._start_driver()

    async def close(self) -> None:
        self._closed = True
        driver, self._driver = self._driver, None  # None first: its end is not a failure
        if driver:
            driver.cancel()
            await asyncio.gather(driver, return_exceptions=True)
