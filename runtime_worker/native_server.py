"""A native OpenAI-compatible server launched as the worker's child
(llama-server, vllm serve): start it on a free loopback port with a random
key, relay its output to the worker's log while keeping a tail for error
messages, wait for readiness, pass the client's requests to it, stop it."""

from __future__ import annotations

import asyncio
import collections
import json
import os
import secrets
import signal
import sys
import time
from collections.abc import AsyncIterator

import aiohttp
import httpx

from procutil.groups import signal_group, stop_group
from procutil.net import free_port
from protocol.errors import ErrorCode
from runtime_worker.backends.base import (
    Backend, BackendLoadError, Event, Finished, JobError, PartsDelta, TextDelta)
from runtime_worker.lifeline import die_with_parent


RELAY_CHUNK_BYTES = 64 * 1024
RELAY_LINE_BYTES = 16 * 1024  # a longer line of the child's output is split in the log
STALE_RETRIES = 3  # keep-alive clients: resends after a connection error before any answer


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
    get a fresh connection per job."""

    def __init__(self, base_url: str, api_key: str | None, keep_alive: bool = False, *,
                 model: str | None = None, extra: dict | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.extra = extra or {}
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        if not keep_alive:
            self.headers["Connection"] = "close"
        self.keep_alive = keep_alive
        self._session: aiohttp.ClientSession | None = None

    def _open_session(self) -> aiohttp.ClientSession:
        if self._session is None:  # made on first use, inside the running loop
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, force_close=not self.keep_alive),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=10), headers=self.headers)
        return self._session

    def body(self, request: dict, stream: bool) -> dict:
        # extra_body holds generation settings (ignore_eos, top_k, ...): not for embeddings
        body = {**self.extra, **request} if stream else dict(request)
        if self.model:
            body["model"] = self.model
        if stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        return body

    async def stream(self, request: dict, path: str = "/chat/completions") -> AsyncIterator[Event]:
        """Stream one chat (or, with path /completions, legacy) completion.
        Cancelling the consumer closes the HTTP stream, which makes the server
        drop the request and free its slot."""
        try:
            async for event in self._stream(path, self.body(request, stream=True), chat=path == "/chat/completions"):
                yield event
        except (aiohttp.ClientError, ConnectionError) as exc:  # refused, or cut mid-stream
            raise JobError(ErrorCode.RUNTIME_CRASHED, f"lost the connection to the runtime: {exc!r}") from None

    async def fetch(self, request: dict, path: str = "/embeddings") -> AsyncIterator[Event]:
        """One request answered whole (embeddings): a single Finished with the result."""
        try:
            r = await self._post(path, self.body(request, stream=False))
            try:
                if r.status != 200:
                    raise upstream_error(r.status, await r.text(errors="replace"))
                result = await r.json(content_type=None)
            finally:
                r.close()
        except (aiohttp.ClientError, ConnectionError) as exc:
            raise JobError(ErrorCode.RUNTIME_CRASHED, f"lost the connection to the runtime: {exc!r}") from None
        except ValueError as exc:
            raise JobError(ErrorCode.RUNTIME_ERROR, f"the runtime answered with invalid JSON: {exc}") from None
        if not isinstance(result, dict):
            raise JobError(ErrorCode.RUNTIME_ERROR, "the runtime answered with JSON that is not an object")
        usage = result.get("usage") or {}
        result.pop("model", None)  # the pool names the model
        yield Finished("stop", int(usage.get("prompt_tokens", 0)), 0, result=result)

    async def _post(self, path: str, body: dict) -> aiohttp.ClientResponse:
        session = self._open_session()
        failures = 0
        while True:
            try:
                return await session.post(self.base_url + path, json=body)
            except aiohttp.ClientConnectionError:
                # A pooled connection the server had closed just before (llama-server
                # announces keep-alive, then closes after a stream): no answer came back,
                # so the request is sent again; a server that is down fails every try.
                failures += 1
                if not self.keep_alive or failures > STALE_RETRIES:
                    raise

    async def _stream(self, path: str, body: dict, chat: bool) -> AsyncIterator[Event]:
        finishes: dict[int, str] = {}
        usage, produced = None, 0
        r = await self._post(path, body)
        try:
            if r.status != 200:
                raise upstream_error(r.status, await r.text(errors="replace"))
            async for data in _sse_data(r):
                if data == b"[DONE]":
                    if self.keep_alive:  # the connection goes back to the pool only once drained
                        await _read_to_end(r)
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    err = chunk["error"]
                    raise JobError(ErrorCode.RUNTIME_ERROR, str(err.get("message", err) if isinstance(err, dict)
                                                                else err))
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for choice in chunk.get("choices") or ():
                    event = choice_event(choice, chat)
                    if event is not None:
                        produced += 1
                        yield event
                    if choice.get("finish_reason"):
                        finishes[int(choice.get("index") or 0)] = choice["finish_reason"]
        finally:
            # mid-stream (a cancel, an error) this drops the connection, so the server drops the
            # request and frees its slot; after a body read to its end it is a no-op
            r.close()
        usage = usage or {}
        reasons = tuple(finishes.get(i, "stop") for i in range(max(finishes, default=0) + 1))
        yield Finished(reasons[0], int(usage.get("prompt_tokens", 0)),
                       int(usage.get("completion_tokens", produced)), reasons if len(reasons) > 1 else (),
                       cached_tokens=int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0),
                       reasoning_tokens=int((usage.get("completion_tokens_details") or {}).get("reasoning_tokens")
                                            or 0))

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()


def choice_event(choice: dict, chat: bool) -> TextDelta | PartsDelta | None:
    """One streamed choice as a worker event: plain content of choice 0 as a
    TextDelta (the common, cheap case), anything else as typed parts in the
    order of an OpenAI delta (reasoning, content with its logprobs, refusal, tool calls)."""
    index = int(choice.get("index") or 0)
    if chat:
        delta = choice.get("delta") or {}
        text = delta.get("content")
        lp = (choice.get("logprobs") or {}).get("content")
        if index == 0 and text and not lp and not (delta.get("tool_calls") or delta.get("reasoning_content")
                                                   or delta.get("reasoning") or delta.get("refusal")):
            return TextDelta(text)
    else:
        delta = {}
        text, lp = choice.get("text"), choice.get("logprobs")
        if index == 0 and not lp and text:
            return TextDelta(text)
    parts: list[dict] = []
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
        part = {"k": "tool", "i": index, "n": int(call.get("index") or 0), "args": function.get("arguments") or ""}
        if call.get("id"):
            part["id"] = call["id"]
        if function.get("name"):
            part["name"] = function["name"]
        parts.append(part)
    return PartsDelta(parts) if parts else None


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


class NativeServer:
    def __init__(self, name: str, log, model: str | None = None, extra: dict | None = None) -> None:
        self.name = name
        self.log = log
        self.port = free_port()
        self.api_key = secrets.token_urlsafe(24)
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.proc: asyncio.subprocess.Process | None = None
        self.tail: collections.deque[str] = collections.deque(maxlen=40)
        self._relay: asyncio.Task | None = None
        self.client = OpenAIClient(self.base_url + "/v1", self.api_key, model=model, extra=extra)
        self.control = httpx.AsyncClient(headers={"Authorization": f"Bearer {self.api_key}"})

    async def get(self, path: str, timeout: float = 5) -> httpx.Response:
        """GET a server path outside /v1 (/health, /props) with the server's key."""
        return await self.control.get(self.base_url + path, timeout=timeout)

    async def launch(self, argv: list[str], key_env: str, env: dict | None = None) -> None:
        """Start the server. Its API key goes in the environment variable
        `key_env` (private to this user), never in argv, which any user can
        read through ps."""
        self.log.info("starting %s: %s", self.name, " ".join(argv))
        self.proc = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT, env={**os.environ, **(env or {}), key_env: self.api_key},
            start_new_session=True,  # its own group, killed as one
            preexec_fn=die_with_parent,  # gone with the worker, even on SIGKILL
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
        """Return once the child exits, with its last output as the reason."""
        code = await self.proc.wait()
        if self._relay:
            await asyncio.wait([self._relay], timeout=2)
        return f"{self.name} exited with code {code}:\n{self.error_text()}"

    def error_text(self) -> str:
        lines = [l for l in self.tail if l.strip()]
        return "\n".join(lines[-12:])

    async def wait_healthy(self, deadline_s: float, path: str = "/health") -> None:
        """Poll until `path` answers 200. Refused connections and 503 mean loading."""
        deadline = time.monotonic() + deadline_s
        while True:
            if self.proc.returncode is not None:
                if self._relay:
                    await asyncio.wait([self._relay], timeout=2)
                raise BackendLoadError(f"{self.name} exited with code {self.proc.returncode} while loading:\n"
                                       f"{self.error_text()}")
            try:
                r = await self.get(path, timeout=2)
                if r.status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise BackendLoadError(f"{self.name} not healthy within {deadline_s:.0f}s:\n{self.error_text()}")
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


async def _sse_data(r: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
    """The `data:` payloads of an SSE body, whatever the size of a line."""
    pending = b""
    async for chunk in r.content.iter_any():
        pending += chunk
        if b"\n" not in chunk:
            continue
        *lines, pending = pending.split(b"\n")
        for line in lines:
            if line.startswith(b"data:"):
                yield line[5:].strip()
    if pending.startswith(b"data:"):
        yield pending[5:].strip()


async def _read_to_end(r: aiohttp.ClientResponse, timeout_s: float = 2.0) -> None:
    """Read what follows [DONE] to the end of the body, so that a keep-alive
    connection can carry the next job; a server that does not end the body in
    time only costs that connection."""
    try:
        async with asyncio.timeout(timeout_s):
            await r.read()
    except TimeoutError:
        pass


def upstream_error(status: int, text: str) -> JobError:
    """Map an upstream HTTP error to a job error; never a success. A request
    the runtime refused as malformed keeps its status (400) and its message:
    the client gets the runtime's own words."""
    try:
        detail = json.loads(text).get("error", text)
        message = detail.get("message", str(detail)) if isinstance(detail, dict) else str(detail)
    except (ValueError, AttributeError):
        message = text[:500]
    if status in (400, 422):  # 422: a server's schema validation (FastAPI's, in vLLM)
        return JobError(ErrorCode.INVALID_REQUEST, message)
    if status == 413:
        return JobError(ErrorCode.REQUEST_TOO_LARGE, message)
    if status == 501:  # llama-server: an endpoint it was not started for (embeddings)
        return JobError(ErrorCode.UNSUPPORTED_ENDPOINT, message)
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
