"""A native OpenAI-compatible server launched as the worker's child
(llama-server, vllm serve): start it on a free loopback port with a random
key, relay its output to the worker's log while keeping a tail for error
messages, wait for readiness, stream chat completions from it, stop it."""

from __future__ import annotations

import asyncio
import collections
import json
import os
import secrets
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator

import aiohttp
import httpx

from protocol.errors import ErrorCode
from runtime_worker.backends.base import BackendLoadError, Finished, JobError, TextDelta
from runtime_worker.lifeline import die_with_parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


RELAY_CHUNK_BYTES = 64 * 1024
RELAY_LINE_BYTES = 16 * 1024  # a longer line of the child's output is split in the log
STALE_RETRIES = 3  # keep-alive clients: resends after a connection error before any answer


class ChatClient:
    """Streams chat completions from an OpenAI-compatible server. `base_url`
    ends before /chat/completions (e.g. http://127.0.0.1:8080/v1).

    aiohttp, not httpx, on this path: its C parsers cost a fraction of httpx's
    per request and per streamed chunk (scripts/bench, section 1).
    `keep_alive`: reuse connections (a remote endpoint, where a new TLS
    connection per job is dear). llama-server announces keep-alive but closes
    a connection after a stream, racing the next request, so local runtimes
    get a fresh connection per job."""

    def __init__(self, base_url: str, api_key: str | None, keep_alive: bool = False) -> None:
        self.url = base_url.rstrip("/") + "/chat/completions"
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

    async def stream(self, body: dict) -> AsyncIterator[TextDelta | Finished]:
        """Stream one request. Cancelling the consumer closes the HTTP stream,
        which makes the server drop the request and free its slot."""
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        try:
            async for event in self._stream(body):
                yield event
        except (aiohttp.ClientError, ConnectionError) as exc:  # refused, or cut mid-stream
            raise JobError(ErrorCode.RUNTIME_CRASHED, f"lost the connection to the runtime: {exc!r}") from None

    async def _post(self, body: dict) -> aiohttp.ClientResponse:
        session = self._open_session()
        failures = 0
        while True:
            try:
                return await session.post(self.url, json=body)
            except aiohttp.ClientConnectionError:
                # A pooled connection the server had closed just before (llama-server
                # announces keep-alive, then closes after a stream): no answer came back,
                # so the request is sent again; a server that is down fails every try.
                failures += 1
                if not self.keep_alive or failures > STALE_RETRIES:
                    raise

    async def _stream(self, body: dict) -> AsyncIterator[TextDelta | Finished]:
        finish, usage, produced = None, None, 0
        r = await self._post(body)
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
                    raise JobError(ErrorCode.RUNTIME_ERROR, str(err.get("message", err)))
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for choice in chunk.get("choices") or []:
                    text = (choice.get("delta") or {}).get("content")
                    if text:
                        produced += 1
                        yield TextDelta(text)
                    if choice.get("finish_reason"):
                        finish = choice["finish_reason"]
        finally:
            # mid-stream (a cancel, an error) this drops the connection, so the server drops the
            # request and frees its slot; after a body read to its end it is a no-op
            r.close()
        usage = usage or {}
        yield Finished("length" if finish == "length" else "stop",
                       int(usage.get("prompt_tokens", 0)), int(usage.get("completion_tokens", produced)))

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()


class NativeServer:
    def __init__(self, name: str, log) -> None:
        self.name = name
        self.log = log
        self.port = free_port()
        self.api_key = secrets.token_urlsafe(24)
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.proc: asyncio.subprocess.Process | None = None
        self.tail: collections.deque[str] = collections.deque(maxlen=40)
        self._relay: asyncio.Task | None = None
        self.chat = ChatClient(self.base_url + "/v1", self.api_key)
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
                os.killpg(self.proc.pid, signal.SIGKILL)  # the worker sees it die and exits

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
        await self.chat.aclose()
        await self.control.aclose()
        proc = self.proc
        if proc is None or proc.returncode is not None:
            return
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            await asyncio.wait_for(proc.wait(), timeout_s)
        except TimeoutError:
            self.log.warning("%s ignored SIGTERM for %.0fs; SIGKILL", self.name, timeout_s)
        except ProcessLookupError:
            pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        await proc.wait()
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
    """Map an upstream HTTP error to a job error; never a success."""
    try:
        detail = json.loads(text).get("error", text)
        message = detail.get("message", str(detail)) if isinstance(detail, dict) else str(detail)
    except (ValueError, AttributeError):
        message = text[:500]
    if status == 400:
        code = ErrorCode.INVALID_REQUEST
    elif status == 429:
        code = ErrorCode.UPSTREAM_RATE_LIMITED
    elif status in (408, 504):
        code = ErrorCode.RUNTIME_TIMEOUT
    else:
        code = ErrorCode.RUNTIME_ERROR
    return JobError(code, f"upstream {status}: {message}")


def extra_body(options: dict) -> dict:
    """options.extra_body, checked at load time: fields added to every chat request."""
    extra = options.get("extra_body") or {}
    if not isinstance(extra, dict):
        raise BackendLoadError(f"options.extra_body must be a table of request fields, not {extra!r}")
    return extra


def chat_body(request: dict, model: str | None = None, extra: dict | None = None) -> dict:
    """The OpenAI chat body for a job request; unset sampling fields are omitted.
    `extra` (the model's options.extra_body) adds runtime-specific fields, e.g.
    {"ignore_eos": true} or {"top_k": 20}; the request's own fields win."""
    body = dict(extra or {})
    body["messages"] = request["messages"]
    if model:
        body["model"] = model
    for key in ("max_tokens", "temperature", "top_p"):
        if request.get(key) is not None:
            body[key] = request[key]
    if request.get("stop"):
        body["stop"] = request["stop"]
    return body
