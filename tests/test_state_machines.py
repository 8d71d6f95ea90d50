"""The Replica and Executor state machines, edge by edge, with the launcher,
the clock and the transport injected: no processes, no sockets. Each test is
one scenario on a fresh event loop; waits are bounded by `settle`."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

import protocol as p
from protocol.errors import ErrorCode, PoolError
from supervisor.config import ModelConfig, ServerConfig
from supervisor.scheduling.jobs import Job, JobState
from supervisor.replicas.replica import LoadFailed, Replica
from supervisor.replicas.restart_policy import RestartPolicy
from supervisor.scheduling.executor import Executor
from supervisor.states import ReplicaState


class FakeTransport:
    endpoint = "ipc://fake"

    def __init__(self) -> None:
        self.handlers = {}
        self.sent: list[tuple[str, p.Message]] = []
        self.on_send = lambda identity, msg: None

    def register(self, identity, handler) -> None:
        self.handlers[identity] = handler

    def unregister(self, identity) -> None:
        self.handlers.pop(identity, None)

    def send(self, identity, msg, on_failed=None) -> None:
        """As Transport.send: a frame to a peer that is not there fails after this loop turn."""
        self.sent.append((identity, msg))
        self.on_send(identity, msg)
        if identity not in self.handlers and on_failed is not None:
            asyncio.get_running_loop().call_soon(on_failed)

    def send_frame(self, identity, frame: bytes, on_failed=None) -> None:
        self.send(identity, p.decode(frame), on_failed)

    def deliver(self, identity, msg) -> None:
        self.handlers[identity](msg)


class FakeProcess:
    """What a replica needs of a worker process (process.WorkerProcess)."""

    def __init__(self, pid: int, identity: str) -> None:
        self.pid = pid
        self.identity = identity
        self.returncode = None
        self.tree_killed = False
        self._exited = asyncio.Event()

    async def wait(self) -> int:
        await self._exited.wait()
        return self.returncode

    def exit(self, code: int) -> None:
        if self.returncode is None:
            self.returncode = code
            self._exited.set()

    def snapshot(self, max_age_s: float = 0.0) -> None:
        pass

    def kill_tree(self) -> None:
        self.tree_killed = True
        self.exit(-9)

    async def stop(self, timeout_s: float) -> int:
        self.exit(-15)
        return self.returncode


class FakeLauncher:
    def __init__(self) -> None:
        self.procs: list[FakeProcess] = []
        self.error: OSError | None = None
        self.most_alive = 0  # the most worker processes alive at once

    async def __call__(self, args, log_path, env) -> FakeProcess:
        await asyncio.sleep(0)  # a real spawn yields to the loop
        if self.error:
            raise self.error
        proc = FakeProcess(1000 + len(self.procs), args[args.index("--replica") + 1])
        self.procs.append(proc)
        self.most_alive = max(self.most_alive, len(self.alive()))
        return proc

    def alive(self) -> list[FakeProcess]:
        return [proc for proc in self.procs if proc.returncode is None]


class FakeOwner:
    def __init__(self) -> None:
        self.requeued: list[Job] = []
        self.restarted = 0  # new workers started (each one's cache starts empty)

    def replica_changed(self) -> None:
        pass

    def requeue(self, job: Job) -> None:
        self.requeued.append(job)

    def job_finished(self, replica, job: Job) -> None:
        pass

    def replica_restarted(self, replica) -> None:
        self.restarted += 1

    def wants_workers(self) -> bool:
        return True


class Rig:
    """One replica wired to fakes. Workers exit on Shutdown unless `obey_shutdown` is off."""

    def __init__(self, policy: RestartPolicy | None = None, **cfg) -> None:
        self.transport = FakeTransport()
        self.launcher = FakeLauncher()
        self.now = 100.0
        self.owner = FakeOwner()
        self.obey_shutdown = True
        self.server = ServerConfig(heartbeat_s=1.0, liveness_s=5.0)
        self.cfg = ModelConfig(name="m", backend="synthetic", **cfg)
        self.replica = Replica(self.cfg, self.server, 0, self.transport, Path("/nonexistent"), self.owner,
                               policy=policy or RestartPolicy(), launcher=self.launcher, clock=lambda: self.now)
        self.transport.on_send = self._on_send

    def _on_send(self, identity, msg) -> None:
        if isinstance(msg, p.Shutdown) and self.obey_shutdown:
            for proc in self.launcher.alive():
                if proc.identity == identity:
                    asyncio.get_running_loop().call_soon(proc.exit, 0)

    async def spawned(self, count: int) -> FakeProcess:
        await settle(lambda: len(self.launcher.procs) >= count, f"{count} spawns")
        return self.launcher.procs[count - 1]

    def ready(self, proc: FakeProcess, capacity: int = 2) -> None:
        self.transport.deliver(proc.identity, p.Ready(capacity=capacity, info={}))

    async def start(self) -> FakeProcess:
        task = asyncio.create_task(self.replica.start())
        proc = await self.spawned(len(self.launcher.procs) + 1)
        self.ready(proc)
        await task
        assert self.replica.state is ReplicaState.READY
        return proc

    def job(self, *, started: bool) -> Job:
        job = Job("m", {}, 60)
        self.replica.submit(job)
        if started:
            self.transport.deliver(self.replica.identity, p.Delta(job=job.id, text="x"))
        return job


async def settle(condition, what: str = "condition", timeout: float = 2.0) -> None:
    """Let the loop run until `condition()` holds; fail after `timeout` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.001)


async def nothing_more_happens(rig) -> None:
    """What was already scheduled runs (the loop turned over, no wall-clock window), and no
    restart is pending: so nothing more will be spawned."""
    for _ in range(20):
        await asyncio.sleep(0)
    assert not rig.replica.restart_pending


async def stopped_for_good(rig) -> None:
    """Stopped, with nothing more to come: its first worker was its only one."""
    await nothing_more_happens(rig)
    assert rig.replica.state is ReplicaState.STOPPED and len(rig.launcher.procs) == 1


def outcome(job: Job):
    assert job.state is JobState.FINISHED, job.state
    return job.events[-1]


def scenario(fn):
    """Run an async test on a fresh loop."""
    def run():
        asyncio.run(asyncio.wait_for(fn(), 10))
    run.__name__ = fn.__name__
    return run


# -- Replica ------------------------------------------------------------------------------------

@scenario
async def test_start_ready_stop():
    rig = Rig()
    proc = await rig.start()
    # min(target_inflight 1, runtime 2); READY: an exit now is a crash
    assert rig.replica.capacity == 1 and rig.replica.state is ReplicaState.READY
    await rig.replica.stop()
    assert rig.replica.state is ReplicaState.STOPPED and proc.returncode == 0
    assert any(isinstance(m, p.Shutdown) for _, m in rig.transport.sent)
    assert not rig.transport.handlers


@scenario
async def test_crash_in_starting_fails_the_start_and_is_not_restarted():
    rig = Rig()
    task = asyncio.create_task(rig.replica.start())
    proc = await rig.spawned(1)
    rig.transport.deliver(proc.identity, p.Error(job=None, code="load_failed", message="no such model file"))
    proc.exit(3)
    with pytest.raises(LoadFailed, match="no such model file"):
        await task
    await stopped_for_good(rig)


@scenario
async def test_spawn_error_is_fatal_with_the_reason():
    rig = Rig()
    rig.launcher.error = PermissionError(13, "Permission denied", "/state/logs/m-0.log")
    with pytest.raises(LoadFailed, match="Permission denied"):
        await rig.replica.start()
    assert rig.replica.state is ReplicaState.FATAL
    assert "cannot spawn the worker" in rig.replica.last_error and not rig.transport.handlers


@scenario
async def test_spawn_error_in_a_crash_restart_is_fatal_not_starting_forever():
    rig = Rig()
    proc = await rig.start()
    rig.launcher.error = OSError(24, "Too many open files")
    proc.exit(-9)
    await settle(lambda: rig.replica.state is ReplicaState.FATAL, "fatal")
    assert "Too many open files" in rig.replica.last_error


@scenario
async def test_load_timeout_kills_the_worker():
    rig = Rig(load_timeout_s=0.05)
    with pytest.raises(LoadFailed, match="load_timeout_s"):
        await rig.replica.start()
    assert rig.replica.state is ReplicaState.STOPPED and not rig.launcher.alive()


@scenario
async def test_ready_after_an_aborted_start_does_not_make_it_ready():
    rig = Rig()
    task = asyncio.create_task(rig.replica.start())
    proc = await rig.spawned(1)
    rig.obey_shutdown = False
    await rig.replica.stop()  # aborts the start: its worker is killed
    with pytest.raises(LoadFailed, match="stopped before it was ready"):
        await task
    assert proc.returncode is not None and rig.replica.state is ReplicaState.STOPPED
    assert proc.identity not in rig.transport.handlers  # a late Ready cannot even reach it


@scenario
async def test_crash_in_ready_fails_started_jobs_requeues_unstarted_and_restarts():
    rig = Rig(target_inflight=2)
    proc = await rig.start()
    started, unstarted = rig.job(started=True), rig.job(started=False)
    proc.exit(-9)
    await settle(lambda: rig.replica.state is not ReplicaState.READY, "crash seen")
    error = outcome(started)
    assert isinstance(error, PoolError) and error.code is ErrorCode.RUNTIME_CRASHED
    assert rig.owner.requeued == [unstarted]
    fresh = await rig.spawned(2)  # first restart at once
    assert rig.replica.state is ReplicaState.STARTING
    rig.ready(fresh)
    await settle(lambda: rig.replica.state is ReplicaState.READY, "ready again")
    assert rig.replica.restarts == 1 and rig.replica.last_exit_code == -9
    assert rig.owner.restarted == 2  # each new worker told its owner (its prompt cache starts empty)
    await rig.replica.stop()


@scenario
async def test_crash_in_ready_past_the_limit_is_fatal():
    rig = Rig(policy=RestartPolicy(max_crashes=0))
    proc = await rig.start()
    proc.exit(-9)
    await settle(lambda: rig.replica.state is ReplicaState.FATAL, "fatal")
    assert "too many crashes" in rig.replica.last_error and len(rig.launcher.procs) == 1


@scenario
async def test_crash_in_draining_is_final():
    rig = Rig(target_inflight=2)
    proc = await rig.start()
    started, unstarted = rig.job(started=True), rig.job(started=False)
    rig.replica.drain()
    assert rig.replica.state is ReplicaState.DRAINING and rig.replica.free_slots == 0
    proc.exit(-9)
    await settle(lambda: rig.replica.state is ReplicaState.STOPPED, "stopped")
    assert outcome(started).code is ErrorCode.RUNTIME_CRASHED
    assert rig.owner.requeued == [unstarted]  # the executor answers it (503 when unloading)
    await nothing_more_happens(rig)
    assert len(rig.launcher.procs) == 1  # never restarted
    await rig.replica.stop()
    assert rig.replica.state is ReplicaState.STOPPED


@scenario
async def test_a_crash_during_an_operator_restarts_drain_is_planned_and_the_restart_goes_on():
    """The state alone says what an exit means: in RESTARTING it is the operator's, so no
    crash back-off follows, the job is told runtime_restarted, and the restart starts a
    new worker."""
    rig = Rig(target_inflight=2)
    proc = await rig.start()
    running = rig.job(started=True)
    restart = asyncio.create_task(rig.replica.restart(drain_timeout_s=60))
    await settle(lambda: rig.replica.state is ReplicaState.RESTARTING, "restarting")
    assert rig.replica.free_slots == 0  # out of rotation while it drains
    proc.exit(-9)
    fresh = await rig.spawned(2)
    assert outcome(running).code is ErrorCode.RUNTIME_RESTARTED
    assert not rig.replica.restart_pending and rig.replica.restarts == 1  # the operator's restart, no back-off
    rig.ready(fresh)
    await restart
    assert rig.replica.state is ReplicaState.READY
    await rig.replica.stop()


@scenario
async def test_a_stop_during_an_operator_restarts_drain_ends_the_restart():
    rig = Rig(target_inflight=2)
    await rig.start()
    rig.job(started=True)
    restart = asyncio.create_task(rig.replica.restart(drain_timeout_s=60))
    await settle(lambda: rig.replica.state is ReplicaState.RESTARTING, "restarting")
    await rig.replica.stop()
    with pytest.raises(LoadFailed, match="stopped while it drained"):
        await restart
    await stopped_for_good(rig)


@scenario
async def test_a_stop_during_an_operator_restarts_stop_phase_starts_no_new_worker():
    """B3: the old worker is slow to stop (frozen); a stop asked meanwhile wins: the restart
    ends when the old worker is gone, and no new worker is ever started."""
    rig = Rig(stop_timeout_s=0.2)
    proc = await rig.start()
    rig.obey_shutdown = False
    restart = asyncio.create_task(rig.replica.restart(drain_timeout_s=None))  # no drain: straight to its stop
    await settle(lambda: (proc.identity, p.Shutdown()) in rig.transport.sent, "the restart's Shutdown")
    assert rig.replica.state is ReplicaState.RESTARTING
    stop = asyncio.create_task(rig.replica.stop())
    with pytest.raises(LoadFailed, match="stopped during its restart"):
        await restart
    await stop
    await stopped_for_good(rig)
    assert proc.returncode is not None


@scenario
async def test_a_killed_replica_that_had_served_backs_off_and_restarts():
    rig = Rig()
    proc = await rig.start()
    rig.now += rig.server.liveness_s + 1
    rig.replica.heartbeat(rig.now)  # silent past the liveness window: killed
    assert proc.tree_killed and rig.replica.state is ReplicaState.KILLING
    fresh = await rig.spawned(2)
    rig.ready(fresh)
    await settle(lambda: rig.replica.state is ReplicaState.READY, "ready again")
    await rig.replica.stop()


@scenario
async def test_restart_is_refused_while_draining():
    rig = Rig()
    await rig.start()
    rig.replica.drain()
    with pytest.raises(LoadFailed, match="draining"):
        await rig.replica.restart()
    assert rig.replica.state is ReplicaState.DRAINING and len(rig.launcher.alive()) == 1
    await rig.replica.stop()


@scenario
async def test_crash_in_stopping_ends_stopped():
    rig = Rig()
    proc = await rig.start()
    rig.obey_shutdown = False
    stop = asyncio.create_task(rig.replica.stop())
    await settle(lambda: rig.replica.state is ReplicaState.STOPPING, "stopping")
    proc.exit(-11)
    await stop
    await stopped_for_good(rig)


@scenario
async def test_a_stop_ends_a_started_job_with_503_and_requeues_an_unstarted_one():
    rig = Rig(target_inflight=2)
    await rig.start()
    started, unstarted = rig.job(started=True), rig.job(started=False)
    rig.obey_shutdown = False
    stop = asyncio.create_task(rig.replica.stop())
    await settle(lambda: rig.replica.state is ReplicaState.STOPPING, "stopping")
    rig.replica.proc.exit(0)
    await stop
    assert outcome(started).code is ErrorCode.MODEL_UNLOADING and rig.owner.requeued == [unstarted]


@scenario
async def test_stop_timeout_kills_the_tree():
    rig = Rig(stop_timeout_s=0.05)
    proc = await rig.start()
    rig.obey_shutdown = False
    await rig.replica.stop()
    assert proc.returncode == -15 and rig.replica.state is ReplicaState.STOPPED


async def _in_backoff(rig: Rig) -> None:
    """Ready, then a second crash in a row: a long backoff."""
    proc = await rig.start()
    rig.replica.history.streak = 1
    proc.exit(-9)
    await settle(lambda: rig.replica.state is ReplicaState.BACKOFF, "backoff")


@scenario
async def test_stop_in_backoff_cancels_the_restart():
    rig = Rig(policy=RestartPolicy(base_s=60))
    await _in_backoff(rig)
    await rig.replica.stop()
    assert rig.replica.state is ReplicaState.STOPPED
    assert not rig.replica.restart_pending
    assert len(rig.launcher.procs) == 1


@scenario
async def test_operator_restart_in_backoff_starts_one_worker():
    rig = Rig(policy=RestartPolicy(base_s=60))
    await _in_backoff(rig)
    task = asyncio.create_task(rig.replica.restart())
    rig.ready(await rig.spawned(2))
    await task
    assert rig.replica.state is ReplicaState.READY and len(rig.launcher.alive()) == 1
    assert rig.replica.history.streak == 0  # the operator cleared it
    await rig.replica.stop()


@scenario
async def test_crash_while_restarting_from_backoff_backs_off_again():
    rig = Rig(policy=RestartPolicy(base_s=0.02))
    proc = await rig.start()
    proc.exit(-9)  # first crash: restarted at once
    again = await rig.spawned(2)
    again.exit(1)  # dies while loading: one more crash
    await settle(lambda: rig.replica.state is ReplicaState.BACKOFF or len(rig.launcher.procs) > 2, "backoff")
    third = await rig.spawned(3)  # after the backoff
    rig.ready(third)
    await settle(lambda: rig.replica.state is ReplicaState.READY, "ready")
    assert rig.replica.restarts == 2 and len(rig.launcher.alive()) == 1
    await rig.replica.stop()


@scenario
async def test_stop_during_a_crash_restart_leaves_no_worker():
    rig = Rig()
    proc = await rig.start()
    proc.exit(-9)
    restarting = await rig.spawned(2)  # the restart waits for Ready
    await rig.replica.stop()
    assert restarting.returncode is not None and rig.replica.state is ReplicaState.STOPPED
    await nothing_more_happens(rig)
    assert not rig.launcher.alive() and len(rig.launcher.procs) == 2


@scenario
async def test_concurrent_operator_restarts_never_run_two_workers():
    rig = Rig()
    await rig.start()
    restarts = [asyncio.create_task(rig.replica.restart()) for _ in range(5)]
    for n in range(2, 7):
        rig.ready(await rig.spawned(n))
    await asyncio.gather(*restarts)
    assert rig.launcher.most_alive == 1 and len(rig.launcher.alive()) == 1
    assert rig.replica.state is ReplicaState.READY and rig.replica.restarts == 5
    await rig.replica.stop()


@scenario
async def test_liveness_kill_takes_it_out_of_rotation_and_restarts():
    rig = Rig()
    proc = await rig.start()
    job = rig.job(started=True)
    rig.replica.heartbeat(rig.now + 1)
    assert isinstance(rig.transport.sent[-1][1], p.Heartbeat) and not proc.tree_killed
    rig.now += rig.server.liveness_s + 1
    rig.obey_shutdown = False
    rig.replica.heartbeat(rig.now)
    assert proc.tree_killed and rig.replica.free_slots == 0
    assert outcome(job).code is ErrorCode.RUNTIME_TIMEOUT
    rig.ready(await rig.spawned(2))
    await settle(lambda: rig.replica.state is ReplicaState.READY, "restarted")
    rig.obey_shutdown = True
    await rig.replica.stop()


@scenario
async def test_liveness_kill_while_draining_is_final():
    rig = Rig()
    proc = await rig.start()
    rig.replica.drain()
    rig.now += rig.server.liveness_s + 1
    rig.replica.heartbeat(rig.now)
    assert proc.tree_killed
    await settle(lambda: rig.replica.state is ReplicaState.STOPPED, "stopped")
    await nothing_more_happens(rig)
    assert len(rig.launcher.procs) == 1


# -- Executor -------------------------------------------------------------------------------------

class StubReplica:
    def __init__(self, index: int, state: ReplicaState = ReplicaState.READY, capacity: int = 1) -> None:
        self.index = index
        self.state = state
        self.capacity = capacity
        self.inflight: dict[str, Job] = {}
        self.submitted: list[Job] = []

    @property
    def free_slots(self) -> int:
        return self.capacity - len(self.inflight) if self.state is ReplicaState.READY else 0

    def submit(self, job: Job) -> None:
        job.state = JobState.SUBMITTED
        self.inflight[job.id] = job
        self.submitted.append(job)


def executor(*replicas: StubReplica) -> Executor:
    ex = Executor(ModelConfig(name="m", backend="synthetic"))
    ex.replicas = list(replicas)
    ex.start()
    return ex


@scenario
async def test_requeue_while_unloading_answers_503():
    ex = executor(StubReplica(0))
    ex.accepting_new_requests = False
    job = Job("m", {}, 60)
    ex.requeue(job)
    assert outcome(job).code is ErrorCode.MODEL_UNLOADING and not ex.queue
    await ex.close()


@scenario
async def test_reconcile_fails_a_queue_nothing_will_take():
    stuck = StubReplica(0, ReplicaState.STOPPED)
    ex = executor(stuck)
    job = Job("m", {}, 60)
    ex.queue.push(job)
    ex.reconcile()
    assert outcome(job).code is ErrorCode.NO_HEALTHY_REPLICA
    stuck.state = ReplicaState.FATAL
    job = Job("m", {}, 60)
    ex.queue.push(job)
    ex.reconcile()
    assert outcome(job).code is ErrorCode.NO_HEALTHY_REPLICA and "fatal" in outcome(job).message
    await ex.close()


@scenario
async def test_reconcile_keeps_a_queue_a_restart_will_take():
    # a crash restart pending, a crash kill under way, an operator's restart: each serves again
    for state in (ReplicaState.BACKOFF, ReplicaState.KILLING, ReplicaState.RESTARTING):
        ex = executor(StubReplica(0, state))
        job = Job("m", {}, 60)
        ex.queue.push(job)
        ex.reconcile()
        assert job.state is JobState.QUEUED and list(ex.queue) == [job], state
        await ex.close()


@scenario
async def test_reconcile_fails_a_queue_left_by_an_unload():
    ex = executor(StubReplica(0, ReplicaState.DRAINING))
    ex.accepting_new_requests = False
    job = Job("m", {}, 60)
    ex.queue.push(job)
    ex.reconcile()
    assert outcome(job).code is ErrorCode.MODEL_UNLOADING
    await ex.close()


@scenario
async def test_reconcile_ends_a_drain_whose_jobs_ended_unseen():
    replica = StubReplica(0)
    ex = executor(replica)
    job = Job("m", {}, 60)
    ex.enqueue(job)
    assert replica.submitted == [job]
    drain = asyncio.create_task(ex.drain(60))
    await asyncio.sleep(0.01)
    replica.inflight.clear()  # the worker is gone, and nobody told the executor
    replica.state = ReplicaState.STOPPED
    assert not drain.done()
    ex.reconcile()
    await asyncio.wait_for(drain, 1)
    await ex.close()


@scenario
async def test_stop_draining_ends_a_drain_at_once():
    replica = StubReplica(0)
    ex = executor(replica)
    ex.enqueue(Job("m", {}, 60))
    drain = asyncio.create_task(ex.drain(60))
    await asyncio.sleep(0.01)
    assert not drain.done()
    ex.stop_draining()
    await asyncio.wait_for(drain, 1)
    await ex.close()


@scenario
async def test_a_dead_driver_is_restarted_by_reconcile():
    replica = StubReplica(0)
    ex = executor(replica)
    ex._driver.cancel()
    await asyncio.sleep(0)
    assert not ex.driver_alive()
    ex.reconcile()
    assert ex.driver_alive()
    ex.queue.push(Job("m", {}, 60))
    ex.replica_changed()  # the driver wakes and dispatches
    await settle(lambda: replica.submitted, "dispatched by the new driver")
    await ex.close()
    ex.reconcile()
    assert not ex.driver_alive()  # a closed executor's driver stays down


# -- the in-flight table against the worker's heartbeats, and a failed send --------------------

@scenario
async def test_a_job_the_worker_received_and_no_longer_runs_is_lost():
    rig = Rig(target_inflight=2)
    await rig.start()
    lost, kept = rig.job(started=False), rig.job(started=False)
    assert rig.replica.free_slots == 0 and (lost.run.submit_seq, kept.run.submit_seq) == (1, 2)
    beat = lambda jobs, seen: rig.transport.deliver(  # noqa: E731
        rig.replica.identity, p.Heartbeat(inflight=len(jobs), jobs=jobs, submits_seen=seen))
    # beats the worker sent before it had the Submits (they waited in the socket while this
    # side was busy) say nothing about them, however many there are
    for _ in range(5):
        beat([], 0)
    beat([lost.id], 1)
    assert lost.state is kept.state is JobState.SUBMITTED
    # once the worker has had both, a job it no longer runs has sent its result or never will
    beat([kept.id], 2)
    error = outcome(lost)
    assert isinstance(error, PoolError) and error.code is ErrorCode.RUNTIME_ERROR
    assert kept.state is JobState.SUBMITTED and rig.replica.free_slots == 1
    # a job only the worker still runs is cancelled there
    beat([kept.id, "forgotten"], 2)
    assert (rig.replica.identity, p.Cancel(job="forgotten")) in rig.transport.sent
    await rig.replica.stop()


@scenario
async def test_a_submit_that_cannot_be_sent_is_requeued_and_its_worker_replaced():
    rig = Rig(target_inflight=2)
    proc = await rig.start()
    rig.transport.unregister(rig.replica.identity)  # sends to it fail (after this loop turn), as to a gone peer
    job, left = rig.job(started=False), rig.job(started=False)
    rig.replica.cancel(left)  # its client left before the failure was known: it ends, not runs again
    await settle(lambda: proc.tree_killed, "the unreachable worker killed")
    assert rig.owner.requeued == [job] and job.run.attempts == 0
    assert outcome(left).code is ErrorCode.INVALID_REQUEST
    assert rig.replica.state is not ReplicaState.READY and rig.replica.free_slots == 0  # out of rotation
    await rig.spawned(2)  # the crash path restarts it


def test_load_durations_are_cumulative_buckets_not_a_list():
    from supervisor.models.lifecycle import LOAD_BUCKETS, LoadDurations

    d = LoadDurations()
    for s in (0.05, 0.3, 0.3, 700.0):
        d.observe(s)
    counts = dict(zip(LOAD_BUCKETS, d.bucket_counts))
    assert (counts[0.1], counts[0.25], counts[0.5], counts[600]) == (1, 1, 3, 3)  # 700 s only in +Inf
    assert d.count == 4 and abs(d.total_s - 700.65) < 1e-9


def test_a_job_changes_state_only_along_its_table():
    """Every edge of JOB_TRANSITIONS is taken through Job.move_to; every other is refused,
    and a finished job stays finished."""
    from supervisor.states import JOB_TRANSITIONS, IllegalTransition

    for start, allowed in JOB_TRANSITIONS.items():
        for new in JobState:
            job = Job("m", {"messages": []}, timeout_s=10)
            job.state = start  # the starting point under test (a new job is QUEUED)
            if new is start or new in allowed:
                job.move_to(new)
                assert job.state is new
            else:
                with pytest.raises(IllegalTransition):
                    job.move_to(new)
                assert job.state is start
    job = Job("m", {"messages": []}, timeout_s=10)
    job.finish(PoolError(ErrorCode.QUEUE_TIMEOUT, "x"))
    job.finish(PoolError(ErrorCode.RUNTIME_ERROR, "y"))  # a second outcome is ignored, not a transition
    assert job.state is JobState.FINISHED and len(job.events) == 1
