"""The backend interface every runtime implements.

A backend owns exactly one runtime (a native server child, an in-process
model, or a remote endpoint). The worker calls, in order:

    capacity, info = await backend.start()     # load; raise BackendLoadError
    async for event in backend.run(job, request):   # one call per job, many at once
        ...                                    # TextDelta ... then one Finished
    await backend.stop()

Cancel: the worker cancels the task consuming `run()`, which raises
CancelledError inside the generator; a backend releases the job's runtime
resources (closes its HTTP stream, cancels the generator job) in `finally`.
"""

from __future__ import annotations

import abc
import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TextDelta:
    text: str


@dataclass(frozen=True, slots=True)
class Finished:
    finish_reason: str  # "stop" | "length"
    input_tokens: int
    output_tokens: int


@dataclass(frozen=True, slots=True)
class RawFrame:
    """Bytes the worker sends to the supervisor as they are. Only the synthetic
    backend's `chaos` option makes these, to test how the supervisor survives
    malformed frames from a real worker."""
    data: bytes


Event = TextDelta | Finished | RawFrame


class BackendLoadError(Exception):
    """The runtime could not start; the message is shown to the operator as is."""


class JobError(Exception):
    """One job failed inside the runtime; `code` is a protocol ErrorCode value."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class Backend(abc.ABC):
    name: str = "?"

    def __init__(self, options: dict, target_inflight: int, log: logging.Logger,
                 stop_timeout_s: float = 10.0) -> None:
        self.options = options
        self.target_inflight = target_inflight
        self.log = log
        self.stop_timeout_s = stop_timeout_s  # the model's stop_timeout_s: SIGTERM .. SIGKILL of a child

    @abc.abstractmethod
    async def start(self) -> tuple[int, dict]:
        """Load the runtime. Returns (honest capacity, info for the operator)."""

    @abc.abstractmethod
    def run(self, job: str, request: dict) -> AsyncIterator[Event]:
        """Run one job (`job` is its id): stream TextDelta events, end with exactly one Finished."""

    @abc.abstractmethod
    async def stop(self) -> None:
        """Release the runtime. Must return within a few seconds."""

    def runtime_pid(self) -> int | None:
        """The pid of a native runtime child (kept as `self.server`), for the
        cancel watch; None for runtimes inside the worker or remote."""
        server = getattr(self, "server", None)
        proc = getattr(server, "proc", None)
        return proc.pid if proc is not None and proc.returncode is None else None

    async def wait_dead(self) -> str:
        """Return (with a reason) if the runtime dies on its own, e.g. a native
        server child crashed. The worker then exits so the supervisor restarts it."""
        await asyncio.Event().wait()  # in-process runtimes die with the worker
        return ""
