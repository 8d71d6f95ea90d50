"""Ollama's API (/api/chat, /api/generate and the model listings) on the pool's request path:
its bodies mapped onto the runtime's chat and completions, its answers shaped as Ollama's
(NDJSON streams by default, `"stream": false` for one JSON object), with the durations the
pool measured. Fields the pool cannot honour are refused by name (400), never dropped."""

from __future__ import annotations

import json
import time
from datetime import datetime, timezone
from typing import Any

import msgspec

from protocol import Delta, Done
from protocol.errors import ErrorCode, PoolError
from supervisor.request_bounds import clip
from supervisor.shapes.openai import Choices, first_choice_parts

API_VERSION = "0.12.0"  # the Ollama API release whose shapes these are (GET /api/version)
NDJSON_HEADERS = [(b"content-type", b"application/x-ndjson"), (b"cache-control", b"no-cache"),
                  (b"x-accel-buffering", b"no")]
LATEST = ":latest"  # Ollama's default tag: "smollm2:latest" names the pool's "smollm2"

# options: Ollama's name -> the runtime's sampling field (llama-server takes each on its OpenAI routes)
OPTION_FIELDS = {"num_predict": "max_tokens", "temperature": "temperature", "top_k": "top_k", "top_p": "top_p",
                 "min_p": "min_p", "stop": "stop", "seed": "seed", "repeat_penalty": "repeat_penalty",
                 "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty"}
CONTEXT_OPTION = "num_ctx"  # checked against the model's context, not sent


class _Body(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str
    stream: bool = True
    options: dict[str, Any] | None = None
    format: str | dict[str, Any] | None = None
    keep_alive: str | int | float | None = None  # residency is the pool's (idle_unload_s): read, not obeyed
    think: bool | str | None = None


class ChatBody(_Body, kw_only=True, forbid_unknown_fields=True):
    messages: list[dict[str, Any]] = []
    tools: list[dict[str, Any]] | None = None


class GenerateBody(_Body, kw_only=True, forbid_unknown_fields=True):
    prompt: str = ""
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    raw: bool = False
    images: list[str] | None = None
    context: list[int] | None = None


class ShowBody(msgspec.Struct, kw_only=True):
    model: str | None = None
    name: str | None = None  # the older spelling
    verbose: bool = False


def model_name(name: str, known) -> str:
    """The pool's name for an Ollama model name: as given when the pool has it, else without
    its ":latest" tag."""
    if name.endswith(LATEST) and not known(name):
        return name[:-len(LATEST)]
    return name


def tagged(name: str) -> str:
    """The name Ollama's listings give a model: with a tag (":latest" unless it has one)."""
    return name if ":" in name else name + LATEST


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def unsupported(param: str, why: str) -> PoolError:
    return PoolError(ErrorCode.INVALID_REQUEST, f"{param}: {why}", param=param)


def sampling(body: _Body, context: int | None) -> dict:
    """The runtime's sampling fields from `options` (num_ctx checked, anything else refused by name),
    `format` and `think`."""
    out: dict[str, Any] = {}
    for key, value in (body.options or {}).items():
        if key == CONTEXT_OPTION:
            if context is not None and isinstance(value, int) and value > context:
                raise unsupported("options.num_ctx", f"{value} is over the model's context ({context} tokens); "
                                  "the pool runs each model at its configured context")
            continue
        field = OPTION_FIELDS.get(key)
        if field is None:
            raise unsupported(f"options.{clip(key)}", f"not an option the pool can honour (it maps "
                              f"{', '.join([*OPTION_FIELDS, CONTEXT_OPTION])})")
        if key == "num_predict" and isinstance(value, int) and value < 0:
            continue  # -1: until the model stops; -2: fill the context: the runtime's own bound
        out[field] = value
    if body.format == "json":
        out["response_format"] = {"type": "json_object"}
    elif isinstance(body.format, dict):
        out["response_format"] = {"type": "json_schema", "json_schema": {"name": "format", "schema": body.format}}
    elif body.format not in (None, ""):
        raise unsupported("format", 'expected "json" or a JSON schema')
    if body.think not in (None, False):
        raise unsupported("think", "the pool does not ask a runtime to separate its reasoning yet")
    return out


def _message(message: dict) -> dict:
    """An Ollama chat message as the runtime's (OpenAI's) message."""
    role, content = message.get("role"), message.get("content") or ""
    if not isinstance(role, str) or not isinstance(content, str):
        raise unsupported("messages", "each message needs a role and a text content")
    out: dict[str, Any] = {"role": role, "content": content}
    images = message.get("images")
    if images:
        out["content"] = [{"type": "text", "text": content},
                          *({"type": "image_url", "image_url": {"url": f"data:image/png;base64,{image}"}}
                            for image in images)]
    calls = message.get("tool_calls")
    if calls:
        out["tool_calls"] = [{"id": f"call_{i}", "type": "function",
                              "function": {"name": call.get("function", {}).get("name", ""),
                                           "arguments": json.dumps(call.get("function", {}).get("arguments", {}))}}
                             for i, call in enumerate(calls)]
    if role == "tool":
        out["tool_call_id"] = message.get("tool_name") or "call_0"
    unknown = set(message) - {"role", "content", "images", "tool_calls", "tool_name", "thinking"}
    if unknown:
        raise unsupported(f"messages.{clip(sorted(unknown)[0])}", "not a message field the pool can honour")
    return out


def chat_job(body: ChatBody, context: int | None) -> dict:
    if not body.messages:
        raise unsupported("messages", "at least one message is needed")
    request = {"messages": [_message(m) for m in body.messages], **sampling(body, context)}
    if body.tools:
        request["tools"] = body.tools
    return request


def generate_job(body: GenerateBody, context: int | None) -> tuple[dict, str]:
    """(the runtime's request, its job endpoint): `raw` goes to completions as written; else the
    prompt (and system) go through the model's own chat template."""
    for name in ("template", "suffix", "context"):
        if getattr(body, name):
            raise unsupported(name, "the pool applies the model's own template; not honoured")
    params = sampling(body, context)
    if body.raw:
        if body.images or body.system:
            raise unsupported("raw", "a raw prompt takes no images or system")
        return {"prompt": body.prompt, **params}, "completions"
    user = {"role": "user", "content": body.prompt, **({"images": body.images} if body.images else {})}
    messages = ([{"role": "system", "content": body.system}] if body.system else []) + [user]
    return {"messages": [_message(m) for m in messages], **params}, "chat"


class Timing:
    """What the pool measured of one request, in Ollama's nanoseconds: arrival, first token, end."""

    def __init__(self, started: float) -> None:
        self.started = started
        self.first: float | None = None

    def token(self) -> None:
        if self.first is None:
            self.first = time.monotonic()

    def of(self, job) -> Timing:
        """For a whole answer: its first token when the job's first output came (the pool's own clock)."""
        self.first = job.first_token_at
        return self

    def fields(self, done: Done) -> dict:
        end = time.monotonic()
        first = self.first or end
        usage = done.usage
        return {"total_duration": int((end - self.started) * 1e9), "load_duration": 0,
                "prompt_eval_count": int(usage.get("input_tokens", 0)),
                "prompt_eval_duration": int((first - self.started) * 1e9),
                "eval_count": int(usage.get("output_tokens", 0)), "eval_duration": int((end - first) * 1e9)}


def _tool_calls(tools: dict[int, dict]) -> list[dict]:
    """Ollama's tool calls (arguments as an object) from a choice's accumulated calls."""
    calls = []
    for _, call in sorted(tools.items()):
        text = "".join(call["args"])
        try:
            arguments = json.loads(text) if text else {}
        except ValueError:
            arguments = {"_raw": text}  # not JSON: kept whole rather than lost
        calls.append({"function": {"name": call["name"] or "", "arguments": arguments}})
    return calls


def answer(body: _Body, kind: str, choices: Choices, done: Done, timing: Timing) -> dict:
    """The whole answer: a chat's `message`, or a generate's `response`."""
    choice = choices.get(0)
    text = "".join(choice.text)
    out: dict[str, Any] = {"model": body.model, "created_at": now_iso()}
    if kind == "chat":
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if choice.reasoning:
            message["thinking"] = "".join(choice.reasoning)
        if choice.tools:
            message["tool_calls"] = _tool_calls(choice.tools)
        out["message"] = message
    else:
        out["response"] = text
    return {**out, "done": True, "done_reason": done.finish_reason or "stop", **timing.fields(done)}


def ndjson_frame(event: dict) -> bytes:
    return json.dumps(event, separators=(",", ":"), ensure_ascii=False).encode() + b"\n"


class OllamaStream:
    """One streamed answer as Ollama's NDJSON lines (the interface of the other stream shapes:
    opening, delta, closing, failed; `frame` writes each line, and no keep-alive line is sent)."""

    frame = staticmethod(ndjson_frame)
    media_headers = NDJSON_HEADERS
    ping_frame = b""  # NDJSON has no comment line: a stream waiting in its queue sends nothing

    def __init__(self, body: _Body, kind: str, timing: Timing) -> None:
        self.body = body
        self.kind = kind
        self.timing = timing
        self.tools: dict[int, dict] = {}

    def _line(self, text: str = "", reasoning: str = "") -> dict:
        out: dict[str, Any] = {"model": self.body.model, "created_at": now_iso()}
        if self.kind == "chat":
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if reasoning:
                message["thinking"] = reasoning
            out["message"] = message
        else:
            out["response"] = text
        out["done"] = False
        return out

    def opening(self, first=None) -> list[dict]:
        return []

    def delta(self, event: Delta) -> list[dict]:
        self.timing.token()
        lines = []
        for what, part in first_choice_parts(event):
            if what == "text" and part.get("t"):
                lines.append(self._line(text=part["t"]))
            elif what == "reasoning" and part.get("t"):
                lines.append(self._line(reasoning=part["t"]))
            elif isinstance(what, tuple):  # a tool call's pieces: whole in the last line, as Ollama sends it
                call = self.tools.setdefault(part.get("n", 0), {"name": None, "args": []})
                call["name"] = call["name"] or part.get("name")
                call["args"].append(part.get("args", ""))
        return lines

    def closing(self, done: Done) -> list[dict]:
        last = self._line()
        if self.tools and self.kind == "chat":
            last["message"]["tool_calls"] = _tool_calls(self.tools)
        last.update({"done": True, "done_reason": done.finish_reason or "stop", **self.timing.fields(done)})
        return [last]

    @staticmethod
    def failed(err: PoolError) -> list[dict]:
        return [{"error": err.message}]
