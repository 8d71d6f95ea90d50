"""A prompt's token ids, from the runtime's own tokenizer, for the exact prefix index.

A vLLM replica that relays its KV events reports, in its Ready info, the loopback
address of vLLM's `/tokenize` (it applies the model's chat template to `messages`,
as a chat completion does, and needs no key). Before a request of such a model is
queued, the pool asks one ready replica once, within TOKENIZE_TIMEOUT_S; on any
failure the request goes on without token ids and is routed by the approximate
index (counted in `failures`). Local replicas only: the address is loopback."""

from __future__ import annotations

import asyncio
import logging
import time

import aiohttp
import msgspec

log = logging.getLogger("llm_pool.prompt_tokens")

TOKENIZE_TIMEOUT_S = 2.0
MAX_TOKENS = 1_000_000  # a longer answer is not trusted (nor needed: no cache holds it)
MAX_ANSWER_BYTES = 16 * 1024 * 1024
INLINE_PARSE_BYTES = 64 * 1024  # a larger answer is parsed in a thread, off the event loop
PIECE_BYTES = 256 * 1024  # of a token list, parsed in one step
_CHAT_FIELDS = ("messages", "tools", "chat_template", "chat_template_kwargs", "add_generation_prompt",
                "continue_final_message")


def tokenize_body(request: dict, endpoint: str) -> dict | None:
    """vLLM's /tokenize body for what the request will prompt; None for what no prefix cache reuses."""
    if endpoint == "chat" and isinstance(request.get("messages"), list):
        body = {k: request[k] for k in _CHAT_FIELDS if k in request}
        body.setdefault("add_generation_prompt", not body.get("continue_final_message", False))
        return body
    if endpoint == "completions" and isinstance(request.get("prompt"), str):
        return {"prompt": request["prompt"]}
    return None


class _TokenizeAnswer(msgspec.Struct):
    tokens: msgspec.Raw = msgspec.Raw(b"null")  # its text, checked as JSON, parsed by parse_answer


def parse_answer(raw: bytes) -> list[int] | None:
    """The token ids of a /tokenize answer, or None for an answer without a list of at most
    MAX_TOKENS ints. Parsed PIECE_BYTES at a time: no one step holds the GIL long, so in a
    thread (PromptTokenizer.tokens runs a large answer in one) the event loop runs between
    pieces. (json.loads holds the GIL for the whole answer: a thread alone would not free the loop.)"""
    try:
        ids = bytes(memoryview(msgspec.json.decode(raw, type=_TokenizeAnswer).tokens)).strip()
    except msgspec.DecodeError:  # not JSON (the list's syntax is checked here too), or not an object
        return None
    if not (ids.startswith(b"[") and ids.endswith(b"]")):
        return None
    tokens: list[int] = []
    start, end = 1, len(ids) - 1  # the list's inside
    while start < end:
        cut = ids.find(b",", start + PIECE_BYTES, end)  # a cut inside a string fails that piece's decode
        cut = end if cut < 0 else cut
        try:
            tokens += msgspec.json.decode(b"[" + ids[start:cut] + b"]", type=list[int])
        except msgspec.DecodeError:  # not ints (a bool is not one either)
            return None
        if len(tokens) > MAX_TOKENS:
            return None
        start = cut + 1
    return tokens


async def read_bounded(content: aiohttp.StreamReader, limit: int) -> bytes | None:
    """The whole body, or None once it passes `limit` bytes. (`content.read(n)` is not enough:
    it returns what has arrived so far, which for a long answer is a part of it.)"""
    raw = bytearray()
    async for piece in content.iter_chunked(64 * 1024):
        raw += piece
        if len(raw) > limit:
            return None
    return bytes(raw)


class PromptTokenizer:
    def __init__(self, timeout_s: float = TOKENIZE_TIMEOUT_S, max_answer_bytes: int = MAX_ANSWER_BYTES) -> None:
        self.timeout_s = timeout_s
        self.max_answer_bytes = max_answer_bytes
        self._session: aiohttp.ClientSession | None = None
        self.calls = self.failures = 0
        self.seconds = 0.0  # spent in calls, all together

    async def tokens(self, url: str, request: dict, endpoint: str) -> list[int] | None:
        body = tokenize_body(request, endpoint)
        if body is None:
            return None
        if self._session is None:  # made on first use, inside the running loop
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s))
        self.calls += 1
        start = time.perf_counter()
        tokens = None
        try:
            async with self._session.post(url, json=body, allow_redirects=False) as r:
                raw = await read_bounded(r.content, self.max_answer_bytes) if r.status == 200 else None
                if raw and len(raw) <= INLINE_PARSE_BYTES:
                    tokens = parse_answer(raw)
                elif raw:
                    tokens = await asyncio.to_thread(parse_answer, raw)
                why = (f"HTTP {r.status}" if r.status != 200 else
                       f"an answer over {self.max_answer_bytes} bytes" if raw is None else
                       "an answer without token ids")
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            why = f"{type(exc).__name__}: {exc}"
        self.seconds += time.perf_counter() - start
        if tokens is None:
            self.failures += 1
            log.warning("tokenize at %s failed (%s): this request is routed by the approximate prefix index",
                        url, why)
        return tokens

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
