"""A runtime's own Anthropic Messages route (llama-server's and vLLM's /v1/messages), relayed as the
job's events: the client's body goes to the runtime as sent (streaming is the pool's:
always on), and the runtime's event stream comes back as the protocol's typed parts
(text, thinking as reasoning, each tool_use block's id, name and input_json fragments)
and one Finished with its stop reason, stop sequence and usage. The supervisor shapes
them into the Messages answer with the one shaper every backend's messages go through
(supervisor/shapes/anthropic.py), so that the bounds, metering and request log are the
same for every runtime. What is read is bounded as every answer (UpstreamBody, sse_data)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import TYPE_CHECKING

import aiohttp

from protocol.errors import ErrorCode
from runtime_worker.backends.base import Event, Finished, JobError, PartsDelta, TextDelta
from runtime_worker.openai_events import MAX_TOOL_CALLS
from runtime_worker.upstream import (
    UpstreamBody, connection_lost, json_object, runtime_reported, sse_data, upstream_error)

if TYPE_CHECKING:
    from runtime_worker.native_server import OpenAIClient

# Anthropic's stop reasons as the protocol's finish reasons (the supervisor maps them back)
FINISH = {"end_turn": "stop", "stop_sequence": "stop", "max_tokens": "length", "tool_use": "tool_calls",
          "refusal": "content_filter", "pause_turn": "stop"}


class MessagesRelay:
    """One job's events from the runtime's Messages stream (`events`)."""

    def __init__(self) -> None:
        self.blocks: dict[int, int] = {}  # a tool_use block's index -> its tool number
        self.input_tokens = self.cached = self.output_tokens = 0
        self.stop_reason: str | None = None
        self.stop_sequence: str | None = None
        self.stopped = False

    def event(self, data: dict) -> Event | None:
        kind = data.get("type")
        if kind == "content_block_delta":
            return self._delta(data)
        if kind == "content_block_start":
            return self._start(data)
        if kind == "message_start":
            self._usage((data.get("message") or {}).get("usage"))
        elif kind == "message_delta":
            delta = data.get("delta") or {}
            self.stop_reason = delta.get("stop_reason") or self.stop_reason
            if isinstance(delta.get("stop_sequence"), str):
                self.stop_sequence = delta["stop_sequence"]
            self._usage(data.get("usage"))
        elif kind == "message_stop":
            self.stopped = True
        elif kind == "error":
            raise runtime_reported(data.get("error") or data)
        return None  # ping, content_block_stop, and what a newer runtime adds

    def _start(self, data: dict) -> Event | None:
        block = data.get("content_block") or {}
        if block.get("type") != "tool_use":
            return None  # a text or thinking block opens with its first delta
        if len(self.blocks) >= MAX_TOOL_CALLS:  # the pool holds each one's number: bounded as on chat
            raise JobError(ErrorCode.PROTOCOL_ERROR, f"the runtime sent over {MAX_TOOL_CALLS} tool_use blocks")
        number = self.blocks[data.get("index", -1)] = len(self.blocks)
        given = block.get("input")
        part = {"k": "tool", "n": number, "id": str(block.get("id", "")), "name": str(block.get("name", "")),
                "args": json.dumps(given) if given else ""}
        return PartsDelta([part])

    def _delta(self, data: dict) -> Event | None:
        delta = data.get("delta") or {}
        kind = delta.get("type")
        if kind == "text_delta" and delta.get("text"):
            return TextDelta(str(delta["text"]))
        if kind == "thinking_delta" and delta.get("thinking"):
            return PartsDelta([{"k": "reasoning", "t": str(delta["thinking"])}])
        if kind == "input_json_delta" and delta.get("partial_json"):
            number = self.blocks.get(data.get("index", -1), 0)
            return PartsDelta([{"k": "tool", "n": number, "args": str(delta["partial_json"])}])
        return None  # signature_delta: the pool signs nothing and checks nothing

    def _usage(self, usage) -> None:
        if not isinstance(usage, dict):
            return
        for key, field in (("input_tokens", "input_tokens"), ("cache_read_input_tokens", "cached"),
                           ("output_tokens", "output_tokens")):
            value = usage.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
                setattr(self, field, value)

    def finished(self) -> Finished:
        if not self.stopped:
            raise JobError(ErrorCode.RUNTIME_ERROR, "the runtime's message stream ended without message_stop")
        result = {"stop_sequence": self.stop_sequence} if self.stop_sequence is not None else None
        # Anthropic counts cache reads apart from input_tokens; the protocol's input is the whole prompt
        return Finished(FINISH.get(self.stop_reason or "", "stop"), self.input_tokens + self.cached,
                        self.output_tokens, cached_tokens=self.cached, result=result)


async def relay_messages(client: OpenAIClient, request: dict, headers: dict | None = None) -> AsyncIterator[Event]:
    """One /v1/messages job against the runtime behind `client` (`headers`: the client's
    anthropic-version and anthropic-beta, forwarded)."""
    relay = MessagesRelay()
    body = client.body(request, stream=False, generate=True)
    body["stream"] = True
    try:
        r = await client.post("/messages", body, headers)
        try:
            upstream = UpstreamBody(r, client.limits)
            if r.status != 200:
                raise upstream_error(r.status, await upstream.error_text())
            if r.content_type != "text/event-stream":
                raise JobError(ErrorCode.RUNTIME_ERROR, f"the runtime answered with "
                               f"{r.content_type or 'no content type'}, not text/event-stream")
            async with aclosing(sse_data(upstream, client.limits.max_upstream_line_bytes)) as lines:
                async for data in lines:
                    event = relay.event(json_object(data, "an event"))
                    if event is not None:
                        yield event
        finally:
            r.close()  # mid-stream (a cancel, an error) this drops the connection: the runtime frees the slot
    except (aiohttp.ClientError, ConnectionError) as exc:
        raise connection_lost(exc) from None
    yield relay.finished()
