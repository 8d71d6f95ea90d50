"""Load generators, bounded in requests and in time: one round of calls at one concurrency,
streaming or not, and what it measured."""

from __future__ import annotations

import asyncio
import json
import time

import httpx


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    k = max(0, min(len(s) - 1, int(round(q / 100 * len(s) + 0.5)) - 1))
    return s[k]


class Round:
    def __init__(self) -> None:
        self.latencies: list[float] = []
        self.ttfts: list[float] = []
        self.tokens = 0
        self.errors: list[str] = []
        self.wall = 0.0
        self.cpu = 0.0  # CPU seconds of the metered processes (see metered())
        self.cpu_by: dict[str, float] = {}

    def merge(self, other: Round) -> None:
        self.latencies += other.latencies
        self.ttfts += other.ttfts
        self.tokens += other.tokens
        self.errors += other.errors
        self.wall += other.wall
        self.cpu += other.cpu
        for k, v in other.cpu_by.items():
            self.cpu_by[k] = self.cpu_by.get(k, 0.0) + v

    @property
    def done(self) -> int:
        return len(self.latencies)


class RawHTTP:
    """A minimal keep-alive HTTP/1.1 client on one connection, for non-streaming load:
    httpx's connection pool costs more CPU per request than the servers measured here,
    so at high concurrency it, not the server, would set the ceiling."""

    def __init__(self, url: str) -> None:
        u = httpx.URL(url)
        self.host, self.port = u.host, u.port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post_json(self, path: str, body: dict, headers: dict) -> tuple[int, bytes]:
        payload = json.dumps(body).encode()
        head = (f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n"
                + "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n").encode()
        for attempt in (0, 1):
            fresh = self.writer is None
            if fresh:
                self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
            try:
                self.writer.write(head + payload)
                return await self._response()
            except (ConnectionError, asyncio.IncompleteReadError):
                await self.close()
                if fresh or attempt:  # a reused keep-alive connection may have been closed: retry once
                    raise
        raise AssertionError("unreachable")

    async def _response(self) -> tuple[int, bytes]:
        raw = await self.reader.readuntil(b"\r\n\r\n")
        lines = raw.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        fields = {}
        for line in lines[1:]:
            if ":" in line:
                k, v = line.split(":", 1)
                fields[k.strip().lower()] = v.strip()
        if fields.get("transfer-encoding", "").lower() == "chunked":
            body = b""
            while True:
                size = int((await self.reader.readuntil(b"\r\n")).split(b";")[0], 16)
                chunk = await self.reader.readexactly(size + 2)
                if size == 0:
                    break
                body += chunk[:-2]
        else:
            body = await self.reader.readexactly(int(fields.get("content-length", "0")))
        if fields.get("connection", "").lower() == "close":
            await self.close()
        return status, body

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            try:
                await self.writer.wait_closed()
            except Exception:
                pass
        self.reader = self.writer = None


async def run_load(one, requests: int, concurrency: int, time_cap: float, raw_url: str | None = None) -> Round:
    """`requests` calls of `one(client, i, round)` from `concurrency` tasks, stopping early at
    `time_cap`. The client: one shared httpx.AsyncClient, or with `raw_url` one RawHTTP per task."""
    result = Round()
    counter = iter(range(requests))
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(120, connect=10), limits=limits) as shared:
        deadline = time.perf_counter() + time_cap

        async def worker() -> None:
            client = RawHTTP(raw_url) if raw_url else shared
            try:
                for i in counter:
                    if time.perf_counter() > deadline:
                        return
                    try:
                        await asyncio.wait_for(one(client, i, result), 120)
                    except Exception as exc:  # counted, never fatal
                        result.errors.append(f"{type(exc).__name__}: {exc}"[:300])
                        if raw_url:
                            await client.close()
            finally:
                if raw_url:
                    await client.close()

        start = time.perf_counter()
        await asyncio.wait_for(asyncio.gather(*(worker() for _ in range(concurrency))), time_cap + 150)
        result.wall = time.perf_counter() - start
    return result


def streaming_call(url: str, model: str, max_tokens: int, key: str | None = None):
    headers = {"Authorization": f"Bearer {key}"} if key else {}

    async def one(client: httpx.AsyncClient, i: int, r: Round) -> None:
        body = {"model": model, "max_tokens": max_tokens, "stream": True,
                "stream_options": {"include_usage": True},
                "messages": [{"role": "user", "content": f"Request {i}: the sea is"}]}
        t0 = time.perf_counter()
        first, tokens, chunks = None, None, 0
        async with client.stream("POST", url + "/v1/chat/completions", json=body, headers=headers) as resp:
            if resp.status_code != 200:
                await resp.aread()
                raise RuntimeError(f"HTTP {resp.status_code}: {resp.text[:200]}")
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    raise RuntimeError(f"stream error: {chunk['error']}")
                for choice in chunk.get("choices") or []:
                    if (choice.get("delta") or {}).get("content"):
                        chunks += 1
                        if first is None:
                            first = time.perf_counter()
                if chunk.get("usage"):
                    tokens = chunk["usage"].get("completion_tokens")
        end = time.perf_counter()
        if first is None:
            raise RuntimeError("no content streamed")
        r.latencies.append(end - t0)
        r.ttfts.append(first - t0)
        r.tokens += tokens if tokens is not None else chunks

    return one


def plain_call(url: str, model: str, max_tokens: int, key: str | None = None):
    """Non-streaming chat completions on a RawHTTP connection (see run_load's raw_url)."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}

    async def one(client: RawHTTP, i: int, r: Round) -> None:
        body = {"model": model, "max_tokens": max_tokens,
                "messages": [{"role": "user", "content": f"Request {i}: the sea is"}]}
        t0 = time.perf_counter()
        status, data = await client.post_json("/v1/chat/completions", body, headers)
        if status != 200:
            raise RuntimeError(f"HTTP {status}: {data[:200]!r}")
        r.latencies.append(time.perf_counter() - t0)
        r.tokens += (json.loads(data).get("usage") or {}).get("completion_tokens", 0)

    return one


def load(one, requests: int, concurrency: int, time_cap: float, raw_url: str | None = None) -> Round:
    coro = run_load(one, requests, concurrency, time_cap, raw_url)
    try:
        import uvloop
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(coro)
    except ImportError:
        return asyncio.run(coro)

