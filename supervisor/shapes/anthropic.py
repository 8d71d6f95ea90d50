"""Anthropic's Messages API mapped onto chat runtimes, both ways: a /v1/messages body
becomes a Chat Completions job request (system, text, image, tool_use, tool_result and
thinking blocks; tools, tool_choice, stop_sequences, sampling, metadata.user_id), and
a job's deltas become content blocks (thinking, text, tool_use) and the streamed
events in the API's order. Errors take Anthropic's envelope here. No I/O here."""

from __future__ import annotations

import json
import re
import time
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from protocol import Done
from protocol.errors import ErrorCode, PoolError
from supervisor.shapes.openai import Choices, ModelName, OneAtATime, OutputTokens, new_id
from supervisor.request_bounds import echo

# Anthropic fields about its own service (tiers, containers, server tools' context): they ask
# nothing of a local runtime. Dropped, and named in the README.
BOOKKEEPING = frozenset({"service_tier", "container", "context_management", "anthropic_version",
                         "output_config"})  # output_config: its effort is mapped (job_request_from_messages)
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use",
                "content_filter": "refusal"}
# The pool's error codes as Anthropic's error types; 529 overloaded_error where the
# API would say it is overloaded (a full queue, no replica that can serve)
OVERLOADED = frozenset({ErrorCode.QUEUE_FULL, ErrorCode.NO_HEALTHY_REPLICA, ErrorCode.DEADLINE_UNMEETABLE})
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 409: "invalid_request_error", 413: "request_too_large",
               429: "rate_limit_error", 431: "invalid_request_error", 529: "overloaded_error"}


class _Conversation(msgspec.Struct, kw_only=True):
    """What a Messages request and a count_tokens request share."""
    model: ModelName
    messages: list[dict[str, Any]]
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None


class CountTokensRequest(_Conversation, kw_only=True):
    """/v1/messages/count_tokens: the prompt a Messages request with this body would have."""


class MessagesRequest(_Conversation, kw_only=True):
    """The fields the pool reads (strictly typed); the body's other fields pass on to the
    runtime (see `job_request_from_messages`)."""
    max_tokens: OutputTokens
    stream: bool = False
    temperature: Annotated[float, Meta(ge=0, le=1)] | None = None
    top_p: Annotated[float, Meta(gt=0, le=1)] | None = None
    top_k: Annotated[int, Meta(ge=0)] | None = None
    stop_sequences: list[str] | None = None
    metadata: dict[str, Any] | None = None


DECLARED = frozenset(MessagesRequest.__struct_fields__)


# Claude Code's first system block, "x-anthropic-billing-header: cc_version=...; cc_entrypoint=...;
# cch=<5 hex digits>;", changes its cch on every request: kept, it would defeat every prefix cache
# (the runtime's, and routing = "prefix") from the prompt's first line. Its value is made one
# constant, as llama-server does on its own Messages route; the rest of the line stays.
BILLING_STAMP = re.compile(r"(x-anthropic-billing-header:[^\n]*?\bcch=)[^;\s]*")


def unstamped(system: str) -> str:
    return BILLING_STAMP.sub(r"\1fffff", system) if "x-anthropic-billing-header" in system else system


def _bad(message: str, param: str, code: ErrorCode = ErrorCode.INVALID_REQUEST) -> PoolError:
    return PoolError(code, message, param=param)


# -- request: Messages -> Chat Completions -----------------------------------------------------------------

def _text_of(blocks, where: str) -> str:
    """The text of a `system` or `tool_result` content: a string, or text blocks."""
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise _bad(f"{where} must be text or a list of text blocks", where)
    texts = []
    for n, block in enumerate(blocks):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            raise _bad(f"{where}.{n}: only text blocks are supported here", f"{where}.{n}",
                       ErrorCode.UNSUPPORTED_PARAMETER)
        texts.append(block["text"])
    return "\n".join(texts)


def _image(block: dict, where: str) -> dict:
    source = block.get("source")
    source = source if isinstance(source, dict) else {}
    if source.get("type") == "base64" and isinstance(source.get("data"), str):
        url = f"data:{source.get('media_type', 'image/png')};base64,{source['data']}"
    elif source.get("type") == "url" and isinstance(source.get("url"), str):
        url = source["url"]
    else:
        raise _bad(f"{where}: an image needs a base64 or url source", f"{where}.source")
    return {"type": "image_url", "image_url": {"url": url}}


def _user_turn(content: list, where: str) -> list[dict]:
    """A user turn's blocks: tool results become tool messages (first, as chat wants them
    right after the assistant's calls), the rest one user message."""
    tools, parts = [], []
    for n, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        at = f"{where}.content.{n}"
        if kind == "text" and isinstance(block.get("text"), str):
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image":
            parts.append(_image(block, at))
        elif kind == "tool_result" and isinstance(block.get("tool_use_id"), str):
            text = _text_of(block.get("content", ""), f"{at}.content")
            tools.append({"role": "tool", "tool_call_id": block["tool_use_id"],
                          "content": f"Error: {text}" if block.get("is_error") else text})
        else:
            raise _bad(f"content block type {echo(kind)} is not supported in a user turn", at,
                       ErrorCode.UNSUPPORTED_PARAMETER)
    if not parts:
        return tools
    text_only = all(part["type"] == "text" for part in parts)
    return tools + [{"role": "user", "content": "".join(part["text"] for part in parts) if text_only else parts}]


def _assistant_turn(content: list, where: str) -> dict:
    message: dict[str, Any] = {"role": "assistant", "content": None}
    texts, reasoning, calls = [], [], []
    for n, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        at = f"{where}.content.{n}"
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "thinking" and isinstance(block.get("thinking"), str):
            reasoning.append(block["thinking"])
        elif kind == "redacted_thinking":
            continue  # encrypted by Anthropic: nothing a local model can read (README)
        elif kind == "tool_use" and isinstance(block.get("id"), str) and isinstance(block.get("name"), str):
            calls.append({"id": block["id"], "type": "function", "function": {
                "name": block["name"], "arguments": json.dumps(block.get("input") or {}, separators=(",", ":"))}})
        else:
            raise _bad(f"content block type {echo(kind)} is not supported in an assistant turn", at,
                       ErrorCode.UNSUPPORTED_PARAMETER)
    if texts:
        message["content"] = "".join(texts)
    if reasoning:
        message["reasoning_content"] = "".join(reasoning)
    if calls:
        message["tool_calls"] = calls
    return message


def _messages(req: _Conversation) -> list[dict]:
    out: list[dict] = []
    if req.system:
        out.append({"role": "system", "content": unstamped(_text_of(req.system, "system"))})
    for n, message in enumerate(req.messages):
        where = f"messages.{n}"
        role, content = message.get("role"), message.get("content")
        if role == "system":  # a system turn mid-conversation (Claude Code's beta of that name)
            out.append({"role": "system", "content": _text_of(content, f"{where}.content")})
            continue
        if role not in ("user", "assistant"):
            raise _bad(f"{where}.role must be user, assistant or system", f"{where}.role")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
        elif isinstance(content, list):
            out += _user_turn(content, where) if role == "user" else [_assistant_turn(content, where)]
        else:
            raise _bad(f"{where}.content must be text or a list of content blocks", f"{where}.content")
    if not req.messages:
        raise _bad("messages: at least one message is required", "messages")
    return out


def _tools(tools: list[dict]) -> list[dict]:
    out = []
    for n, tool in enumerate(tools):
        if tool.get("type") not in (None, "custom"):
            raise _bad(f"tool type {echo(tool.get('type'))} is not supported: only client tools with an "
                       "input_schema", f"tools.{n}.type", ErrorCode.UNSUPPORTED_PARAMETER)
        if not isinstance(tool.get("name"), str):
            raise _bad("a tool needs a name", f"tools.{n}.name")
        function = {"name": tool["name"], "parameters": tool.get("input_schema") or {"type": "object"}}
        if tool.get("description"):
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: dict, request: dict) -> None:
    kind = choice.get("type")
    if kind in ("auto", "none"):
        request["tool_choice"] = kind
    elif kind == "any":
        request["tool_choice"] = "required"
    elif kind == "tool" and isinstance(choice.get("name"), str):
        request["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    else:
        raise _bad(f"tool_choice type {echo(kind)} is not auto, any, tool or none", "tool_choice.type")
    if choice.get("disable_parallel_tool_use"):
        request["parallel_tool_calls"] = False


def job_request_from_messages(req: MessagesRequest, data: dict) -> dict:
    """The Chat Completions body for a Messages request (`data`: its JSON object as sent)."""
    request: dict[str, Any] = {"messages": _messages(req), "max_tokens": req.max_tokens}
    for key, value in (("temperature", req.temperature), ("top_p", req.top_p), ("top_k", req.top_k),
                       ("stop", req.stop_sequences)):
        if value is not None:
            request[key] = value
    if req.tools:
        request["tools"] = _tools(req.tools)
    if req.tool_choice is not None:
        _tool_choice(req.tool_choice, request)
    user = (req.metadata or {}).get("user_id")
    if isinstance(user, str):
        request["user"] = user  # also a session key for routing = "session"
    if req.thinking is not None and req.thinking.get("type") not in ("enabled", "disabled", "adaptive"):
        raise _bad(f"thinking type {echo(req.thinking.get('type'))} is not enabled, adaptive or disabled",
                   "thinking.type")
    effort = (data.get("output_config") or {}).get("effort") if isinstance(data.get("output_config"), dict) else None
    if isinstance(effort, str):
        request["reasoning_effort"] = effort  # as vLLM's own Messages surface maps it
    for key, value in data.items():  # e.g. seed: the runtime judges it
        if key not in DECLARED and key not in BOOKKEEPING:
            request[key] = value
    return request


def native_request(data: dict) -> dict:
    """The body for a runtime's own /v1/messages: as sent, less what the pool owns (the model's
    name, streaming)."""
    return {k: v for k, v in data.items() if k not in ("model", "stream")}


def user_of(req: MessagesRequest) -> str | None:
    """metadata.user_id: a session key for routing = "session"."""
    user = (req.metadata or {}).get("user_id")
    return user if isinstance(user, str) and user else None


def tokenize_request(req: CountTokensRequest) -> dict:
    """A count_tokens request as the chat a runtime's /tokenize counts (vLLM's form: `messages`
    and `tools`, with the model's chat template), for runtimes without their own count route."""
    request: dict[str, Any] = {"messages": _messages(req), "add_generation_prompt": True}
    if req.tools:
        request["tools"] = _tools(req.tools)
    return request


# -- answers: job output -> Messages ---------------------------------------------------------------------------

def _usage(usage: dict | None) -> dict:
    """Anthropic's usage: its input_tokens leave out what was read from the cache (counted apart)."""
    usage = usage or {}
    cached = int(usage.get("cached_tokens", 0))
    return {"input_tokens": max(0, int(usage.get("input_tokens", 0)) - cached),
            "output_tokens": int(usage.get("output_tokens", 0)),
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}


def _stop(done: Done) -> dict:
    """stop_reason and stop_sequence: "stop_sequence" with the one that matched, where the
    runtime said (its own Messages route does; a chat answer does not say which)."""
    sequence = done.result.get("stop_sequence") if isinstance(done.result, dict) else None
    if isinstance(sequence, str):
        return {"stop_reason": "stop_sequence", "stop_sequence": sequence}
    return {"stop_reason": STOP_REASONS.get(done.finish_reason, "end_turn"), "stop_sequence": None}


def _tool_input(arguments: str) -> dict:
    try:
        value = json.loads(arguments) if arguments else {}
    except ValueError:
        return {"_raw": arguments}  # the model wrote no valid JSON: kept, not lost
    return value if isinstance(value, dict) else {"_value": value}


def message_json(req: MessagesRequest, choices: Choices, done: Done) -> dict:
    """A whole (not streamed) message: thinking, text and tool_use blocks in that order."""
    c = choices.get(0)
    content: list[dict] = []
    if c.reasoning:
        content.append({"type": "thinking", "thinking": "".join(c.reasoning), "signature": ""})
    if c.text or c.refusal:
        content.append({"type": "text", "text": "".join(c.text + c.refusal)})
    for _, call in sorted(c.tools.items()):
        content.append({"type": "tool_use", "id": call["id"] or new_id("toolu"), "name": call["name"] or "",
                        "input": _tool_input("".join(call["args"]))})
    return {"id": new_id("msg"), "type": "message", "role": "assistant", "model": req.model, "content": content,
            **_stop(done), "usage": _usage(done.usage)}


_json_str = json.JSONEncoder().encode  # a str goes straight to the C escaper (as json.dumps)


def _frame(event: dict) -> bytes:
    return f"event: {event['event']}\ndata: {event['data']}\n\n".encode()


def _event(kind: str, **fields: Any) -> dict:
    return {"event": kind, "data": json.dumps({"type": kind, **fields}, separators=(",", ":"))}


class MessagesStream(OneAtATime):
    """The SSE events of one streamed message. A content block opens as the runtime's
    parts of its kind arrive (thinking, text, each tool call) and closes when the next
    kind begins or the job is done."""

    ping_frame = b'event: ping\ndata: {"type": "ping"}\n\n'  # a stream's keep-alive, Anthropic's

    def __init__(self, req: MessagesRequest) -> None:
        self.req = req
        self.msg_id = new_id("msg")
        self.index = -1  # the open block's index
        self.key = None  # what the open block holds: "text", "reasoning" (a thinking block), or ("tool", n)
        self._text_pre = (-1, b"")  # (block index, the bytes of its text delta event up to the text)

    def text_sse(self, text: str) -> bytes:
        """The SSE bytes of a plain text delta (the token path): what the events of
        delta(Delta(text=text)) give, without building their dicts when a text block is open."""
        if self.key != "text":
            return b"".join(_frame(e) for e in self._open("text", {}) + self._piece("text", {"t": text}))
        index, pre = self._text_pre
        if index != self.index:
            pre = (f'event: content_block_delta\ndata: {{"type":"content_block_delta","index":{self.index},'
                   f'"delta":{{"type":"text_delta","text":').encode()
            self._text_pre = (self.index, pre)
        return b"".join((pre, _json_str(text).encode(), b"}}\n\n"))

    def opening(self, first=None) -> list[dict]:
        return [_event("message_start", message={
            "id": self.msg_id, "type": "message", "role": "assistant", "model": self.req.model, "content": [],
            "stop_reason": None, "stop_sequence": None, "usage": _usage(None)})]

    def _open(self, key, part: dict) -> list[dict]:
        events = self._close()
        self.index += 1
        self.key = key
        if key == "text":
            block = {"type": "text", "text": ""}
        elif key == "reasoning":
            block = {"type": "thinking", "thinking": "", "signature": ""}
        else:
            block = {"type": "tool_use", "id": part.get("id") or new_id("toolu"), "name": part.get("name", ""),
                     "input": {}}
        return events + [_event("content_block_start", index=self.index, content_block=block)]

    def _close(self) -> list[dict]:
        if self.key is None:
            return []
        events = []
        if self.key == "reasoning":  # clients expect a signature before a thinking block ends
            events.append(_event("content_block_delta", index=self.index,
                                 delta={"type": "signature_delta", "signature": ""}))
        self.key = None
        return events + [_event("content_block_stop", index=self.index)]

    def _piece(self, kind: str, part: dict) -> list[dict]:
        if kind == "tool":
            delta = {"type": "input_json_delta", "partial_json": part["args"]} if part.get("args") else None
        elif part.get("t"):
            delta = ({"type": "thinking_delta", "thinking": part["t"]} if kind == "reasoning"
                     else {"type": "text_delta", "text": part["t"]})
        else:
            delta = None
        return [] if delta is None else [_event("content_block_delta", index=self.index, delta=delta)]

    def closing(self, done: Done) -> list[dict]:
        events = self._open("text", {}) if self.index < 0 else []  # nothing came: an empty text block
        usage = _usage(done.usage)
        return events + self._close() + [
            _event("message_delta", delta=_stop(done), usage=usage),
            _event("message_stop")]

    def failed(self, err: PoolError) -> list[dict]:
        return [{"event": "error", "data": json.dumps(error_envelope(err)[1], separators=(",", ":"))}]


_CONTEXT = re.compile(r"maximum context length is (\d+) tokens\.(?: However, your messages resulted in (\d+) tokens)?")


def error_envelope(err: PoolError) -> tuple[int, dict]:
    """(status, body) of a PoolError in Anthropic's envelope. A request over the model's
    context is worded as Anthropic words it, which Claude Code acts on (it compacts)."""
    status = 529 if err.code in OVERLOADED else err.status
    kind = ERROR_TYPES.get(status, "api_error")
    message = err.message
    if err.code is ErrorCode.CONTEXT_LENGTH_EXCEEDED and (sizes := _CONTEXT.search(message)):
        context, prompt = sizes.group(1), sizes.group(2)
        message = f"prompt is too long: {prompt or 'more than ' + context} tokens > {context} maximum"
    return status, {"type": "error", "error": {"type": kind, "message": message}}


def anthropic_model_page(listed: list[dict], limit: int, after_id: str | None) -> dict:
    """/v1/models as Anthropic's Models API pages it (`limit` 1 to 1000, after `after_id`);
    `max_input_tokens`: the model's context window, where its runtime reports it (else null)."""
    if not 1 <= limit <= 1000:
        raise _bad("limit must be between 1 and 1000", "limit")
    ids = [m["id"] for m in listed]
    start = ids.index(after_id) + 1 if after_id in ids else 0
    page = listed[start:start + limit]
    data = [{"type": "model", "id": m["id"], "display_name": m["id"],
             "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(m.get("created") or 0)),
             "max_input_tokens": m.get("context_length")}
            for m in page]
    return {"data": data, "has_more": start + limit < len(listed),
            "first_id": data[0]["id"] if data else None, "last_id": data[-1]["id"] if data else None}
