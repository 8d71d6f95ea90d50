"""The worker's one sender: every message to the supervisor goes through one
FIFO drained by one task. What is ready at one wake-up leaves as one frame
(a msgpack array, protocol.encode_batch), whichever jobs it belongs to: one
send and one receive per wake-up, not one per job.

Deltas of the same job that pile up while the sender waits (the event loop is
busy running a backend that produces tokens faster than they are sent) leave
as one frame, so fast runtimes cost one frame per wake-up, not one per token.
A slow runtime's tokens still leave one by one, as soon as they exist: nothing
is held back to wait for company. Order per job is kept; a job's Done or Error
is never merged and never overtakes its deltas. Typed parts (reasoning, tool
calls, other choices) keep their order: only adjacent runs of one kind of
text of one choice are joined (protocol.merge_deltas)."""

from __future__ import annotations

import asyncio
import logging

import protocol as p
from protocol.errors import ErrorCode
from protocol.loop_socket import LoopSocket

log = logging.getLogger("runtime_worker")

MERGE_LIMIT_CHARS = 64 * 1024  # well under the frame cap, whatever the encoding
BATCH_LIMIT_BYTES = p.MAX_FRAME_BYTES // 2  # a batch's messages together; one bigger message goes alone


def coalesce(batch: list[p.Message | bytes]) -> list[p.Message | bytes]:
    """Merge consecutive (per job) deltas; everything else passes as is. A run of
    plain-text deltas is joined once at the end (not a new Delta per token)."""
    out: list[p.Message | bytes] = []
    open_delta: dict[str, int] = {}  # job -> index in `out` of its delta still open for merging
    sizes: dict[int, int] = {}  # index in `out` -> p.delta_size of what it holds (texts included)
    texts: dict[int, list[str]] = {}  # index in `out` -> its plain-text run, joined at the end
    counts: dict[int, int] = {}  # index in `out` -> the tokens its plain-text run carries
    for item in batch:
        if isinstance(item, p.Delta) and not item.tasks:  # one that says the job's tasks goes as it is
            at = open_delta.get(item.job)
            if at is not None and sizes[at] + (size := p.delta_size(item)) <= MERGE_LIMIT_CHARS:
                run = texts.get(at)
                if run is not None and not item.parts:
                    run.append(item.text)
                    counts[at] = min(p.MAX_DELTA_TOKENS, counts[at] + item.tokens)
                    sizes[at] += size
                else:
                    if run is not None:
                        out[at] = p.Delta(job=item.job, text="".join(texts.pop(at)), tokens=counts.pop(at))
                    out[at] = p.merge_deltas(out[at], item)
                    sizes[at] = p.delta_size(out[at])
                continue
            at = open_delta[item.job] = len(out)
            sizes[at] = p.delta_size(item)
            if not item.parts:
                texts[at] = [item.text]
                counts[at] = item.tokens
        elif isinstance(item, bytes):
            open_delta.clear()  # a raw frame (fault injection) is opaque: keep every order
        elif (job := getattr(item, "job", None)) is not None:
            open_delta.pop(job, None)
        out.append(item)
    for at, run in texts.items():
        if len(run) > 1:
            out[at] = p.Delta(job=out[at].job, text="".join(run), tokens=counts[at])
    return out


def encode_or_fail(msg: p.Message, on_job_failed=None) -> bytes:
    """Encode a message; one that cannot be encoded (a runtime's JSON with a
    lone surrogate, say) or that is over the frame cap (a huge Done) becomes
    its job's Error, so that job fails with 502 (and `on_job_failed(job)` stops
    it) while the worker and its other jobs go on."""
    try:
        frame = p.encode(msg)
        if len(frame) <= p.MAX_FRAME_BYTES:
            return frame
        # the supervisor refuses a frame over the cap without knowing its job: fail the job here
        raise ValueError(f"a {len(frame)} byte message, over the {p.MAX_FRAME_BYTES} byte frame cap")
    except (OverflowError, UnicodeEncodeError, TypeError, ValueError) as exc:
        job = getattr(msg, "job", None)
        log.error("cannot encode a %s message for job %s: %r", msg.TYPE, job, exc)
        if on_job_failed is not None and job is not None:
            on_job_failed(job)
        if job is None:
            return p.encode(p.Error(job=None, code=ErrorCode.PROTOCOL_ERROR,
                                    message=f"the worker could not encode a {msg.TYPE} message"))
        return p.encode(p.Error(job=job, code=ErrorCode.RUNTIME_ERROR, message=(
            f"the runtime sent output that cannot be passed on ({type(exc).__name__}: {exc})")))


class _TextRun:
    """Plain text of one job, put token by token (put_text) and sent as one Delta: a
    token costs a list append, not a message."""

    __slots__ = ("job", "texts", "chars", "tokens")

    def __init__(self, job: str) -> None:
        self.job = job
        self.texts: list[str] = []
        self.chars = 0
        self.tokens = 0  # the output tokens its texts carry

    def delta(self) -> p.Delta:
        return p.Delta(job=self.job, text="".join(self.texts), tokens=self.tokens)


class Outbox:
    def __init__(self, sock: LoopSocket, on_job_failed=None) -> None:
        self.sock = sock
        self.on_job_failed = on_job_failed  # called with a job id whose message could not be encoded
        self._items: list[p.Message | bytes | _TextRun] = []
        self._open_runs: dict[str, _TextRun] = {}  # job -> its text run still taking tokens (in _items)
        self._wake = asyncio.Event()
        self._empty = asyncio.Event()
        self._empty.set()

    def put(self, item: p.Message | bytes) -> None:
        """Queue a message (or an already encoded frame); never blocks."""
        if isinstance(item, bytes):
            self._open_runs.clear()  # a raw frame (fault injection) is opaque: nothing joins across it
        elif (job := getattr(item, "job", None)) is not None:
            self._open_runs.pop(job, None)  # the job's later text comes after this message
        self._items.append(item)
        self._empty.clear()
        self._wake.set()

    def put_text(self, job: str, text: str, tokens: int = 1) -> None:
        """Queue plain content text of a job's choice 0, `tokens` output tokens (what
        `put(Delta(job, text, tokens=tokens))` does, joined to the job's text queued
        since its last other message)."""
        run = self._open_runs.get(job)
        if run is None or run.chars + len(text) > MERGE_LIMIT_CHARS:
            run = self._open_runs[job] = _TextRun(job)
            self._items.append(run)
            self._empty.clear()
            self._wake.set()
        run.texts.append(text)
        run.chars += len(text)
        run.tokens = min(p.MAX_DELTA_TOKENS, run.tokens + tokens)  # a joined count stays a valid one

    async def run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            batch, self._items = self._items, []
            self._open_runs.clear()
            batch = [item.delta() if type(item) is _TextRun else item for item in batch]
            frames: list[bytes] = []
            size = 0
            for item in coalesce(batch):
                if isinstance(item, bytes):  # a raw frame (fault injection) travels alone, as it is
                    if frames:
                        await self.sock.send([p.encode_batch(frames)])
                        frames, size = [], 0
                    await self.sock.send([item])
                    continue
                frame = encode_or_fail(item, self.on_job_failed)
                if frames and size + len(frame) > BATCH_LIMIT_BYTES:
                    await self.sock.send([p.encode_batch(frames)])
                    frames, size = [], 0
                frames.append(frame)
                size += len(frame)
            if frames:
                await self.sock.send([p.encode_batch(frames)])
            if not self._items:
                self._empty.set()

    async def flush(self, timeout_s: float) -> None:
        """Wait (bounded) until everything put so far has been handed to the socket."""
        try:
            await asyncio.wait_for(self._empty.wait(), timeout_s)
        except TimeoutError:
            pass
