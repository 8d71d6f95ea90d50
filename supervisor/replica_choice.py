"""Which replica takes the next job: one policy object per executor.

The executor asks `choose` whenever it has a job and some replica may have a
free slot; the policy sees the replicas and the job and answers one replica
with a free slot, or None. A policy that keeps per-replica state (what a
replica's cache holds) is told when a replica restarts (`forget`) and when a
job ends (`finished`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from supervisor.jobs import Job
from supervisor.replica import Replica


class ReplicaChoice(Protocol):
    def choose(self, replicas: Sequence[Replica], job: Job) -> Replica | None:
        """A replica with a free slot for `job`, or None if none has one."""

    def forget(self, replica: Replica) -> None:
        """The replica restarted or stopped: whatever was known of it is gone."""

    def finished(self, replica: Replica, job: Job) -> None:
        """`job` ended on `replica` (the answer's usage is on the job)."""


class LeastInflight:
    """Least occupancy (inflight / effective capacity), round-robin among equals."""

    def __init__(self) -> None:
        self._rr = 0  # the replica index a tie goes to first

    def choose(self, replicas: Sequence[Replica], job: Job) -> Replica | None:
        n = len(replicas)
        best, best_key = None, None
        for offset in range(n):  # scan from the round-robin cursor: ties go to the earliest
            r = replicas[(self._rr + offset) % n]
            if r.free_slots <= 0:
                continue
            key = len(r.inflight) / r.capacity
            if best_key is None or key < best_key:
                best, best_key = r, key
        if best is not None:
            self._rr = (best.index + 1) % n
        return best

    def forget(self, replica: Replica) -> None:
        pass

    def finished(self, replica: Replica, job: Job) -> None:
        pass


def make_replica_choice(routing: str = "least_inflight") -> ReplicaChoice:
    if routing == "least_inflight":
        return LeastInflight()
    raise ValueError(f"unknown routing {routing!r}")
