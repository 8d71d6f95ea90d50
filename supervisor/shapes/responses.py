"""The Responses API mapped onto chat runtimes, both ways: a /v1/responses
body becomes a Chat Completions job request (instructions, input items,
function tools, tool_choice, text.format, reasoning effort), and a job's
deltas become output items (reasoning, message, function_call) and the
streamed events in the spec's order. No I/O here."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from protocol import Delta, Done
from protocol.errors import ErrorCode, PoolError
from supervisor.shapes.openai import (
    Choices, ModelName, OneAtATime, OutputTokens, Temperature, new_id, runtime_fields)
from supervisor.request_bounds import echo
from supervisor.shapes.responses_tools import ChatTools, chat_tool_choice, chat_tools

OUTPUT_LIMIT_KEYS = ("max_tokens", "max_completion_tokens")  # what stops the output, as the runtime is sent it

# Responses fields about the Responses API's own storage and delivery: the pool stores
# nothing and answers at once, so these ask nothing of the runtime and are not sent on.
# (prompt_cache_key is sent on, as in Chat Completions: the pool routes on it.)
BOOKKEEPING = frozenset({"store", "include", "truncation", "service_tier",
                         "safety_identifier", "stream_options"})


class ResponsesRequest(msgspec.Struct, kw_only=True):
    """The fields the pool reads (strictly typed: "5" is not an int, "yes" not a bool); the
    body's other fields pass on to the runtime (see `job_request_from_responses`)."""
    model: ModelName
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: OutputTokens | None = None
    temperature: Temperature | None = None
    top_p: Annotated[float, Meta(gt=0, le=1)] | None = None
    stream: bool = False
    metadata: dict[str, str] | None = None
    previous_response_id: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None


DECLARED = frozenset(ResponsesRequest.__struct_fields__)


def _bad(message: str, param: str, code: ErrorCode = ErrorCode.INVALID_REQUEST) -> PoolError:
    return PoolError(code, message, param=param)


def _content(content, where: str) -> str | list[dict]:
    """A message's content: plain text stays a string (every chat template
    takes one); images make it a list of chat content parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"{where}.content must be text or a list of content parts", f"{where}.content")
    parts = []
    for n, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "input_image" and isinstance(part.get("image_url"), str):
            image = {"url": part["image_url"]}
            if part.get("detail"):
                image["detail"] = part["detail"]
            parts.append({"type": "image_url", "image_url": image})
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            parts.append({"type": "text", "text": part["refusal"]})
        else:
            raise _bad(f"content part type {echo(kind)} is not supported", f"{where}.content.{n}",
                       ErrorCode.UNSUPPORTED_PARAMETER)
    if all(part["type"] == "text" for part in parts):
        return joined_text(part["text"] for part in parts)
    return parts


def joined_text(texts) -> str:
    """Text parts as one text, as llama-server joins them for a chat template (common/chat.cpp's
    concat_content_parts) and vLLM does: one newline between parts, none before the first
    text (empty parts at the start add nothing)."""
    out = ""
    for text in texts:
        out = f"{out}\n{text}" if out else text
    return out


def _messages(req: ResponsesRequest, tools: ChatTools) -> list[dict]:
    messages: list[dict] = [{"role": "system", "content": req.instructions}] if req.instructions else []
    if isinstance(req.input, str):
        return messages + [{"role": "user", "content": req.input}]
    reasoning: str | None = None  # a reasoning item goes with the assistant turn that follows it
    for n, item in enumerate(req.input):
        where = f"input.{n}"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise _bad(f"{where}.role must be user, assistant, system or developer", f"{where}.role")
            message = {"role": "system" if role == "developer" else role,
                       "content": _content(item.get("content"), where)}
            if role == "assistant" and reasoning is not None:
                message["reasoning_content"], reasoning = reasoning, None
            messages.append(message)
        elif kind == "function_call":
            if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
                raise _bad(f"{where}: a function_call needs call_id, name and arguments (text)", where)
            namespace = item.get("namespace") if isinstance(item.get("namespace"), str) else None
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": tools.chat_name(item["name"], namespace), "arguments": item["arguments"]}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and reasoning is None:
                last.setdefault("tool_calls", []).append(call)  # parallel calls: one assistant turn
            else:
                message = {"role": "assistant", "content": None, "tool_calls": [call]}
                if reasoning is not None:
                    message["reasoning_content"], reasoning = reasoning, None
                messages.append(message)
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(item.get("call_id"), str) or not isinstance(output, (str, list)):
                raise _bad(f"{where}: a function_call_output needs call_id and output", where)
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": _content(output, where) if isinstance(output, list) else output})
        elif kind == "reasoning":
            texts = [c.get("text", "") for c in (item.get("content") or item.get("summary") or [])
                     if isinstance(c, dict)]
            reasoning = "".join(t for t in texts if isinstance(t, str))
        else:
            raise _bad(f"input item type {echo(kind)} is not supported", f"{where}.type",
                       ErrorCode.UNSUPPORTED_PARAMETER)
    if not messages:
        raise _bad("input is empty", "input")
    return messages


def _response_format(text: dict) -> dict | None:
    fmt = text.get("format")
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise _bad("text.format json_schema needs a schema", "text.format.schema")
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if fmt.get(k) is not None}
        schema.setdefault("name", "response")
        return {"type": "json_schema", "json_schema": schema}
    raise _bad(f"text.format type {echo(fmt.get('type'))} is not supported", "text.format.type",
               ErrorCode.UNSUPPORTED_PARAMETER)


@dataclass
class ResponsesJob:
    """A Responses request as a chat runtime's job: its Chat Completions body, what became of
    its tools (`ChatTools`: skipped ones, namespaced names), and the output limit it set."""
    request: dict
    tools: ChatTools
    output_limit: int | None


def job_request_from_responses(req: ResponsesRequest, data: dict) -> ResponsesJob:
    """The Chat Completions job for a Responses request (`data`: its JSON object as sent)."""
    if req.previous_response_id is not None:
        raise _bad("previous_response_id is not supported (the pool stores no responses): send the "
                   "conversation in `input`", "previous_response_id")
    if data.get("background"):
        raise _bad("background responses are not supported", "background", ErrorCode.UNSUPPORTED_PARAMETER)
    tools = chat_tools(req.tools or [])
    request: dict[str, Any] = {"messages": _messages(req, tools)}
    for key, value in (("max_tokens", req.max_output_tokens), ("temperature", req.temperature),
                       ("top_p", req.top_p), ("parallel_tool_calls", req.parallel_tool_calls)):
        if value is not None:
            request[key] = value
    if tools.tools:
        request["tools"] = tools.tools
    if req.tool_choice is not None:
        request["tool_choice"] = chat_tool_choice(req.tool_choice, tools)
    if req.text and (fmt := _response_format(req.text)):
        request["response_format"] = fmt
    if req.reasoning and req.reasoning.get("effort") is not None:
        request["reasoning_effort"] = req.reasoning["effort"]
    for key, value in data.items():  # e.g. seed, top_k, user: the runtime judges them
        if key not in DECLARED and key not in BOOKKEEPING and key != "background":
            request[key] = value
    limits = [v for k in OUTPUT_LIMIT_KEYS if isinstance(v := request.get(k), int) and not isinstance(v, bool)]
    return ResponsesJob(request, tools, min(limits, default=None))


# -- Responses objects ----------------------------------------------------------------------------

def _usage(usage: dict | None) -> dict | None:
    if usage is None:
        return None
    i, o = int(usage.get("input_tokens", 0)), int(usage.get("output_tokens", 0))
    return {"input_tokens": i, "output_tokens": o, "total_tokens": i + o,
            "input_tokens_details": {"cached_tokens": int(usage.get("cached_tokens", 0)), "cache_write_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": int(usage.get("reasoning_tokens", 0))}}


def message_item(msg_id: str, text: str | None, status: str) -> dict:
    content = [] if text is None else [
        {"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {"type": "message", "id": msg_id, "role": "assistant", "status": status, "content": content}


def reasoning_item(item_id: str, text: str | None, status: str) -> dict:
    content = [] if text is None else [{"type": "reasoning_text", "text": text}]
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "status": status}


def function_call_item(item_id: str, call_id: str, names: dict, arguments: str, status: str) -> dict:
    """`names`: {"name"}, with its "namespace" for a namespaced function (ChatTools.call_names)."""
    return {"type": "function_call", "id": item_id, "call_id": call_id, **names, "arguments": arguments,
            "status": status}


def response_object(req: ResponsesRequest, resp_id: str, created_at: int, *, status: str,
                    output: list, usage: dict | None = None, error: dict | None = None,
                    reason: str | None = None) -> dict:
    return {
        "id": resp_id, "object": "response", "created_at": created_at, "status": status,
        "completed_at": int(time.time()) if status in ("completed", "incomplete") else None,
        "model": req.model, "output": output, "error": error,
        "incomplete_details": {"reason": reason} if status == "incomplete" else None,
        "instructions": req.instructions, "metadata": req.metadata or {},
        "previous_response_id": None, "max_output_tokens": req.max_output_tokens,
        "temperature": req.temperature if req.temperature is not None else 1.0,
        "top_p": req.top_p if req.top_p is not None else 1.0,
        "parallel_tool_calls": req.parallel_tool_calls if req.parallel_tool_calls is not None else True,
        "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
        "tools": req.tools or [], "text": req.text or {"format": {"type": "text"}},
        "reasoning": req.reasoning, "truncation": "disabled", "store": False,
        "usage": _usage(usage),
    }


# The incomplete reason of a response its runtime cut off at the end of the model's context
# window, not at an output limit. OpenAI's Responses API names only max_output_tokens and
# content_filter (its models' contexts are far larger than any output they allow); this is
# Anthropic's name for the same stop (stop_reason "model_context_window_exceeded").
CONTEXT_FULL = "model_context_window_exceeded"


def response_status(done: Done, output_limit: int | None = None, context: int | None = None) -> tuple[str, str | None]:
    """(status, incomplete reason) for how a job ended. A "length" finish is max_output_tokens
    when the output reached the request's own limit, or when the model's `context` (tokens a
    request may hold, where the runtime reports it) was not reached either (the runtime's own
    output limit); else the context window was full: CONTEXT_FULL."""
    if done.finish_reason == "content_filter":
        return "incomplete", "content_filter"
    if done.finish_reason != "length":
        return "completed", None
    output = int(done.usage.get("output_tokens", 0))
    if output_limit is not None and output >= output_limit:
        return "incomplete", "max_output_tokens"
    if context is not None and int(done.usage.get("input_tokens", 0)) + output < context - 1:
        return "incomplete", "max_output_tokens"  # llama-server stops one short of its context
    return "incomplete", CONTEXT_FULL


def response_json(req: ResponsesRequest, choices: Choices, done: Done, job: ResponsesJob,
                  context: int | None = None) -> dict:
    """A whole (not streamed) response: reasoning, message and function_call items in that order."""
    status, reason = response_status(done, job.output_limit, context)
    item_status = "completed" if status == "completed" else "incomplete"
    c = choices.get(0)
    output = []
    if c.reasoning:
        output.append(reasoning_item(new_id("rs"), "".join(c.reasoning), item_status))
    if c.text or c.refusal or not c.tools:
        output.append(message_item(new_id("msg"), "".join(c.text + c.refusal), item_status))
    for _, call in sorted(c.tools.items()):
        output.append(function_call_item(new_id("fc"), call["id"] or new_id("call"), job.tools.call_names(
            call["name"] or ""), "".join(call["args"]), "completed"))
    # no runtime's own fields on a whole response: llama-server's own Responses API has none there either
    return response_object(req, new_id("resp"), int(time.time()), status=status, output=output,
                           usage=done.usage, reason=reason)


class ResponsesStream(OneAtATime):
    """Builds the SSE events of one streamed response, numbering them. Output
    items open as the runtime's parts arrive (reasoning, message text, each
    function call) and close when the next kind begins or the job is done."""

    def __init__(self, req: ResponsesRequest, job: ResponsesJob, context: int | None = None) -> None:
        self.req = req
        self.job = job
        self.context = context  # the serving model's context window, where its runtime reports it
        self.resp_id = new_id("resp")
        self.created_at = int(time.time())
        self.seq = 0
        self.output: list[dict] = []  # finished items
        self.item: dict | None = None  # the open item
        self.key = None  # what the open item holds: "text", "reasoning", or ("tool", n)
        self.buffer: list[str] = []  # the open item's text or arguments so far

    def _event(self, type_: str, extra: dict | None = None, **fields: Any) -> dict:
        data = {"type": type_, "sequence_number": self.seq, **fields}
        if extra:  # the runtime's own fields (llama-server's timings, prompt_progress) beside the event's
            data.update({k: v for k, v in runtime_fields(extra).items() if k not in data})
        event = {"event": type_, "data": json.dumps(data, separators=(",", ":"))}
        self.seq += 1
        return event

    def delta(self, event: Delta) -> list[dict]:
        """The events of a delta; a runtime's own fields of a chunk ("extra" parts) go on the
        last event its output made, as llama-server's Responses stream has them, or on a
        response.in_progress event of their own (prompt progress, before any output)."""
        if not any(part["k"] == "extra" for part in event.parts):
            return super().delta(event)
        events: list[dict] = []
        run: list[dict] = []
        for part in event.parts if not event.text else [{"k": "text", "t": event.text}, *event.parts]:
            if part["k"] != "extra":
                run.append(part)
                continue
            made = super().delta(Delta(job=event.job, parts=run)) if run else []
            run = []
            if made and not part.get("alone"):
                last = json.loads(made[-1]["data"])
                last.update({k: v for k, v in runtime_fields(part["x"]).items() if k not in last})
                made[-1]["data"] = json.dumps(last, separators=(",", ":"))
            else:
                obj = response_object(self.req, self.resp_id, self.created_at, status="in_progress", output=[])
                made.append(self._event("response.in_progress", part["x"], response=obj))
            events += made
        return events + (super().delta(Delta(job=event.job, parts=run)) if run else [])

    def opening(self, first=None) -> list[dict]:
        obj = response_object(self.req, self.resp_id, self.created_at, status="in_progress", output=[])
        return [self._event("response.created", response=obj), self._event("response.in_progress", response=obj)]

    def _open(self, key, part: dict) -> list[dict]:
        events = self._close("completed")
        index = len(self.output)
        self.key, self.buffer = key, []
        if key == "text":
            self.item = message_item(new_id("msg"), None, "in_progress")
            part_obj = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        elif key == "reasoning":
            self.item = reasoning_item(new_id("rs"), None, "in_progress")
            part_obj = {"type": "reasoning_text", "text": ""}
        else:
            self.item = function_call_item(new_id("fc"), part.get("id") or new_id("call"),
                                           self.job.tools.call_names(part.get("name", "")), "", "in_progress")
            return events + [self._event("response.output_item.added", output_index=index, item=self.item)]
        return events + [
            self._event("response.output_item.added", output_index=index, item=self.item),
            self._event("response.content_part.added", item_id=self.item["id"], output_index=index,
                        content_index=0, part=part_obj)]

    def _close(self, status: str) -> list[dict]:
        if self.item is None:
            return []
        index, item_id, joined = len(self.output), self.item["id"], "".join(self.buffer)
        if self.key == "text":
            item = message_item(item_id, joined, status)
            events = [self._event("response.output_text.done", item_id=item_id, output_index=index,
                                  content_index=0, text=joined, logprobs=[]),
                      self._event("response.content_part.done", item_id=item_id, output_index=index,
                                  content_index=0, part=item["content"][0])]
        elif self.key == "reasoning":
            item = reasoning_item(item_id, joined, status)
            events = [self._event("response.reasoning_text.done", item_id=item_id, output_index=index,
                                  content_index=0, text=joined),
                      self._event("response.content_part.done", item_id=item_id, output_index=index,
                                  content_index=0, part=item["content"][0])]
        else:
            item = {**self.item, "arguments": joined, "status": "completed"}
            events = [self._event("response.function_call_arguments.done", item_id=item_id, output_index=index,
                                  name=item["name"], arguments=joined)]
        events.append(self._event("response.output_item.done", output_index=index, item=item))
        self.output.append(item)
        self.item = self.key = None
        return events

    def _piece(self, kind: str, part: dict) -> list[dict]:
        piece = part.get("args" if kind == "tool" else "t", "")
        if not piece:
            return []
        self.buffer.append(piece)
        index = len(self.output)
        if kind == "tool":
            return [self._event("response.function_call_arguments.delta", item_id=self.item["id"],
                                output_index=index, delta=piece)]
        if kind == "reasoning":
            return [self._event("response.reasoning_text.delta", item_id=self.item["id"],
                                output_index=index, content_index=0, delta=piece)]
        return [self._event("response.output_text.delta", item_id=self.item["id"],
                            output_index=index, content_index=0, delta=piece, logprobs=[])]

    def closing(self, done: Done) -> list[dict]:
        status, reason = response_status(done, self.job.output_limit, self.context)
        events = []
        if not self.output and self.item is None:  # nothing came: an empty message, as a whole response has
            events += self._open("text", {})
        events += self._close("completed" if status == "completed" else "incomplete")
        final = response_object(self.req, self.resp_id, self.created_at, status=status, output=self.output,
                                usage=done.usage, reason=reason)
        return events + [self._event(f"response.{status}", done.extra, response=final)]

    def failed(self, err: PoolError) -> list[dict]:
        obj = response_object(self.req, self.resp_id, self.created_at, status="failed", output=[],
                              error={"code": err.code.value, "message": err.message})
        return [self._event("response.failed", response=obj)]
