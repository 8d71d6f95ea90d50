"""A native OpenAI-compatible server launched as the worker's child
(llama-server, vllm serve): start it on a free loopback port with a random
key, relay its output to the worker's log while keeping a tail for error
messages, wait for readiness, pass the client's requests to it, stop it."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import logging
import os
import re
import secrets
import signal
import sys
import time
import zlib
from collections.abc import AsyncIterator
from contextlib import aclosing

import aiohttp
import httpx

from procutil.groups import signal_group, stop_group
from procutil.net import free_port
from protocol.choices import MAX_CHOICES, choice_limit
from protocol.errors import ErrorCode, exit_text
from protocol.messages import EXTRA_OWNED, MAX_EXTRA_BYTES, OPEN_FIELDS, TIMING_MAX, runtime_extra, runtime_timings
from protocol.redact import mask_url_credentials
from runtime_worker.backends.base import (
    Backend, BackendLoadError, Event, Finished, JobError, OutputLimits, PartsDelta, TextDelta)
from runtime_worker.lifeline import lifeline_argv


RELAY_CHUNK_BYTES = 64 * 1024
RELAY_LINE_BYTES = 16 * 1024  # a longer line of the child's output is split in the log
STALE_RETRIES = 3  # keep-alive clients: resends after a connection error before any answer
MAX_TOOL_CALLS = 1024  # a tool call index in one choice is below this
INFLATE_PIECE_BYTES = 256 * 1024  # a compressed answer is inflated this much at a time
ERROR_BODY_BYTES = 64 * 1024  # an error answer is read this far for its message
ERROR_TEXT_CHARS = 4096  # a runtime's error message is passed on this long at most


class OpenAIClient:
    """Talks to an OpenAI-compatible server: chat and legacy completions
    streamed, embeddings whole. `base_url` ends before /chat/completions (e.g.
    http://127.0.0.1:8080/v1). Every request body is the client's, with the
    model name the server knows (`model`, if it needs one) and, for chat and
    legacy completions, the model's options.extra_body under it (the client's
    fields win); streaming to the server is the pool's: always on, with usage.

    aiohttp, not httpx, on this path: its C parsers cost a fraction of httpx's
    per request and per streamed chunk (scripts/bench, section 1).
    `keep_alive`: reuse connections (a remote endpoint, where a new TLS
    connection per job is dear). llama-server announces keep-alive but closes
    a connection after a stream, racing the next request, so local runtimes
    get a fresh connection per job.

    The server's answer is not trusted (UpstreamBody, sse_data): its body is
    read within `limits` (decompressed by the pool, in bounded pieces), a
    redirect is not followed, and a stream must be an event stream that ends
    with a finish_reason and [DONE]; anything else fails that job alone."""

    def __init__(self, base_url: str, api_key: str | None, keep_alive: bool = False, *,
                 model: str | None = None, extra: dict | None = None,
                 limits: OutputLimits = OutputLimits()) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.extra = extra or {}
        self.limits = limits
        # identity asked for; gzip or deflate sent anyway is inflated by UpstreamBody, within the budget
        self.headers = {"Accept-Encoding": "identity"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        if not keep_alive:
            self.headers["Connection"] = "close"
        self.keep_alive = keep_alive
        self._session: aiohttp.ClientSession | None = None

    def _open_session(self) -> aiohttp.ClientSession:
        if self._session is None:  # made on first use, inside the running loop
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, force_close=not self.keep_alive),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=10), headers=self.headers,
                auto_decompress=False)  # aiohttp would inflate a whole chunk at once, unbounded
        return self._session

    def body(self, request: dict, stream: bool, generate: bool = True) -> dict:
        # extra_body holds generation settings (ignore_eos, top_k, ...): not for embeddings
        body = {**self.extra, **request} if generate else dict(request)
        if self.model:
            body["model"] = self.model
        if stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        else:
            body.pop("stream", None)
        return body

    async def stream(self, request: dict, path: str = "/chat/completions") -> AsyncIterator[Event]:
        """One chat (or, with path /completions, legacy) completion: streamed,
        unless the client wants it whole (`"stream": false` in the request);
        then the server's own whole answer is relayed, as it made it (a text
        cut inside a character keeps the server's U+FFFD, which a stream drops).
        Cancelling the consumer closes the HTTP stream, which makes the server
        drop the request and free its slot."""
        chat = path == "/chat/completions"
        choices = choice_limit(request, "chat" if chat else "completions")
        try:
            # each generator below is closed with its consumer (aclosing): a cancel closes the HTTP
            # stream at once, not when the garbage collector gets to the inner generators
            body = self.body(request, stream=request.get("stream") is not False)
            # timings on every chunk, when the pool asked for them (to count tokens) and the client did not,
            # are the pool's, not the client's: only the closing chunk's (which the runtime sends anyway) go on
            own_timings = bool(body.get("timings_per_token")) and "timings_per_token" not in request
            async with aclosing(self._complete(path, body, chat, choices, own_timings)) as events:
                async for event in events:
                    yield event
        except (aiohttp.ClientError, ConnectionError) as exc:  # refused, or cut mid-stream
            raise connection_lost(exc) from None

    async def fetch(self, request: dict, path: str = "/embeddings", root: bool = False) -> AsyncIterator[Event]:
        """One request answered whole (embeddings, the runtime's own calls): a single Finished
        with the result. `root`: `path` is from the server's root (/tokenize), not from /v1."""
        try:
            r = await self._post(path, self.body(request, stream=False, generate=False), root)
            try:
                if r.status != 200:
                    raise upstream_error(r.status, await UpstreamBody(r, self.limits).error_text())
                result = json.loads(await UpstreamBody(r, self.limits).read())
            finally:
                r.close()
        except (aiohttp.ClientError, ConnectionError) as exc:
            raise connection_lost(exc) from None
        except ValueError as exc:
            raise JobError(ErrorCode.RUNTIME_ERROR, f"the runtime answered with invalid JSON: {exc}") from None
        if not isinstance(result, dict):
            raise JobError(ErrorCode.RUNTIME_ERROR, "the runtime answered with JSON that is not an object")
        usage = result.get("usage") or {}
        result.pop("model", None)  # the pool names the model
        yield Finished("stop", int(usage.get("prompt_tokens", 0)), 0, result=result)

    async def post(self, path: str, body: dict) -> aiohttp.ClientResponse:
        """POST `body` to `path` under the base URL; the caller reads and closes the answer."""
        return await self._post(path, body)

    async def _post(self, path: str, body: dict, root: bool = False) -> aiohttp.ClientResponse:
        url = (self.base_url.removesuffix("/v1") if root else self.base_url) + path
        session = self._open_session()
        failures = 0
        while True:
            try:
                # a redirect is the runtime's answer (an error), not a place to send the key and the prompt
                return await session.post(url, json=body, allow_redirects=False)
            except aiohttp.ClientConnectionError:
                # A pooled connection the server had closed just before (llama-server
                # announces keep-alive, then closes after a stream): no answer came back,
                # so the request is sent again; a server that is down fails every try.
                failures += 1
                if not self.keep_alive or failures > STALE_RETRIES:
                    raise

    async def _complete(self, path: str, body: dict, chat: bool, choices: int,
                        own_timings: bool = False) -> AsyncIterator[Event]:
        """Send a completion request and relay the answer: an event stream (what
        the pool asks for unless the client wants the answer whole), or, for a
        request sent with stream off, the JSON answer. Anything else is an error."""
        whole = not body.get("stream")
        r = await self._post(path, body)
        try:
            upstream = UpstreamBody(r, self.limits)
            if r.status != 200:
                raise upstream_error(r.status, await upstream.error_text())
            if r.content_type == "text/event-stream":
                async with aclosing(self._read_stream(upstream, chat, choices, own_timings)) as events:
                    async for event in events:
                        yield event
            elif whole and r.content_type == "application/json":
                raw = await upstream.read()
                r.close()
                for event in answer_events(raw, chat, choices):
                    yield event
            else:  # an HTML page, a JSON answer to a stream: no answer at all
                wanted = "application/json or text/event-stream" if whole else "text/event-stream"
                raise JobError(ErrorCode.RUNTIME_ERROR, f"the runtime answered with "
                               f"{r.content_type or 'no content type'}, not {wanted}")
        finally:
            # mid-stream (a cancel, an error) this drops the connection, so the server drops the
            # request and frees its slot; after a body read to its end it is a no-op
            r.close()

    async def _read_stream(self, upstream: UpstreamBody, chat: bool, choices: int,
                           own_timings: bool = False) -> AsyncIterator[Event]:
        finishes: dict[int, str] = {}
        seen = {0}  # choice indexes that produced output (choice 0 always owes a finish_reason)
        usage, timings, produced, done = None, None, 0, False
        carried = 0  # output tokens the events so far carry (live_count)
        closing: dict = {}  # the runtime's own fields of its finish and usage chunks (Done.extra)
        usage_on_finish = False
        async with aclosing(sse_data(upstream, self.limits.max_upstream_line_bytes)) as lines:
            async for data in lines:
                if data == b"[DONE]":
                    done = True
                    if self.keep_alive:  # the connection goes back to the pool only once drained
                        await upstream.drain()
                    break
                chunk = json_object(data, "an event")
                if "error" in chunk:
                    raise runtime_reported(chunk["error"])
                if chunk.get("usage"):
                    usage = chunk["usage"]
                    usage_on_finish = usage_on_finish or bool(chunk.get("choices"))  # not the include_usage chunk
                if chunk.get("timings"):  # llama-server's, on its last chunk (the usage chunk, if asked for)
                    timings = chunk["timings"]
                made = live_count(chunk)
                extra = checked_extra(chunk) if chunk.keys() - EXTRA_OWNED else None
                events, finishing = [], bool(chunk.get("usage"))
                for choice in chunk.get("choices") or ():
                    index = choice_index(choice, choices)
                    event = choice_event(choice, chat, index=index)
                    if event is not None:
                        seen.add(index)
                        if opening_only(event):  # no output token: usage's stand-in does not count it
                            event = dataclasses.replace(event, tokens=0)
                        else:
                            produced += 1
                            if made is not None:  # the runtime counts: this event carries what it made since
                                event = dataclasses.replace(event, tokens=max(0, made - carried))
                                carried = max(carried, made)
                        events.append(event)
                    if choice.get("finish_reason"):
                        finishes[index] = str(choice["finish_reason"])
                        finishing = True
                if extra and own_timings and not finishing:
                    extra.pop("timings", None)
                if extra:  # a closing chunk's own fields go with the closing, another's with what it brought
                    if finishing:
                        closing.update(extra)
                        checked_size(closing)
                    elif events:
                        events[-1] = with_extra(events[-1], extra)
                    else:
                        events.append(PartsDelta([{"k": "extra", "x": extra, "alone": True}], tokens=0))
                for event in events:
                    yield event
        # a stream cut short is no success, whatever it held: never a made-up "stop"
        if not done:
            raise JobError(ErrorCode.RUNTIME_ERROR, "the runtime's stream ended before [DONE] (cut short)")
        if unfinished := sorted(seen - finishes.keys()):
            raise JobError(ErrorCode.RUNTIME_ERROR,
                           f"the runtime's stream ended with no finish_reason for choice {unfinished[0]}")
        yield finished(finishes, usage, produced, timings, closing, usage_on_finish)

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()


def json_object(data: bytes, what: str) -> dict:
    try:
        value = json.loads(data)
    except ValueError as exc:
        raise JobError(ErrorCode.RUNTIME_ERROR, f"the runtime sent {what} that is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise JobError(ErrorCode.RUNTIME_ERROR, f"the runtime sent {what} that is not a JSON object")
    return value


def runtime_reported(err) -> JobError:
    """An error the runtime put in its answer (in a stream's event, or in place of a whole one)."""
    return JobError(ErrorCode.RUNTIME_ERROR,
                    str(err.get("message", err) if isinstance(err, dict) else err)[:ERROR_TEXT_CHARS])


def answer_events(raw: bytes, chat: bool, choices: int) -> list[Event]:
    """A whole completion as the events its stream would have given."""
    answer = json_object(raw, "an answer")
    if "error" in answer:
        raise runtime_reported(answer["error"])
    events: list[Event] = []
    finishes: dict[int, str] = {}
    for choice in answer.get("choices") or ():
        index = choice_index(choice, choices)
        if chat:  # a message is one delta holding everything; its tool calls are numbered by place
            message = choice.get("message") or {}
            calls = [{**call, "index": n} for n, call in enumerate(message.get("tool_calls") or ())]
            message = {k: v for k, v in message.items() if k != "role"}  # a whole answer has no opening to relay
            choice = {"delta": {**message, "tool_calls": calls}, "logprobs": choice.get("logprobs"),
                      "finish_reason": choice.get("finish_reason")}
        if (event := choice_event(choice, chat, index=index)) is not None:
            events.append(event)
        if not choice.get("finish_reason"):
            raise JobError(ErrorCode.RUNTIME_ERROR, f"the runtime's answer has no finish_reason for choice {index}")
        finishes[index] = str(choice["finish_reason"])
    if 0 not in finishes:
        raise JobError(ErrorCode.RUNTIME_ERROR, "the runtime's answer has no choice 0")
    return [*events, finished(finishes, answer.get("usage"), len(events), answer.get("timings"),
                              checked_extra(answer))]


def checked_size(extra: dict) -> dict:
    if len(json.dumps(extra, separators=(",", ":"))) > MAX_EXTRA_BYTES:
        raise JobError(ErrorCode.RUNTIME_ERROR, f"the runtime's own fields of one chunk or answer are over the "
                       f"pool's {MAX_EXTRA_BYTES} byte bound on them")
    return extra


def checked_extra(obj: dict) -> dict:
    """The runtime's own top-level fields of a chunk or answer, within MAX_EXTRA_BYTES."""
    return checked_size(runtime_extra(obj))


def with_extra(event: TextDelta | PartsDelta, extra: dict) -> PartsDelta:
    """`event` with its chunk's own fields after it (an "extra" part)."""
    parts = [{"k": "text", "i": 0, "t": event.text}] if isinstance(event, TextDelta) else list(event.parts)
    return PartsDelta([*parts, {"k": "extra", "x": extra}], tokens=event.tokens)


def finished(finishes: dict[int, str], usage, produced: int, timings=None, extra: dict | None = None,
             usage_on_finish: bool = False) -> Finished:
    """The end of a completion: per choice finish reasons (below the request's
    `n`, so at most MAX_CHOICES; a choice that said nothing at all stopped), usage
    and the runtime's own timings (llama-server's `timings`; none from most others),
    and its own fields of its closing chunks or whole answer, relayed (`extra`)."""
    usage = usage if isinstance(usage, dict) else {}
    reasons = tuple(finishes.get(i, "stop") for i in range(max(finishes) + 1))
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return Finished(reasons[0], int(usage.get("prompt_tokens", 0)),
                    int(usage.get("completion_tokens", produced)), reasons if len(reasons) > 1 else (),
                    # None when the runtime did not say: never a made-up 0
                    cached_tokens=cached if isinstance(cached, int) and not isinstance(cached, bool) and cached >= 0
                    else None,
                    timings=runtime_timings(timings) or None, extra=extra or None,
                    usage_on_finish=usage_on_finish,
                    reasoning_tokens=int((usage.get("completion_tokens_details") or {}).get("reasoning_tokens")
                                         or 0))


def live_count(chunk: dict) -> int | None:
    """The output tokens a runtime says it has made so far, from a streamed chunk that
    holds output: llama-server's per-chunk timings (timings_per_token) or vLLM's running
    usage (continuous_usage_stats). None when it does not say: each event then counts one."""
    if not chunk.get("choices"):
        return None
    made = runtime_timings(chunk.get("timings")).get("predicted_n")
    if made is None and isinstance(chunk.get("usage"), dict):
        made = chunk["usage"].get("completion_tokens")
    return int(made) if isinstance(made, (int, float)) and not isinstance(made, bool) and 0 <= made < TIMING_MAX \
        else None


def choice_index(choice, choices: int) -> int:
    """A streamed choice's index, checked against the request's `n`: a runtime
    that names another choice broke the protocol (and must never make the pool
    hold a list that long)."""
    if not isinstance(choice, dict):
        raise JobError(ErrorCode.PROTOCOL_ERROR, "the runtime sent a choice that is not a JSON object")
    index = choice.get("index") or 0
    if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < choices:
        raise JobError(ErrorCode.PROTOCOL_ERROR, f"the runtime sent choice index {str(index)[:40]}, but the "
                       f"request asked for {choices} choice{'s' if choices > 1 else ''}")
    return index


def choice_event(choice: dict, chat: bool, index: int | None = None) -> TextDelta | PartsDelta | None:
    """One streamed choice as a worker event: plain content of choice 0 as a
    TextDelta (the common, cheap case), anything else as typed parts in the
    order of an OpenAI delta (reasoning, content with its logprobs, refusal,
    tool calls). `index`: the choice's, checked (choice_index) by the caller."""
    if index is None:
        index = choice_index(choice, MAX_CHOICES)
    parts: list[dict] = []
    if chat:
        delta = choice.get("delta") or {}
        text = delta.get("content")
        lp = (choice.get("logprobs") or {}).get("content")
        if "role" in delta:  # the runtime opens the message: its empty fields, as it sent them
            parts.append({"k": "open", "i": index, "d": opening_fields(delta)})
        elif index == 0 and text and not lp and not (delta.get("tool_calls") or delta.get("reasoning_content")
                                                     or delta.get("reasoning") or delta.get("refusal")):
            return TextDelta(text)
    else:
        delta = {}
        text, lp = choice.get("text"), choice.get("logprobs")
        if index == 0 and not lp and text:
            return TextDelta(text)
    reasoning = delta.get("reasoning_content") or delta.get("reasoning")  # llama-server / newer vLLM
    if reasoning:
        parts.append({"k": "reasoning", "i": index, "t": reasoning})
    if text or lp:
        part = {"k": "text", "i": index, "t": text or ""}
        if lp:
            part["lp"] = lp
        parts.append(part)
    if delta.get("refusal"):
        parts.append({"k": "refusal", "i": index, "t": delta["refusal"]})
    for call in delta.get("tool_calls") or ():
        function = call.get("function") or {}
        n = call.get("index") or 0
        if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n < MAX_TOOL_CALLS:
            raise JobError(ErrorCode.PROTOCOL_ERROR, f"the runtime sent tool call index {str(n)[:40]}")
        part = {"k": "tool", "i": index, "n": n, "args": function.get("arguments") or ""}
        if call.get("id"):
            part["id"] = call["id"]
        if function.get("name"):
            part["name"] = function["name"]
        parts.append(part)
    return PartsDelta(parts) if parts else None


def opening_only(event: TextDelta | PartsDelta) -> bool:
    return isinstance(event, PartsDelta) and all(part["k"] == "open" for part in event.parts)


def opening_fields(delta: dict) -> dict:
    """The empty fields of a runtime's opening delta (llama-server's "content": null, vLLM's
    "content": "", OpenAI's "refusal": null), a few at most: what it holds is parts of its own."""
    fields = {k: v for k, v in delta.items() if k != "role" and v in (None, "") and len(k) <= 64}
    return dict(list(fields.items())[:OPEN_FIELDS])


class OpenAIServerBackend(Backend):
    """A backend whose runtime speaks OpenAI: every endpoint and field goes to
    it (it judges them); `self.client` is set by start()."""

    endpoints = frozenset({"chat", "completions", "embeddings"})
    client: OpenAIClient

    def run(self, job: str, request: dict) -> AsyncIterator[Event]:
        return self.client.stream(request)

    def complete(self, job: str, request: dict) -> AsyncIterator[Event]:
        return self.client.stream(request, "/completions")

    def embed(self, job: str, request: dict) -> AsyncIterator[Event]:
        return self.client.fetch(request)

    # the runtime's own calls it serves (base.CALLS): endpoint -> its path from the server's root
    call_paths: dict[str, str] = {}

    def call(self, endpoint: str, job: str, request: dict) -> AsyncIterator[Event]:
        return self.client.fetch(request, self.call_paths[endpoint], root=True)


# A line of a runtime's output that reports an error (llama.cpp marks its level with " E ");
# the rest is start-up chatter, which is no crash's reason.
ERROR_LINE = re.compile(r"(?i)\b(error|fatal|fail(ed|ure)?|exception|abort(ed)?|panic|cannot|can't|unable|"
                        r"out of memory|segmentation fault|assert(ion)?|terminate(d)?)\b|^\S+ E ")
# an error line that only announces the exit ("exiting due to model loading error") names no cause
EXIT_LINE = re.compile(r"(?i)\b(exiting|shutting down|terminating|cleaning up)\b")
ERROR_LINE_CHARS = 300


def last_error_line(lines) -> str | None:
    """The last line of `lines` that reports an error, one that names a cause before one that
    only announces the exit; clipped; None when no line reports an error."""
    errors = [line.strip() for line in lines if ERROR_LINE.search(line)]
    line = next((e for e in reversed(errors) if not EXIT_LINE.search(e)), errors[-1] if errors else None)
    if line is None or len(line) <= ERROR_LINE_CHARS:
        return line
    return line[:ERROR_LINE_CHARS] + "..."


class NativeServer:
    def __init__(self, name: str, log, model: str | None = None, extra: dict | None = None,
                 limits: OutputLimits = OutputLimits()) -> None:
        self.name = name
        self.log = log
        self.port = free_port()
        self.api_key = secrets.token_urlsafe(24)
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.proc: asyncio.subprocess.Process | None = None
        self.tail: collections.deque[str] = collections.deque(maxlen=40)
        self._relay: asyncio.Task | None = None
        self.client = OpenAIClient(self.base_url + "/v1", self.api_key, model=model, extra=extra, limits=limits)
        self.control = httpx.AsyncClient(headers={"Authorization": f"Bearer {self.api_key}"})

    async def get(self, path: str, timeout: float = 5) -> httpx.Response:
        """GET a server path outside /v1 (/health, /props) with the server's key."""
        return await self.control.get(self.base_url + path, timeout=timeout)

    async def launch(self, argv: list[str], key_env: str, env: dict | None = None) -> None:
        """Start the server. Its API key goes in the environment variable
        `key_env` (private to this user), never in argv, which any user can
        read through ps."""
        self.log.info("starting %s: %s", self.name, mask_url_credentials(" ".join(argv)))
        self.proc = await asyncio.create_subprocess_exec(
            *lifeline_argv(argv),  # gone with the worker, even on SIGKILL (no preexec_fn: see lifeline.py)
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT, env={**os.environ, **(env or {}), key_env: self.api_key},
            start_new_session=True,  # its own group, killed as one
        )
        self._relay = asyncio.create_task(self._relay_output(), name=f"relay-{self.name}")
        self._relay.add_done_callback(self._relay_ended)

    def _relay_ended(self, task: asyncio.Task) -> None:
        # a relay that stops while the child runs would leave it blocked on a full pipe
        if not task.cancelled() and task.exception() is not None:
            self.log.error("relaying %s's output failed: %r; stopping it", self.name, task.exception())
            if self.proc and self.proc.returncode is None:
                signal_group(self.proc.pid, signal.SIGKILL)  # the worker sees it die and exits

    async def _relay_output(self) -> None:
        """Copy the child's output to the worker's log, line by line, whatever
        a line's length: it is read in chunks, and a line longer than
        RELAY_LINE_BYTES is cut there (the rest follows as more lines)."""
        assert self.proc and self.proc.stdout
        pending = b""
        while chunk := await self.proc.stdout.read(RELAY_CHUNK_BYTES):
            *lines, pending = (pending + chunk).split(b"\n")
            while len(pending) > RELAY_LINE_BYTES:
                lines.append(pending[:RELAY_LINE_BYTES])
                pending = pending[RELAY_LINE_BYTES:]
            for line in lines:
                self._relay_line(line)
        if pending:
            self._relay_line(pending)

    def _relay_line(self, line: bytes) -> None:
        text = line.decode(errors="replace").rstrip()
        self.tail.append(text[:1000])
        sys.stderr.write(f"[{self.name}] {text}\n")

    async def wait_exit(self) -> str:
        """Return once the child exits, with its reason: its signal or exit code, and the last
        error line of its output (its whole output is in the replica's log)."""
        code = await self.proc.wait()
        if self._relay:
            await asyncio.wait([self._relay], timeout=2)
        how = f"was killed by {exit_text(code)}" if code < 0 else f"exited with {exit_text(code)}"
        return f"{self.name} {how}{self.error_text()}"

    def error_text(self) -> str:
        """': ' and the last line of the child's output that reports an error, or '' when none
        does (start-up chatter is no reason)."""
        line = last_error_line(self.tail)
        return f": {line}" if line else ""

    async def wait_healthy(self, deadline_s: float, path: str = "/health") -> None:
        """Poll until `path` answers 200. Refused connections and 503 mean loading."""
        deadline = time.monotonic() + deadline_s
        while True:
            if self.proc.returncode is not None:
                if self._relay:
                    await asyncio.wait([self._relay], timeout=2)
                raise BackendLoadError(f"{self.name} exited with {exit_text(self.proc.returncode)} while loading"
                                       f"{self.error_text()}")
            try:
                r = await self.get(path, timeout=2)
                if r.status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise BackendLoadError(f"{self.name} not healthy within {deadline_s:.0f}s{self.error_text()}")
            await asyncio.sleep(0.1)

    async def stop(self, timeout_s: float = 5.0) -> None:
        """SIGTERM, wait, then SIGKILL the group: llama-server can hang on
        SIGTERM while a request is in flight."""
        await self.client.aclose()
        await self.control.aclose()
        proc = self.proc
        if proc is None or proc.returncode is not None:
            return
        if await stop_group(proc, timeout_s):
            self.log.warning("%s ignored SIGTERM for %.0fs; SIGKILL", self.name, timeout_s)
        if self._relay:
            await asyncio.wait([self._relay], timeout=2)


class UpstreamBody:
    """A runtime's answer body, read within bounds: at most
    `limits.max_job_output_bytes` in all (decompressed), gzip or deflate
    inflated here in pieces of INFLATE_PIECE_BYTES (a 1 MB bomb never becomes
    1 GB at once, and the event loop gets a turn between pieces), any other
    encoding refused. Past a bound the job fails with runtime_error."""

    def __init__(self, r: aiohttp.ClientResponse, limits: OutputLimits) -> None:
        self.r = r
        self.limit = limits.max_job_output_bytes
        self.read_bytes = 0
        encoding = r.headers.get("Content-Encoding", "identity").strip().lower()
        if encoding in ("gzip", "x-gzip", "deflate"):
            self._inflate = zlib.decompressobj(wbits=47)  # 32 + 15: a gzip or zlib header, found by zlib
        elif encoding in ("identity", ""):
            self._inflate = None
        else:
            raise JobError(ErrorCode.RUNTIME_ERROR, f"the runtime answered with content encoding "
                           f"{encoding[:40]!r}; the pool reads identity, gzip or deflate")

    def _count(self, data: bytes) -> bytes:
        self.read_bytes += len(data)
        if self.read_bytes > self.limit:
            raise JobError(ErrorCode.RUNTIME_ERROR, f"the runtime's answer exceeds the pool's {self.limit} byte "
                           "bound on one job's output (server.max_job_output_bytes)")
        return data

    async def chunks(self, limit: int | None = None) -> AsyncIterator[bytes]:
        """The decoded body, piece by piece; `limit` (bytes) lowers the bound."""
        if limit is not None:
            self.limit = min(self.limit, self.read_bytes + limit)
        async for raw in self.r.content.iter_any():
            if self._inflate is None:
                yield self._count(raw)
                continue
            try:
                data = self._inflate.decompress(raw, INFLATE_PIECE_BYTES)
                yield self._count(data)
                while self._inflate.unconsumed_tail:
                    await asyncio.sleep(0)
                    data = self._inflate.decompress(self._inflate.unconsumed_tail, INFLATE_PIECE_BYTES)
                    yield self._count(data)
            except zlib.error as exc:
                raise JobError(ErrorCode.RUNTIME_ERROR, f"the runtime's compressed answer is corrupt: {exc}") \
                    from None

    async def read(self) -> bytes:
        out = bytearray()
        async for data in self.chunks():
            out += data
        return bytes(out)

    async def error_text(self) -> str:
        """The start of an error answer: enough for its message, never all of a huge one."""
        out = bytearray()
        try:
            async for data in self.chunks(ERROR_BODY_BYTES):
                out += data
        except JobError:  # longer than that: its start is the message
            pass
        return out[:ERROR_BODY_BYTES].decode(errors="replace")

    async def drain(self, timeout_s: float = 2.0) -> None:
        """Read what follows [DONE] to the end of the body, so that a keep-alive
        connection can carry the next job; a server that does not end the body in
        time (or sends more than a little) only costs that connection."""
        try:
            async with asyncio.timeout(timeout_s), aclosing(self.chunks(ERROR_BODY_BYTES)) as pieces:
                async for _ in pieces:
                    pass
        except (TimeoutError, JobError):
            pass


DATA_LINE = re.compile(rb"^data:(.*)$", re.MULTILINE)  # an SSE data line; `.` stops at the newline


def line_too_long(max_line_bytes: int) -> JobError:
    return JobError(ErrorCode.RUNTIME_ERROR, f"the runtime sent a line longer than the pool's {max_line_bytes} "
                    "byte bound (server.max_upstream_line_bytes)")


async def sse_data(body: UpstreamBody, max_line_bytes: int) -> AsyncIterator[bytes]:
    """The `data:` payloads of an SSE body. Linear in the body's size, and cheap
    per line: each byte is searched once for the last newline (from where the
    last search stopped), the data lines of what is complete are found by the
    regex engine (a flood of blank or comment lines costs no Python step per
    line), and only the unfinished line is kept (a chunk of whole lines, the
    usual token, is never copied). A data line, or an unfinished
    one, longer than `max_line_bytes` fails the job before more of it is held."""
    buf = bytearray()
    for_newline = 0  # buf[:for_newline] holds no newline
    async with aclosing(body.chunks()) as pieces:
        async for chunk in pieces:
            if not buf and chunk.endswith(b"\n"):  # the common case, whole lines: no copy
                lines = DATA_LINE.findall(chunk)
            else:
                buf += chunk
                end = buf.rfind(b"\n", for_newline) + 1  # just past the last complete line; 0: none
                lines = DATA_LINE.findall(buf, 0, end) if end else ()
                del buf[:end]
            for line in lines:
                if len(line) > max_line_bytes:
                    raise line_too_long(max_line_bytes)
                yield line.strip()
            for_newline = len(buf)
            if for_newline > max_line_bytes:
                raise line_too_long(max_line_bytes)
    if buf.startswith(b"data:"):
        yield bytes(buf[5:]).strip()


def connection_lost(exc: Exception) -> JobError:
    """A broken connection to the runtime, in plain words for the client; the library's
    own text (which names its internals) goes to the worker's log only."""
    logging.getLogger("runtime_worker").warning("connection to the runtime lost: %s",
                                                mask_url_credentials(repr(exc)))
    if isinstance(exc, aiohttp.ClientConnectorError):
        return JobError(ErrorCode.RUNTIME_CRASHED, "the runtime did not accept the connection (it is down)")
    return JobError(ErrorCode.RUNTIME_CRASHED, "the runtime's answer broke off before it was complete "
                    "(the runtime stopped or crashed)")


# vLLM's words for a request over the model's length, in its releases' wordings: the context
# (M), and what the request came to (N) where it says so
_CONTEXT_M = re.compile(r"maximum (?:context length|model length) (?:is|of) (\d+)")
_CONTEXT_N = re.compile(r"(?:requested|resulted in|has|contains at least) (\d+)(?: input)? tokens|\(length (\d+)\)")


def context_overflow(detail, message: str) -> tuple[int | None, int] | None:
    """(prompt tokens or None, context) when a runtime refused a request for its context's size:
    llama-server says so in fields of its own, vLLM in words."""
    if isinstance(detail, dict) and detail.get("type") == "exceed_context_size_error":
        n, m = detail.get("n_prompt_tokens"), detail.get("n_ctx")
        if isinstance(m, int):
            return (n if isinstance(n, int) else None), m
    if (m := _CONTEXT_M.search(message)) is None:
        return None
    n = _CONTEXT_N.search(message)
    return (int(n.group(1) or n.group(2)) if n else None), int(m.group(1))


def context_message(prompt_tokens: int | None, context: int) -> str:
    """OpenAI's wording, which agents match to compact a conversation (the Messages surface
    words it as Anthropic does, from these numbers)."""
    resulted = f"However, your messages resulted in {prompt_tokens} tokens. " if prompt_tokens is not None else ""
    return (f"This model's maximum context length is {context} tokens. {resulted}"
            "Please reduce the length of the messages.")


def upstream_error(status: int, text: str) -> JobError:
    """Map an upstream HTTP error to a job error; never a success. A request
    the runtime refused as malformed keeps its status (400) and its message:
    the client gets the runtime's own words, except a request over the model's context:
    `context_length_exceeded` in OpenAI's words, which agents act on."""
    detail = None
    try:
        detail = json.loads(text).get("error", text)
        message = detail.get("message", str(detail)) if isinstance(detail, dict) else str(detail)
    except (ValueError, AttributeError):
        message = text[:500]
    message = str(message)[:ERROR_TEXT_CHARS]
    if status in (400, 413, 422) and (sizes := context_overflow(detail, message)) is not None:
        return JobError(ErrorCode.CONTEXT_LENGTH_EXCEEDED, context_message(*sizes))
    if status in (400, 422):  # 422: a server's schema validation (FastAPI's, in vLLM)
        return JobError(ErrorCode.INVALID_REQUEST, message)
    if status == 413:
        return JobError(ErrorCode.REQUEST_TOO_LARGE, message)
    if status == 501:  # llama-server: an endpoint it was not started for (embeddings)
        return JobError(ErrorCode.UNSUPPORTED_ENDPOINT, message)
    if 300 <= status < 400:  # never followed (it would carry the key and the prompt elsewhere)
        return JobError(ErrorCode.RUNTIME_ERROR, f"upstream {status}: a redirect, not followed")
    if status == 429:
        code = ErrorCode.UPSTREAM_RATE_LIMITED
    elif status in (408, 504):
        code = ErrorCode.RUNTIME_TIMEOUT
    else:  # 401, 403, 404 and 5xx: the pool's runtime is misconfigured or failed, not the client
        code = ErrorCode.RUNTIME_ERROR
    return JobError(code, f"upstream {status}: {message}")


def extra_body(options: dict) -> dict:
    """options.extra_body, checked at load time: fields added to every chat and
    completion request (e.g. {"ignore_eos": true} or {"top_k": 20}); the
    client's own fields win."""
    extra = options.get("extra_body") or {}
    if not isinstance(extra, dict):
        raise BackendLoadError(f"options.extra_body must be a table of request fields, not {extra!r}")
    return extra
