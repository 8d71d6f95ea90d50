"""One inference request on its way through the pool.

A `Job` holds its identity (set when it is made: its constructor, and the engine's
`make_job` for `request_id` and `transcript`) and its token path (`push`, `finish`,
`next_event`: what each token touches, and its deadlines, which admission may only bring
closer). What the modules it passes through decide of it lives in three small records,
each written by one module alone and read by any (tests/test_job_records.py checks the
writers):

| record | what it says | its one writer |
|---|---|---|
| `job.admitted` (`Admitted`) | the session key, the prompt's token ids, the prediction, the TTFT deadline, the fallback chain | admission (`admission/admit.py`: its `Counted` is the record) |
| `job.routing` (`Routing`) | past the queue as a light call, why it waits | the executor (`scheduling/executor.py`) |
| `job.run` (`worker_link.Run`) | the replica holding it, when it was first handed over, its attempts, its Submit's number, a cancel asked, its runtime's tasks | the worker link (`replicas/worker_link.py`) |

A job no writer reached yet shares that record's default (`NOT_ADMITTED`, `NOT_ROUTED`,
`NOT_RUN`), which nothing writes: a new job makes no record, admission's record is the book
it keeps of each request anyway, and the executor's are a few shared values, so only the
link makes one per hand-over. Beside the records on the job, each with one writer: `meter`
(the fair queue) and `on_end` (admission), which the token path calls, and `counted`
(metrics)."""

from __future__ import annotations

import asyncio
import sys
import time
from random import getrandbits
from collections import deque
from typing import TYPE_CHECKING

import protocol as p
from protocol import Delta, Done
from protocol.errors import ErrorCode, PoolError
from protocol.choices import choice_limit
from supervisor.scheduling.deadlines import expired as slo_expired
from supervisor.replicas.worker_link import NOT_RUN, Run
from supervisor.request_bounds import clip
from supervisor.states import JOB_FINISHED, JOB_QUEUED, JOB_TRANSITIONS, JobState, transition

if TYPE_CHECKING:
    from supervisor.admission.fallback_chains import Chain
    from supervisor.scheduling.deadlines import Prediction


def encode_submit(job_id: str, request: dict, endpoint: str = "chat", headers: dict | None = None) -> bytes:
    """The job's Submit frame, encoded once at admission: a value msgpack
    cannot carry (an integer past 64 bits, a lone surrogate) is the client's
    400 naming the field, and a frame over the cap its 413, before the job
    takes a queue place or a slot."""
    try:
        frame = p.encode_submit(job_id, request, endpoint, headers)
    except (OverflowError, UnicodeEncodeError, TypeError, ValueError):
        try:
            where, why = p.find_unencodable(request) or ("", "a value that cannot be sent to the runtime")
        except RecursionError:
            where, why = "", "nested too deeply"
        where = clip(where)  # a field path holds the client's keys
        raise PoolError(ErrorCode.INVALID_REQUEST, f"{where or 'request'}: {why}", param=where or None) from None
    if len(frame) > p.MAX_FRAME_BYTES:
        raise PoolError(ErrorCode.REQUEST_TOO_LARGE, f"the request is {len(frame)} bytes once encoded for the "
                        f"runtime, over the {p.MAX_FRAME_BYTES} byte frame cap")
    return frame


DEFAULT_MAX_OUTPUT_BYTES = 64 * 2**20  # [server] max_job_output_bytes
DEFAULT_MAX_UNSENT_BYTES = 8 * 2**20  # [server] max_unsent_output_bytes

# What a Delta waiting in Job.events costs beyond its strings and parts, measured once with
# tracemalloc on deltas decoded from worker frames (CPython 3.11, 64-bit): the frozen slots
# object (56 bytes), its own copy of the job id (a 32-character str: 81), its parts list (56,
# empty) and its place in the deque (8). A token " alpha" so costs 256 bytes held: 40 times
# its text (max_job_output_bytes counts the text).
DELTA_HELD_BYTES = 200


def output_size(delta: Delta) -> int:
    """About the bytes a delta holds: its strings' lengths, and for logprobs
    every string, number and container in them (the bulk when a runtime sends
    many alternatives). Plain text, the token path, costs one len()."""
    size = len(delta.text)
    for part in delta.parts:
        size += 16 + len(part.get("t") or "") + len(part.get("args") or "") + len(part.get("name") or "")
        lp = part.get("lp", part.get("x"))  # logprobs, or a runtime's own fields (an "extra" part)
        if lp is not None:
            stack = [lp]
            while stack:
                value = stack.pop()
                if isinstance(value, str):
                    size += len(value) + 2
                elif isinstance(value, dict):
                    size += 2 + sum(len(k) + 3 for k in value if isinstance(k, str))
                    stack.extend(value.values())
                elif isinstance(value, list):
                    size += 2
                    stack.extend(value)
                else:
                    size += 9
    return size


def held_size(delta: Delta) -> int:
    """About the bytes a delta costs while it waits in a job: DELTA_HELD_BYTES, its text
    as sys.getsizeof sees it (O(1)), and every object of its parts (dict keys excepted:
    msgpack interns them). Plain text: within 1% of tracemalloc; typed parts: 15-30%
    over (small ints and the empty text, which CPython shares, count too)."""
    size = DELTA_HELD_BYTES + sys.getsizeof(delta.text)
    if delta.parts:
        size += sys.getsizeof(delta.parts)
        stack = list(delta.parts)
        while stack:
            value = stack.pop()
            size += sys.getsizeof(value)
            if type(value) is dict:
                stack.extend(value.values())
            elif type(value) is list:
                stack.extend(value)
    return size


class Admitted:
    """What admission decided for a job. Its one writer is admission (admission/admit.py):
    the record is its `Counted`, the book of one admitted request, filled while
    `Admission.admit` runs; nothing changes it once the job is queued. Read by the replica
    choice (`session`, `prompt_tokens`), the executor and `Job.expired` (`slo_*`), the
    answer's headers and the predictor's rows (`prediction`), the request log (`chain`)."""

    __slots__ = ("session", "prompt_tokens", "prediction", "slo_ttft_ms", "slo_deadline", "chain")

    def __init__(self) -> None:
        self.session: str | None = None  # a session key from the client's headers (X-Claude-Code-Session-Id)
        self.prompt_tokens: list[int] | None = None  # the prompt as the runtime's token ids, when the pool asked it
        self.prediction: Prediction | None = None  # its queue wait and TTFT predicted at admission
        self.slo_ttft_ms: float | None = None  # its TTFT deadline, as asked or configured (deadlines.py)
        self.slo_deadline: float | None = None  # monotonic: queued past it, it leaves (deadlines.py)
        self.chain: Chain | None = None  # the models its request tried before this one (fallback_chains)


class Routing:
    """How the queue handed a job out. Its one writer is the executor (scheduling/executor.py),
    which gives a job another record rather than change one: these are values, so the
    executor's few are shared by every job they describe. Read by the executor and the worker
    link (`light`: its slots count without it), and `next_event` (`queue_reason`)."""

    __slots__ = ("light", "queue_reason")

    def __init__(self, light: bool = False, queue_reason: PoolError | None = None) -> None:
        self.light = light  # handed over past the queue as a light call: it takes no generation slot
        self.queue_reason = queue_reason  # why it waits, when not for a slot (e.g. memory)


NOT_ADMITTED = Admitted()  # a job no admission made (tests, benches): admission's decisions, none taken
NOT_ROUTED = Routing()  # in the queue, or handed to a slot: nothing more to say


class Job:
    __slots__ = ("id", "model", "request", "endpoint", "frame", "tenant", "request_id", "created_at", "state",
                 "events", "_waiter", "_timer", "_timer_at", "deadline", "queue_deadline", "first_token_at",
                 "max_choices", "max_output_bytes", "output_bytes", "max_unsent_bytes", "unsent_bytes",
                 "transcript", "meter", "on_end", "counted", "admitted", "routing", "run")

    def __init__(self, model: str, request: dict, timeout_s: float, queue_timeout_s: float | None = None,
                 endpoint: str = "chat", max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES,
                 tenant: str = "default", max_unsent_bytes: int = DEFAULT_MAX_UNSENT_BYTES,
                 headers: dict | None = None) -> None:
        # as unique as uuid4; not a secret, so no system call; 32 hex digits (to_bytes: about a
        # third of a format spec's time, on every request's path)
        self.id = getrandbits(128).to_bytes(16, "big").hex()
        self.model = model
        self.request = request
        self.endpoint = endpoint  # protocol.ENDPOINTS
        # `headers`: for the runtime's own route (capabilities.forwarded_headers), in the frame only
        self.frame = encode_submit(self.id, request, endpoint, headers)  # a request that cannot travel fails here, owning nothing
        self.tenant = tenant  # who asked (admission); its queue lane and share
        self.request_id: str | None = None  # its answer's x-request-id (set by the engine), for ops
        self.state = JOB_QUEUED
        # Delta..., then exactly one Done or PoolError; one reader (the HTTP handler), which
        # waits on `_waiter`: cheaper per token than an asyncio.Queue under wait_for
        self.events: deque[Delta | Done | PoolError] = deque()
        self._waiter: asyncio.Future | None = None
        self._timer: asyncio.TimerHandle | None = None  # wakes the waiter at the next deadline (see _arm_timer)
        self._timer_at = 0.0  # loop time
        self.created_at = time.monotonic()
        # its deadlines; admission may only bring them closer (a TTFT deadline, its fallback chain's)
        self.deadline = self.created_at + timeout_s
        self.queue_deadline = self.created_at + queue_timeout_s if queue_timeout_s else None
        self.first_token_at: float | None = None  # monotonic; None: nothing reached the client yet
        # What a runtime may send for it: choice indexes below max_choices (the request's n), and
        # max_output_bytes in all (held here, collected for a whole answer, or sent on)
        self.max_choices = choice_limit(request, endpoint)
        self.max_output_bytes = max_output_bytes
        self.output_bytes = 0
        # What it holds that its reader is not waiting for (held_size of those deltas): a stream
        # whose client stopped reading leaves its handler stuck in a write while the deltas pile
        # up here. Past max_unsent_bytes the job ends (_drop_unsent). A reader waiting in
        # next_event takes all waiting deltas when it wakes: what comes meanwhile is not counted
        # (a whole answer, collected as it comes, is never hit).
        self.max_unsent_bytes = max_unsent_bytes
        self.unsent_bytes = 0
        self.transcript: list[str] | None = None  # the output, kept only for a model with log_bodies (the engine)
        self.meter = None  # charges its tokens to its tenant as they come (fair_queue.TokenMeter), once handed out
        self.on_end = None  # on_end(job, outcome) once it ends, however (admission: the tenant's limits)
        self.counted = False  # its outcome is in the metrics and the request log (Metrics.request)
        self.admitted: Admitted = NOT_ADMITTED
        self.routing: Routing = NOT_ROUTED
        self.run: Run = NOT_RUN

    def expired(self, now: float) -> bool:
        """Its TTFT deadline has passed (a queued job then leaves the queue: `next_event`, and the
        executor never hands it to a slot)."""
        deadline = self.admitted.slo_deadline
        return deadline is not None and now >= deadline

    def push(self, event: Delta) -> None:
        if self.state is JOB_FINISHED:  # e.g. ended over its bounds, its Cancel on the way: nobody reads it
            return
        if event.parts:
            for part in event.parts:
                if part.get("i", 0) >= self.max_choices:
                    return self._refuse(self._bad_index(part.get("i", 0)))
            self.output_bytes += output_size(event)
        else:  # plain text: the token path
            self.output_bytes += len(event.text)
        if self.output_bytes > self.max_output_bytes:
            return self._refuse(PoolError(ErrorCode.RUNTIME_ERROR, f"the runtime's answer is over the "
                                          f"{self.max_output_bytes} bytes one request may produce "
                                          f"(max_job_output_bytes)"), protocol=False)
        if self.first_token_at is None:
            self.first_token_at = time.monotonic()
        if self.meter is not None:
            self.meter.delta(event.tokens)
        if self._waiter is None:  # no reader waits to take it: held until the handler comes back
            self.unsent_bytes += held_size(event)
            if self.unsent_bytes > self.max_unsent_bytes:
                return self._drop_unsent()
        if self.transcript is not None:  # text of every kind and choice, tool-call names and arguments
            self.transcript.extend(part.get("t") or (part.get("name") or "") + (part.get("args") or "")
                                   for part in p.delta_parts(event))
        self._put(event)

    def _drop_unsent(self) -> None:
        """Its reader has not taken its output for too long (a client that does not read
        its stream): what it holds is dropped (the memory goes back), the job ends with
        504 (an error event, should the client read again) and its worker stops it."""
        held = self.unsent_bytes
        self.events.clear()  # only deltas: the job has not finished
        self.unsent_bytes = 0
        self._refuse(PoolError(ErrorCode.RUNTIME_TIMEOUT, f"the client did not read its answer: {held} bytes of "
                               f"it waited unsent, over the {self.max_unsent_bytes} bytes a request may hold "
                               f"unsent (max_unsent_output_bytes)"), protocol=False)

    def _bad_index(self, index) -> PoolError:
        return PoolError(ErrorCode.PROTOCOL_ERROR, f"malformed reply from the runtime: choice index {index} "
                         f"for a request of {self.max_choices} choice(s)")

    def _refuse(self, error: PoolError, protocol: bool = True) -> None:
        """The runtime sent what this job may not hold: the job ends with `error`, and
        its worker is asked to stop it (the slot stays busy until the worker confirms).
        Nothing of the offending delta is kept."""
        replica = self.run.replica
        self.finish(error)
        if replica is not None:
            replica.cancel(self, malformed=protocol)  # a malformed reply counts in its protocol_errors

    def move_to(self, new: JobState) -> None:
        """The one way a job's state changes (states.JOB_TRANSITIONS)."""
        self.state = transition(JOB_TRANSITIONS, self.state, new)

    def finish(self, outcome: Done | PoolError) -> None:
        if isinstance(outcome, Done) and len(outcome.finish_reasons) > self.max_choices:
            outcome = self._bad_index(len(outcome.finish_reasons) - 1)
        if self.state is not JOB_FINISHED:
            self.move_to(JOB_FINISHED)
            if self.meter is not None and isinstance(outcome, Done):
                self.meter.done(outcome.usage)
            if self.on_end is not None:
                self.on_end(self, outcome)
            self._put(outcome)
            if self._timer is not None:  # nothing more to wait for: the loop lets go of the job now
                self._timer.cancel()
                self._timer = None

    def _arm_timer(self, loop: asyncio.AbstractEventLoop, at: float) -> None:
        """Make sure the waiter wakes by loop time `at`. One timer serves many
        waits: a wait whose deadline is no earlier than the armed one keeps it
        (waking early is harmless: next_event checks the deadlines on every
        wake-up and waits again), so a stream costs a timer per idle period,
        not one per token."""
        if self._timer is None or self._timer_at > at:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = loop.call_at(at, self._on_timer)
            self._timer_at = at

    def _on_timer(self) -> None:
        self._timer = None
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _put(self, event: Delta | Done | PoolError) -> None:
        self.events.append(event)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def next_event(self, on_timeout, idle_s: float | None = None) -> Delta | Done | None:
        """The next delta (all deltas that are waiting, merged) or the Done;
        raises the job's PoolError. Waits at most until the job's deadline;
        then `on_timeout(self)` is called and 504 raised. With `idle_s`, returns
        None when nothing came for that long (time for a keep-alive ping)."""
        idle_until = time.monotonic() + idle_s if idle_s else None
        while not self.events:
            now = time.monotonic()
            until = self.deadline
            if self.state is JOB_QUEUED and self.queue_deadline:
                if now >= self.queue_deadline:
                    on_timeout(self)
                    if self.expired(now):
                        raise slo_expired(self.model, self.admitted.slo_ttft_ms)
                    if self.routing.queue_reason is not None:
                        raise self.routing.queue_reason
                    raise PoolError(ErrorCode.QUEUE_TIMEOUT, "the request waited in the queue longer "
                                    "than queue_timeout_s", retry_after_s=1)
                until = min(until, self.queue_deadline)
            if now >= self.deadline:
                on_timeout(self)
                raise PoolError(ErrorCode.RUNTIME_TIMEOUT, "the runtime did not finish the request within its deadline")
            if idle_until is not None:
                if now >= idle_until:
                    return None
                until = min(until, idle_until)
            loop = asyncio.get_running_loop()
            self._arm_timer(loop, loop.time() + (until - now))
            self._waiter = waiter = loop.create_future()
            try:
                await waiter
            finally:
                self._waiter = None
        event = self.events.popleft()
        if isinstance(event, PoolError):
            raise event
        self.unsent_bytes = 0  # a delta taken takes all the deltas waiting (below), and only deltas count
        if isinstance(event, Delta) and self.events and isinstance(self.events[0], Delta):
            # the client fell behind: what has piled up goes out as one delta (plain text
            # joined at once; typed parts in order, see protocol.merge_deltas)
            if not event.parts:
                texts, tokens = [event.text], event.tokens
                while self.events and isinstance(self.events[0], Delta) and not self.events[0].parts:
                    taken = self.events.popleft()
                    texts.append(taken.text)
                    tokens += taken.tokens
                event = Delta(job=event.job, text="".join(texts), tokens=tokens)
            while self.events and isinstance(self.events[0], Delta):
                event = p.merge_deltas(event, self.events.popleft())
        return event

