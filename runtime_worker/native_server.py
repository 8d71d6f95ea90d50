"""A native OpenAI-compatible server launched as the worker's child
(llama-server, vllm serve): start it on a free loopback port with a random
key, relay its output to the worker's log while keeping a tail for error
messages, wait for readiness, pass the client's requests to it (OpenAIClient,
which remote endpoints use too), stop it. Reading an answer within bounds is
runtime_worker/upstream.py's; turning it into the job's events, openai_events.py's."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import json
import os
import re
import secrets
import signal
import sys
import time
from collections.abc import AsyncIterator
from contextlib import aclosing

import aiohttp
import httpx

from procutil.groups import signal_group, stop_group
from procutil.net import free_port
from protocol.choices import choice_limit
from protocol.errors import ErrorCode, exit_text
from protocol.messages import EXTRA_OWNED, MAX_DELTA_TOKENS
from protocol.redact import mask_url_credentials
from runtime_worker.backends.base import (
    Backend, BackendLoadError, Event, Finished, JobError, OutputLimits, PartsDelta)
from runtime_worker.anthropic_relay import relay_messages
from runtime_worker.lifeline import lifeline_argv
from runtime_worker.openai_events import (
    answer_events, checked_extra, checked_size, choice_event, choice_index, finished, live_count, opening_only,
    with_extra)
from runtime_worker.upstream import (
    UpstreamBody, connection_lost, json_object, runtime_reported, sse_data, upstream_error)


RELAY_CHUNK_BYTES = 64 * 1024
RELAY_LINE_BYTES = 16 * 1024  # a longer line of the child's output is split in the log
CONNECT_RETRIES = 3  # tries again after a connection that could not be made (nothing of the request sent)


async def _mark_reused(session, ctx, params) -> None:
    """aiohttp's trace hook: this request went out on a kept-alive connection."""
    if isinstance(ctx.trace_request_ctx, dict):
        ctx.trace_request_ctx["reused"] = True


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
    get a fresh connection per job. A request is sent again when its
    connection could not be made (nothing of it left), and once, on a connection
    of its own, when a kept-alive connection turned out closed (_post).

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
        self._fresh: aiohttp.ClientSession | None = None  # never reuses a connection: re-sends go there

    def _open_session(self, fresh: bool = False) -> aiohttp.ClientSession:
        """The session (made on first use, inside the running loop); `fresh`: the one whose every
        request has a connection of its own."""
        if fresh:
            if self._fresh is None:
                self._fresh = self._new_session(force_close=True)
            return self._fresh
        if self._session is None:
            self._session = self._new_session(force_close=not self.keep_alive)
        return self._session

    def _new_session(self, force_close: bool) -> aiohttp.ClientSession:
        reuse = aiohttp.TraceConfig()  # says when a request goes out on a kept-alive connection
        reuse.on_connection_reuseconn.append(_mark_reused)
        return aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, force_close=force_close), trace_configs=[reuse],
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10), headers=self.headers,
            auto_decompress=False)  # aiohttp would inflate a whole chunk at once, unbounded

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

    async def fetch(self, request: dict, path: str = "/embeddings", root: bool = False,
                    headers: dict | None = None) -> AsyncIterator[Event]:
        """One request answered whole (embeddings, the runtime's own calls): a single Finished
        with the result. `root`: `path` is from the server's root (/tokenize), not from /v1;
        `headers`: the client's, for the runtime's own route (Submit.headers)."""
        try:
            r = await self._post(path, self.body(request, stream=False, generate=False), root, headers)
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

    async def post(self, path: str, body: dict, headers: dict | None = None) -> aiohttp.ClientResponse:
        """POST `body` to `path` under the base URL; the caller reads and closes the answer."""
        return await self._post(path, body, headers=headers)

    async def _post(self, path: str, body: dict, root: bool = False,
                    headers: dict | None = None) -> aiohttp.ClientResponse:
        url = (self.base_url.removesuffix("/v1") if root else self.base_url) + path
        session = self._open_session()
        failures = 0
        while True:
            sent = {"reused": False}
            resent = session is self._fresh
            try:
                # a redirect is the runtime's answer (an error), not a place to send the key and the prompt
                return await session.post(url, json=body, headers=headers or None, allow_redirects=False,
                                          trace_request_ctx=sent)
            except aiohttp.ClientConnectorError:
                # the connection could not be made: nothing of the request left, so it may be sent again
                failures += 1
                if failures > CONNECT_RETRIES:
                    raise
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):
                # A kept-alive connection the server had closed as it was taken from the pool (the
                # stale keep-alive race): the server closed it without a byte of answer. Sent once
                # more, on a connection of its own (never another pooled one, which could be as
                # stale); a remote that read it and closed without answering could so run it twice:
                # the one case, docs/reliability.md. On a new connection the same error is a server
                # that dropped the request: never re-sent.
                if not sent["reused"] or resent:
                    raise
                session = self._open_session(fresh=True)

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
                                event = dataclasses.replace(event, tokens=min(MAX_DELTA_TOKENS, max(0, made - carried)))
                                carried = max(carried, made)
                        events.append(event)
                    if choice.get("finish_reason"):
                        finishes[index] = str(choice["finish_reason"])
                        finishing = True
                # the runtime's own fields; the per-chunk timings the pool asked for itself are not
                # the client's (left out before any copy: llama-server sends them with every token)
                own = chunk.keys() - EXTRA_OWNED
                if own_timings and not finishing:
                    own.discard("timings")
                extra = checked_extra({k: chunk[k] for k in own}) if own else None
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
        for session in (self._session, self._fresh):
            if session is not None:
                await session.close()


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

    def call(self, endpoint: str, job: str, request: dict, headers: dict | None = None) -> AsyncIterator[Event]:
        return self.client.fetch(request, self.call_paths[endpoint], root=True, headers=headers)

    def messages(self, job: str, request: dict, headers: dict | None = None) -> AsyncIterator[Event]:
        """On the runtime's own /v1/messages (a backend whose runtime has one lists "messages"
        in its endpoints)."""
        return relay_messages(self.client, request, headers)


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
        self.dropped_lines = 0  # of the child's output, since the log last took a line (a full disk)
        self.drop_reason = ""
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
        """One line to the worker's log (its stderr, the replica's log file). A line the log cannot
        take (a full disk: ENOSPC) is dropped and counted, never a reason to stop the runtime; the
        count is written once the log takes lines again. The tail keeps every line."""
        text = line.decode(errors="replace").rstrip()
        self.tail.append(text[:1000])
        try:
            if self.dropped_lines:
                sys.stderr.write(f"[{self.name}] ({self.dropped_lines} lines of output dropped: the log could not "
                                 f"be written: {self.drop_reason})\n")
                self.dropped_lines = 0
            sys.stderr.write(f"[{self.name}] {text}\n")
        except OSError as exc:
            self.dropped_lines += 1
            self.drop_reason = exc.strerror or repr(exc)

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


async def help_lists(argv: list[str], flag: str, timeout_s: float) -> bool:
    """Whether the help that `argv` prints lists `flag` (an older runtime may not know a newer
    flag, and would refuse to start); True when the help cannot be read (the start will say
    what is wrong)."""
    try:
        proc = await asyncio.create_subprocess_exec(*argv, stdin=asyncio.subprocess.DEVNULL,
                                                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    except OSError:
        return True
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout_s)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        return True
    return flag.encode() in out


def extra_body(options: dict) -> dict:
    """options.extra_body, checked at load time: fields added to every chat and
    completion request (e.g. {"ignore_eos": true} or {"top_k": 20}); the
    client's own fields win."""
    extra = options.get("extra_body") or {}
    if not isinstance(extra, dict):
        raise BackendLoadError(f"options.extra_body must be a table of request fields, not {extra!r}")
    return extra
