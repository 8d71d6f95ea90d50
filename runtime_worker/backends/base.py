"""The backend interface every runtime implements.

A backend owns exactly one runtime (a native server child, an in-process
model, or a remote endpoint). The worker calls, in order:

    capacity, info = await backend.start()     # load; raise BackendLoadError
    backend.check(endpoint, request)           # per job: raise JobError for what it cannot honour
    async for event in backend.run(job, request):   # one call per job, many at once
        ...                                    # TextDelta/PartsDelta ... then one Finished
    await backend.stop()

`run` serves chat completions; `complete` legacy completions, `embed`
embeddings, `messages` Anthropic messages on the runtime's own route, and
`call` the runtime's own calls (tokenize, rerank, ...), for backends that list
those in `endpoints`. `request` is the
client's OpenAI body less the fields the pool owns (model, stream,
stream_options). A backend with an OpenAI server passes it on whole
(`honours` None); any other declares in `honours` the fields it acts on, and
`check` refuses the rest with 400 unsupported_parameter: never a silent drop.

Cancel: the worker cancels the task consuming `run()`, which raises
CancelledError inside the generator; a backend releases the job's runtime
resources (closes its HTTP stream, cancels the generator job) in `finally`.
"""

from __future__ import annotations

import abc
import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from runtime_worker.warm_swap import WarmSwap


@dataclass(frozen=True, slots=True)
class TextDelta:
    """Content text of choice 0: the common, cheap case. `tokens`: the output tokens
    it carries, as the runtime counted them (else one: a runtime event per token)."""
    text: str
    tokens: int = 1


@dataclass(frozen=True, slots=True)
class PartsDelta:
    """Typed output parts in order (see protocol.messages.Delta); `tokens` as TextDelta's."""
    parts: list
    tokens: int = 1


@dataclass(frozen=True, slots=True)
class Finished:
    finish_reason: str  # choice 0's: "stop" | "length" | "tool_calls" | "content_filter" | ...
    input_tokens: int
    output_tokens: int
    finish_reasons: tuple = ()  # per choice, when there are several
    result: dict | None = None  # a non-streamed answer (embeddings)
    cached_tokens: int | None = None  # of input_tokens, served from the runtime's prompt cache (None: not said)
    reasoning_tokens: int = 0  # of output_tokens, spent reasoning
    timings: dict | None = None  # the runtime's own phase timings (protocol.runtime_timings), when it gives them
    extra: dict | None = None  # the runtime's own top-level fields of its closing chunks or answer (Done.extra)
    usage_on_finish: bool = False  # it sent usage on its finish chunk, unasked (Done.usage_on_finish)


@dataclass(frozen=True, slots=True)
class RawFrame:
    """Bytes the worker sends to the supervisor as they are. Only the synthetic
    backend's `chaos` option makes these, to test how the supervisor survives
    malformed frames from a real worker."""
    data: bytes


@dataclass(frozen=True, slots=True)
class RuntimeTasks:
    """The runtime's own tasks that serve this job, as (slot, task id) pairs (llama-server's
    `id N | task T` in its log lines), once the backend knows them for sure: the worker
    sends them at once, on a Delta of their own (protocol Delta.tasks)."""
    tasks: tuple


Event = TextDelta | PartsDelta | Finished | RawFrame | RuntimeTasks


@dataclass(frozen=True, slots=True)
class OutputLimits:
    """Bounds on what one job may bring into the worker ([server] keys of the
    same names): `max_job_output_bytes`, all of a job's output (for an OpenAI
    server: its answer's body, decompressed); `max_upstream_line_bytes`, one
    line of a streamed answer. Past either, that job fails with runtime_error."""
    max_job_output_bytes: int = 64 * 1024 * 1024
    max_upstream_line_bytes: int = 8 * 1024 * 1024


class BackendLoadError(Exception):
    """The runtime could not start; the message is shown to the operator as is."""


class JobError(Exception):
    """One job failed inside the runtime; `code` is a protocol ErrorCode value."""

    def __init__(self, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param


# Values that ask for nothing beyond the default: a field sent with one is no request to honour.
NEUTRAL = {"n": 1, "logprobs": False, "echo": False, "parallel_tool_calls": True, "presence_penalty": 0,
           "frequency_penalty": 0, "stream": False}
_ENDPOINT_PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions", "embeddings": "/v1/embeddings",
                   "tokenize": "/tokenize", "detokenize": "/detokenize", "apply_template": "/apply-template",
                   "rerank": "/v1/rerank", "count_tokens": "/v1/messages/count_tokens", "messages": "/v1/messages",
                   "input_tokens": "/v1/chat/completions/input_tokens"}
# The runtime's own calls (protocol.ENDPOINTS after the first three): each answered whole, by `call`
CALLS = frozenset({"tokenize", "detokenize", "apply_template", "rerank", "count_tokens", "input_tokens"})


class Backend(abc.ABC):
    name: str = "?"
    endpoints: frozenset[str] = frozenset({"chat"})  # protocol.ENDPOINTS it serves
    honours: frozenset[str] | None = None  # request fields it acts on; None: all (an OpenAI server judges)

    def __init__(self, options: dict, target_inflight: int, log: logging.Logger,
                 stop_timeout_s: float = 10.0, limits: OutputLimits = OutputLimits()) -> None:
        self.options = options
        self.limits = limits
        self.target_inflight = target_inflight
        self.log = log
        self.stop_timeout_s = stop_timeout_s  # the model's stop_timeout_s: SIGTERM .. SIGKILL of a child
        # where a runtime that reports its prefix cache sends those events (protocol.KvEvents): (events, reset)
        self.kv_events_sink: Callable[[list, bool], None] | None = None
        # where a runtime that can save its KV keeps it across planned stops (Setup.warm_swap); None: off
        self.warm_swap: WarmSwap | None = None

    @abc.abstractmethod
    async def start(self) -> tuple[int, dict]:
        """Load the runtime. Returns (honest capacity, info for the operator)."""

    @abc.abstractmethod
    def run(self, job: str, request: dict) -> AsyncIterator[Event]:
        """Run one job (`job` is its id): stream TextDelta events, end with exactly one Finished.
        An async generator (the worker closes it with aclose when the job ends, however)."""

    def complete(self, job: str, request: dict) -> AsyncIterator[Event]:
        """A legacy text completion (endpoint "completions")."""
        raise JobError("unsupported_endpoint", f"the {self.name} backend does not serve /v1/completions")

    def embed(self, job: str, request: dict) -> AsyncIterator[Event]:
        """Embeddings (endpoint "embeddings"): one Finished carrying `result`."""
        raise JobError("unsupported_endpoint", f"the {self.name} backend does not serve /v1/embeddings")

    def job(self, endpoint: str, job: str, request: dict, headers: dict | None = None) -> AsyncIterator[Event]:
        """One job's events, by its endpoint (checked by `check` first)."""
        if endpoint == "chat":
            return self.run(job, request)
        if endpoint == "completions":
            return self.complete(job, request)
        if endpoint == "embeddings":
            return self.embed(job, request)
        if endpoint == "messages":
            return self.messages(job, request, headers)
        return self.call(endpoint, job, request, headers)

    def messages(self, job: str, request: dict, headers: dict | None = None) -> AsyncIterator[Event]:
        """An Anthropic Messages request on the runtime's own route (endpoint "messages"; the
        supervisor translates to chat for a backend without one)."""
        raise JobError("unsupported_endpoint", f"the {self.name} backend does not serve /v1/messages")

    def call(self, endpoint: str, job: str, request: dict, headers: dict | None = None) -> AsyncIterator[Event]:
        """One of the runtime's own calls (CALLS, for backends that list it in `endpoints`):
        one Finished carrying the runtime's answer as `result`."""
        raise JobError("unsupported_endpoint", f"the {self.name} backend does not serve {_ENDPOINT_PATHS[endpoint]}")

    def check(self, endpoint: str, request: dict) -> None:
        """Refuse, before any work, an endpoint or a field this backend cannot honour."""
        if endpoint not in self.endpoints:
            raise JobError("unsupported_endpoint",
                           f"the {self.name} backend does not serve {_ENDPOINT_PATHS.get(endpoint, endpoint)}")
        if self.honours is None or endpoint in CALLS:  # a call's own fields are the call's to judge
            return
        for key, value in request.items():
            if key in self.honours or value is None or value in ([], {}, "") or NEUTRAL.get(key, ...) == value:
                continue
            raise JobError("unsupported_parameter", f"{key!r} is not supported by the {self.name} backend",
                           param=key)

    async def save_kv(self) -> dict | None:
        """Before a planned stop: save what the runtime can restore after its next start (warm
        swaps); None for a runtime that cannot. Bounded by the worker."""
        return None

    @abc.abstractmethod
    async def stop(self) -> None:
        """Release the runtime. Must return within a few seconds."""

    def runtime_pid(self) -> int | None:
        """The pid of a native runtime child (kept as `self.server`), for the
        cancel watch; None for runtimes inside the worker or remote."""
        server = getattr(self, "server", None)
        proc = getattr(server, "proc", None)
        return proc.pid if proc is not None and proc.returncode is None else None

    def runtime_exit_code(self) -> int | None:
        """A native runtime child's exit code once it exited (negative: the signal that ended
        it), for the supervisor to show instead of the worker's own; None otherwise."""
        proc = getattr(getattr(self, "server", None), "proc", None)
        return proc.returncode if proc is not None else None

    async def wait_dead(self) -> str:
        """Return (with a reason) if the runtime dies on its own, e.g. a native
        server child crashed. The worker then exits so the supervisor restarts it."""
        await asyncio.Event().wait()  # in-process runtimes die with the worker
        return ""
