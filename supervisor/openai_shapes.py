"""OpenAI wire shapes: request models for /v1/responses and /v1/chat/completions,
their translation to the backend-neutral job request, and the response objects
and SSE events built from a job's deltas. No I/O here."""

from __future__ import annotations

import json
import os
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from protocol.errors import ErrorCode, PoolError


class _Req(BaseModel):
    # strict: "5" is not an int and "yes" is not a bool; unknown fields are ignored
    model_config = ConfigDict(strict=True, extra="ignore")


class ContentPart(_Req):
    type: str
    text: str | None = None


class InputMessage(_Req):
    type: Literal["message"] | None = None
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]


class ResponsesRequest(_Req):
    model: str = Field(min_length=1)
    input: str | list[InputMessage]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool = False
    metadata: dict[str, str] | None = None
    previous_response_id: str | None = None


class ChatMessage(_Req):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None


class StreamOptions(_Req):
    include_usage: bool = False


class ChatRequest(_Req):
    model: str = Field(min_length=1)
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None


def _text(content: str | list[ContentPart] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content:
        if part.type not in ("input_text", "output_text", "text"):
            raise PoolError(ErrorCode.INVALID_REQUEST, f"content part type {part.type!r} is not supported",
                            param="input")
        parts.append(part.text or "")
    return "".join(parts)


def _role(role: str) -> str:
    return "system" if role == "developer" else role


def job_request_from_responses(req: ResponsesRequest) -> dict:
    if req.previous_response_id is not None:
        raise PoolError(ErrorCode.INVALID_REQUEST, "previous_response_id is not supported: send the "
                        "conversation in `input`", param="previous_response_id")
    messages = [{"role": "system", "content": req.instructions}] if req.instructions else []
    if isinstance(req.input, str):
        messages.append({"role": "user", "content": req.input})
    else:
        messages += [{"role": _role(m.role), "content": _text(m.content)} for m in req.input]
    if not messages:
        raise PoolError(ErrorCode.INVALID_REQUEST, "input is empty", param="input")
    return {"messages": messages, "max_tokens": req.max_output_tokens,
            "temperature": req.temperature, "top_p": req.top_p, "stop": []}


def job_request_from_chat(req: ChatRequest) -> dict:
    stop = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    return {"messages": [{"role": _role(m.role), "content": _text(m.content)} for m in req.messages],
            "max_tokens": req.max_completion_tokens or req.max_tokens,
            "temperature": req.temperature, "top_p": req.top_p, "stop": stop}


# -- Responses objects ----------------------------------------------------------------------------

def new_id(prefix: str) -> str:
    return f"{prefix}_{os.urandom(16).hex()}"


def _usage(usage: dict | None) -> dict | None:
    if usage is None:
        return None
    i, o = int(usage.get("input_tokens", 0)), int(usage.get("output_tokens", 0))
    return {"input_tokens": i, "output_tokens": o, "total_tokens": i + o,
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0}}


def message_item(msg_id: str, text: str | None, status: str) -> dict:
    content = [] if text is None else [
        {"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {"type": "message", "id": msg_id, "role": "assistant", "status": status, "content": content}


def response_object(req: ResponsesRequest, resp_id: str, created_at: int, *, status: str,
                    output: list, usage: dict | None = None, error: dict | None = None) -> dict:
    return {
        "id": resp_id, "object": "response", "created_at": created_at, "status": status,
        "completed_at": int(time.time()) if status in ("completed", "incomplete") else None,
        "model": req.model, "output": output, "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": req.instructions, "metadata": req.metadata or {},
        "previous_response_id": None, "max_output_tokens": req.max_output_tokens,
        "temperature": req.temperature if req.temperature is not None else 1.0,
        "top_p": req.top_p if req.top_p is not None else 1.0,
        "parallel_tool_calls": True, "tool_choice": "auto", "tools": [],
        "text": {"format": {"type": "text"}}, "truncation": "disabled", "store": False,
        "usage": _usage(usage),
    }


def response_status(finish_reason: str) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


class ResponsesStream:
    """Builds the SSE events of one streamed response, numbering them."""

    def __init__(self, req: ResponsesRequest) -> None:
        self.req = req
        self.resp_id = new_id("resp")
        self.msg_id = new_id("msg")
        self.created_at = int(time.time())
        self.seq = 0
        self.parts: list[str] = []

    def _event(self, type_: str, **fields: Any) -> dict:
        event = {"event": type_, "data": json.dumps(
            {"type": type_, "sequence_number": self.seq, **fields}, separators=(",", ":"))}
        self.seq += 1
        return event

    def opening(self) -> list[dict]:
        obj = response_object(self.req, self.resp_id, self.created_at, status="in_progress", output=[])
        return [
            self._event("response.created", response=obj),
            self._event("response.in_progress", response=obj),
            self._event("response.output_item.added", output_index=0,
                        item=message_item(self.msg_id, None, "in_progress")),
            self._event("response.content_part.added", item_id=self.msg_id, output_index=0,
                        content_index=0, part={"type": "output_text", "text": "", "annotations": []}),
        ]

    def delta(self, text: str) -> dict:
        self.parts.append(text)
        return self._event("response.output_text.delta", item_id=self.msg_id, output_index=0,
                           content_index=0, delta=text, logprobs=[])

    def closing(self, finish_reason: str, usage: dict) -> list[dict]:
        text = "".join(self.parts)
        status = response_status(finish_reason)
        item = message_item(self.msg_id, text, "completed" if status == "completed" else "incomplete")
        final = response_object(self.req, self.resp_id, self.created_at, status=status,
                                output=[item], usage=usage)
        return [
            self._event("response.output_text.done", item_id=self.msg_id, output_index=0,
                        content_index=0, text=text, logprobs=[]),
            self._event("response.content_part.done", item_id=self.msg_id, output_index=0,
                        content_index=0, part=item["content"][0]),
            self._event("response.output_item.done", output_index=0, item=item),
            self._event(f"response.{status}", response=final),
        ]

    def failed(self, err: PoolError) -> list[dict]:
        obj = response_object(self.req, self.resp_id, self.created_at, status="failed", output=[],
                              error={"code": err.code.value, "message": err.message})
        return [self._event("response.failed", response=obj)]


# -- Chat Completions objects -----------------------------------------------------------------------

def chat_finish_reason(finish_reason: str) -> str:
    return "length" if finish_reason == "length" else "stop"


def chat_completion(model: str, text: str, finish_reason: str, usage: dict) -> dict:
    i, o = int(usage.get("input_tokens", 0)), int(usage.get("output_tokens", 0))
    return {
        "id": new_id("chatcmpl"), "object": "chat.completion", "created": int(time.time()), "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                     "finish_reason": chat_finish_reason(finish_reason), "logprobs": None}],
        "usage": {"prompt_tokens": i, "completion_tokens": o, "total_tokens": i + o},
    }


class ChatStream:
    """Builds the SSE chunks of one streamed chat completion (same interface
    as ResponsesStream: opening, delta, closing, failed)."""

    def __init__(self, model: str, include_usage: bool) -> None:
        self.model = model
        self.include_usage = include_usage
        self.id = new_id("chatcmpl")
        self.created = int(time.time())

    def chunk(self, delta: dict, finish_reason: str | None = None, usage: dict | None = None) -> dict:
        body: dict[str, Any] = {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                                "model": self.model,
                                "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason,
                                             "logprobs": None}]}
        if usage is not None:
            body["choices"] = []
            body["usage"] = usage
        return {"data": json.dumps(body, separators=(",", ":"))}

    def opening(self) -> list[dict]:
        return [self.chunk({"role": "assistant", "content": ""})]

    def delta(self, text: str) -> dict:
        return self.chunk({"content": text})

    def closing(self, finish_reason: str, usage: dict) -> list[dict]:
        events = [self.chunk({}, chat_finish_reason(finish_reason))]
        if self.include_usage:
            i, o = int(usage.get("input_tokens", 0)), int(usage.get("output_tokens", 0))
            events.append(self.chunk({}, usage={"prompt_tokens": i, "completion_tokens": o,
                                                "total_tokens": i + o}))
        events.append({"data": "[DONE]"})
        return events

    @staticmethod
    def failed(err: PoolError) -> list[dict]:
        return [{"data": json.dumps(err.envelope(), separators=(",", ":"))}, {"data": "[DONE]"}]
