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
                 "deadline", "cancel_requested")

    def __init__(self, model: str, request: dict, timeout_s: float) -> None:
        self.id = uuid.uuid4().hex
        self.model = model
        self.request = request
        self.state = JobState.QUEUED
        self.replica: Replica | None = None
        # Delta..., then exactly one Done or PoolError
        self.events: asyncio.Queue[Delta | Done | PoolError] = asyncio.Queue()
        self.created_at = time.monotonic()
        self.deadline = self.created_at + timeout_s
        self.cancel_requested = False

    def push(self, event: Delta) -> None:
        self.events.put_nowait(event)

    def finish(self, outcome: Done | PoolError) -> None:
        if self.state is not JobState.FINISHED:
            self.state = JobState.FINISHED
            self.events.put_nowait(outcome)

    async def next_event(self, on_timeout) -> Delta | Done:
        """The next delta or the Done; raises the job's PoolError. Waits at most
        until the job's deadline; then `on_timeout(self)` is called and 504 raised."""
        if self.events.empty():
            try:
                event = await asyncio.wait_for(self.events.get(), max(self.deadline - time.monotonic(), 0))
            except TimeoutError:
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
