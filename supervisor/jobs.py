"""One inference request on its way through the pool."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from enum import StrEnum
from typing import TYPE_CHECKING

from protocol import Delta, Done
from protocol.errors import ErrorCode, PoolError

if TYPE_CHECKING:
    from supervisor.replica import Replica


class JobState(StrEnum):
    QUEUED = "queued"  # in the executor's FIFO; the scheduler may still drop it
    SUBMITTED = "submitted"  # handed to a worker: past the cancel boundary, counts as inflight
    FINISHED = "finished"


class Job:
    __slots__ = ("id", "model", "request", "state", "replica", "events", "created_at",
                 "deadline", "queue_deadline", "cancel_requested", "first_token_at", "attempts")

    def __init__(self, model: str, request: dict, timeout_s: float, queue_timeout_s: float | None = None) -> None:
        self.id = uuid.uuid4().hex
        self.model = model
        self.request = request
        self.state = JobState.QUEUED
        self.replica: Replica | None = None
        # Delta..., then exactly one Done or PoolError
        self.events: asyncio.Queue[Delta | Done | PoolError] = asyncio.Queue()
        self.created_at = time.monotonic()
        self.deadline = self.created_at + timeout_s
        self.queue_deadline = self.created_at + queue_timeout_s if queue_timeout_s else None
        self.cancel_requested = False
        self.first_token_at: float | None = None  # monotonic; None: nothing reached the client yet
        self.attempts = 0  # submissions to a worker

    def push(self, event: Delta) -> None:
        if self.first_token_at is None:
            self.first_token_at = time.monotonic()
        self.events.put_nowait(event)

    def finish(self, outcome: Done | PoolError) -> None:
        if self.state is not JobState.FINISHED:
            self.state = JobState.FINISHED
            self.events.put_nowait(outcome)

    async def next_event(self, on_timeout) -> Delta | Done:
        """The next delta or the Done; raises the job's PoolError. Waits at most
        until the job's deadline; then `on_timeout(self)` is called and 504 raised."""
        while self.events.empty():
            now = time.monotonic()
            until = self.deadline
            if self.state is JobState.QUEUED and self.queue_deadline:
                until = min(until, self.queue_deadline)
            try:
                event = await asyncio.wait_for(self.events.get(), max(until - now, 0))
                break
            except TimeoutError:
                if self.state is JobState.QUEUED and self.queue_deadline and time.monotonic() >= self.queue_deadline:
                    on_timeout(self)
                    raise PoolError(ErrorCode.QUEUE_TIMEOUT, "the request waited in the queue longer "
                                    "than queue_timeout_s", retry_after_s=1) from None
                if time.monotonic() >= self.deadline:
                    on_timeout(self)
                    raise PoolError(ErrorCode.RUNTIME_TIMEOUT,
                                    "the runtime did not finish the request within its deadline") from None
        else:
            event = self.events.get_nowait()
        if isinstance(event, PoolError):
            raise event
        return event

    async def stream(self, on_timeout) -> AsyncIterator[Delta | Done]:
        """Yield deltas, then the Done (see next_event)."""
        while True:
            event = await self.next_event(on_timeout)
            yield event
            if isinstance(event, Done):
                return
