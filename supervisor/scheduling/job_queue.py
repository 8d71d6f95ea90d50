"""The order in which a model's waiting jobs are dispatched: one owner.

The executor asks its queue for the next job to hand to a replica; nothing
else reaches into the queue. Its one kind is the fair-share queue
(fair_queue.FairQueue): it chooses across tenants, and is FIFO within one."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Protocol

from supervisor.scheduling.jobs import Job


class JobQueue(Protocol):
    def push(self, job: Job) -> None:
        """A newly admitted job joins the queue."""

    def push_front(self, job: Job) -> None:
        """A job that was handed out and came back (its worker died before
        producing anything) goes ahead of the others it was admitted before."""

    def extend(self, jobs: Iterable[Job]) -> None:
        """Jobs carried over from an earlier queue of the same model, in their order."""

    def peek(self, eligible: Callable[[str], bool] | None = None) -> Job | None:
        """The next job to dispatch (the one `pop` returns next); None when empty. With
        `eligible`: the next among the jobs of the tenants it accepts (None: none of them waits)."""

    def pop(self, eligible: Callable[[str], bool] | None = None) -> Job | None:
        """The next job to dispatch (as `peek` chooses it), removed; None when there is none."""

    def remove(self, job: Job) -> bool:
        """Drop one job (its client left); False if it was not queued."""

    def take_all(self) -> list[Job]:
        """Empty the queue, returning its jobs in dispatch order."""

    def ahead(self, tenant: str, index: int | None = None) -> int:
        """About how many jobs go before the `index`th queued job of `tenant` (None: a new one)."""

    def position(self, job: Job) -> int | None:
        """`ahead` for a queued job; None when it is not queued."""

    def over_share(self, tenant: str, room: int) -> bool:
        """Whether `tenant` holds its share of `room` queued jobs or more."""

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[Job]: ...
