"""The in-flight table against the jobs a worker's heartbeats list: a lost job
ends and frees its slot; a job only the worker still runs is cancelled there.
The replica is driven directly, with a transport that records what it sends."""

from __future__ import annotations

import asyncio
from pathlib import Path

import protocol as p
from protocol.errors import ErrorCode, PoolError
from supervisor.config import ModelConfig, ServerConfig
from supervisor.jobs import Job, JobState
from supervisor.replica import Replica
from supervisor.states import ReplicaState


class RecordingTransport:
    endpoint = "ipc://unused"

    def __init__(self) -> None:
        self.sent: list[p.Message] = []

    def send(self, identity: str, msg: p.Message) -> bool:
        self.sent.append(msg)
        return True

    def send_frame(self, identity: str, frame: bytes) -> bool:
        self.sent.append(p.decode(frame))
        return True


class Owner:
    def __init__(self) -> None:
        self.changes = 0

    def replica_changed(self) -> None:
        self.changes += 1

    def requeue(self, job: Job) -> None:
        raise AssertionError("nothing is requeued here")


def ready_replica(tmp_path: Path) -> tuple[Replica, RecordingTransport, Owner]:
    transport, owner = RecordingTransport(), Owner()
    cfg = ModelConfig(name="m", backend="synthetic", target_inflight=2)
    replica = Replica(cfg, ServerConfig(), 0, transport, tmp_path, owner)
    replica.state, replica.capacity, replica.identity = ReplicaState.READY, 2, "m/0#1"
    return replica, transport, owner


def test_a_job_the_worker_received_and_no_longer_runs_is_lost(tmp_path):
    async def run() -> None:
        replica, transport, owner = ready_replica(tmp_path)
        lost, kept = Job("m", {"messages": []}, 60), Job("m", {"messages": []}, 60)
        replica.submit(lost)
        replica.submit(kept)
        assert replica.free_slots == 0 and (lost.submit_seq, kept.submit_seq) == (1, 2)
        # heartbeats the worker sent before it got the Submits (they waited in the socket
        # while this side was busy) say nothing about them, however many there are
        for _ in range(5):
            replica._on_message(p.Heartbeat(inflight=0, jobs=[], submits_seen=0))
        replica._on_message(p.Heartbeat(inflight=1, jobs=[lost.id], submits_seen=1))
        assert lost.state is kept.state is JobState.SUBMITTED
        # once the worker has had both, a job it no longer runs has sent its result or never will
        replica._on_message(p.Heartbeat(inflight=1, jobs=[kept.id], submits_seen=2))
        assert lost.state is JobState.FINISHED and kept.state is JobState.SUBMITTED
        error = lost.events[-1]
        assert isinstance(error, PoolError) and error.code is ErrorCode.RUNTIME_ERROR
        assert replica.free_slots == 1 and owner.changes >= 1
    asyncio.run(run())


def test_a_job_only_the_worker_still_runs_is_cancelled_there(tmp_path):
    async def run() -> None:
        replica, transport, _ = ready_replica(tmp_path)
        replica._on_message(p.Heartbeat(inflight=1, jobs=["forgotten"]))
        assert p.Cancel(job="forgotten") in transport.sent
    asyncio.run(run())
