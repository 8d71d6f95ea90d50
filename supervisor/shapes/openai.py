"""OpenAI wire shapes: request models for /v1/chat/completions,
/v1/completions and /v1/embeddings (whose job request is the client's body
less what the pool owns), and the response objects and SSE events built from
a job's deltas. (/v1/responses: responses_shapes.) No I/O here."""

from __future__ import annotations

import functools
import json
import time
from random import getrandbits
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from protocol import Delta, Done, delta_parts
from protocol.messages import EXTRA_OWNED, RELAY_KINDS
from protocol.errors import PoolError
from protocol.choices import MAX_CHOICES


# -- requests: msgspec Structs, decoded and validated in C (see `request_body`) ------------------------
# Only the fields the pool reads are declared, strictly typed ("5" is not an int, "yes" not a bool);
# every other field of the client's body passes through to the runtime as sent: the job request is
# the decoded JSON object itself, less the fields the pool owns.

class StreamOptions(msgspec.Struct):
    include_usage: bool = False


# Fields of a client's body that the pool owns: the rest reaches the runtime as sent.
POOL_OWNED = frozenset({"model", "stream", "stream_options"})

ModelName = Annotated[str, Meta(min_length=1)]


class _PassThrough(msgspec.Struct, kw_only=True):
    """An OpenAI body that goes to the runtime whole (see `job_request`)."""
    model: ModelName
    stream: bool = False


class ChatMessage(msgspec.Struct):
    """What the pool reads of a message (its role and the text it counts for
    the prompt bounds); every other key passes through as sent."""
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list | None = None


# The OpenAI sampling fields, checked against the API's own ranges so that a wrong value is the
# client's 400 whatever the backend (a runtime might take NaN, and the synthetic one ignores them).
# NaN and the infinities fail every range.
Temperature = Annotated[float, Meta(ge=0, le=2)]
TopP = Annotated[float, Meta(ge=0, le=1)]
Penalty = Annotated[float, Meta(ge=-2, le=2)]
ChoiceCount = Annotated[int, Meta(ge=1, le=128)]
# The most output one request may ask for (2**20 tokens), whatever its model: above any context a
# runtime serves today, and a bound on what a tpm reserve starts from. Admission also checks the
# model's own context, where its runtime reports one (admission.output_reserve).
MAX_OUTPUT_TOKENS = 1_048_576
OutputTokens = Annotated[int, Meta(ge=1, le=MAX_OUTPUT_TOKENS)]


class _Sampling(_PassThrough, kw_only=True):
    temperature: Temperature | None = None
    top_p: TopP | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    n: ChoiceCount | None = None
    seed: int | None = None
    stop: str | list[str] | None = None


class ChatRequest(_Sampling, kw_only=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_tokens: OutputTokens | None = None
    max_completion_tokens: OutputTokens | None = None
    stream_options: StreamOptions | None = None


class CompletionRequest(_Sampling, kw_only=True):
    prompt: str | list
    max_tokens: OutputTokens | None = None
    stream_options: StreamOptions | None = None


class EmbeddingRequest(_PassThrough, kw_only=True):
    input: str | list  # `stream` true is refused by the route: embeddings are never streamed


def job_request(data: dict) -> dict:
    """The request the runtime gets: the client's JSON object as sent, less what the pool owns."""
    return {k: v for k, v in data.items() if k not in POOL_OWNED}


_json_str = json.JSONEncoder().encode  # a str goes straight to the C escaper (ensure_ascii, as json.dumps)


def first_choice_parts(event: Delta):
    """Choice 0's parts of a delta, in order, each as (what it holds, part): "text", "reasoning"
    or ("tool", n). A response or a message has one choice; a refusal's text is text."""
    for part in delta_parts(event) if event.parts else ({"k": "text", "t": event.text},):
        if part.get("i", 0) == 0 and part["k"] not in RELAY_KINDS:
            kind = part["k"]
            yield ("tool", part.get("n", 0)) if kind == "tool" else "reasoning" if kind == "reasoning" else "text", part


class OneAtATime:
    """A stream of output items or content blocks, one open at a time (Responses, Messages):
    a part of another kind than the open one's (`key`) opens the next; each part's piece
    then goes into the open one. Subclasses say how (`_open`, `_piece`)."""

    key = None  # what the open one holds: "text", "reasoning", or ("tool", n)

    def delta(self, event: Delta) -> list[dict]:
        events: list[dict] = []
        for key, part in first_choice_parts(event):
            if key != self.key:
                events += self._open(key, part)
            events += self._piece(part["k"], part)
        return events

    def _open(self, key, part: dict) -> list[dict]:
        raise NotImplementedError

    def _piece(self, kind: str, part: dict) -> list[dict]:
        raise NotImplementedError


def new_id(prefix: str) -> str:
    """A unique id (128 random bits; an id names an answer, it guards nothing, so the
    generator need not be a system call per answer as os.urandom is)."""
    return f"{prefix}_{getrandbits(128):032x}"


# -- output accumulated per choice ---------------------------------------------------------------

class _Choice:
    __slots__ = ("text", "reasoning", "refusal", "tools", "lp")

    def __init__(self) -> None:
        self.text: list[str] = []
        self.reasoning: list[str] = []
        self.refusal: list[str] = []
        self.tools: dict[int, dict] = {}  # tool index -> {"id", "name", "args": [fragments]}
        self.lp = None  # chat: a list of entries; legacy completions: the runtime's object, merged


def _merge_lp(have, more):
    if have is None:
        return more
    if isinstance(have, list) and isinstance(more, list):
        return have + more
    if isinstance(have, dict) and isinstance(more, dict):  # legacy: parallel lists per key
        return {k: (have.get(k) or []) + v if isinstance(v, list) else v for k, v in more.items()}
    return have


class Choices:
    """A job's output, accumulated per choice, for a non-streamed answer."""

    def __init__(self) -> None:
        self.by_index: dict[int, _Choice] = {}

    def _choice(self, index: int) -> _Choice:
        choice = self.by_index.get(index)
        if choice is None:
            choice = self.by_index[index] = _Choice()
        return choice

    def add(self, delta: Delta) -> None:
        if delta.text:
            self._choice(0).text.append(delta.text)
        for part in delta.parts:
            kind = part["k"]
            if kind in RELAY_KINDS:  # how a stream was framed: a whole answer has its own frame
                continue
            choice = self._choice(part.get("i", 0))
            if kind == "tool":
                call = choice.tools.setdefault(part.get("n", 0), {"id": None, "name": None, "args": []})
                call["id"] = call["id"] or part.get("id")
                call["name"] = call["name"] or part.get("name")
                call["args"].append(part.get("args", ""))
                continue
            {"text": choice.text, "reasoning": choice.reasoning, "refusal": choice.refusal}[kind].append(
                part.get("t", ""))
            if part.get("lp") is not None:
                choice.lp = _merge_lp(choice.lp, part["lp"])

    def count(self, done: Done) -> int:
        """Choices in the answer. The job kept every index below the request's
        choice limit (Job.push), so this is no bigger than the request asked;
        MAX_CHOICES stands behind that."""
        return min(MAX_CHOICES, max(len(done.finish_reasons), max(self.by_index, default=0) + 1))

    def get(self, index: int) -> _Choice:
        return self.by_index.get(index) or _Choice()


def finish_reasons(done: Done, count: int) -> list[str]:
    reasons = list(done.finish_reasons) or [done.finish_reason]
    return reasons + ["stop"] * (count - len(reasons))


def _tool_calls(choice: _Choice) -> list[dict]:
    return [{"id": call["id"] or new_id("call"), "type": "function",
             "function": {"name": call["name"] or "", "arguments": "".join(call["args"])}}
            for _, call in sorted(choice.tools.items())]


def chat_usage(usage: dict) -> dict:
    i, o = int(usage.get("input_tokens", 0)), int(usage.get("output_tokens", 0))
    out: dict[str, Any] = {"prompt_tokens": i, "completion_tokens": o, "total_tokens": i + o}
    if "cached_tokens" in usage:  # the runtime said so, 0 included (absent: it did not say)
        out["prompt_tokens_details"] = {"cached_tokens": usage["cached_tokens"]}
    if usage.get("reasoning_tokens"):
        out["completion_tokens_details"] = {"reasoning_tokens": usage["reasoning_tokens"]}
    return out


def runtime_fields(extra: dict) -> dict:
    """A runtime's own top-level fields (an "extra" part, Done.extra), less any the pool
    makes itself: the worker left those out, and a chunk never names a field twice."""
    return {k: v for k, v in extra.items() if k not in EXTRA_OWNED}


# -- Chat Completions objects -----------------------------------------------------------------------

def chat_completion(model: str, choices: Choices, done: Done) -> dict:
    count = choices.count(done)
    out = []
    for index, reason in enumerate(finish_reasons(done, count)):
        c = choices.get(index)
        tool_calls = _tool_calls(c)
        message: dict[str, Any] = {"role": "assistant",
                                   "content": "".join(c.text) if c.text or not tool_calls else None}
        if c.reasoning:
            message["reasoning_content"] = "".join(c.reasoning)
        if c.refusal:
            message["refusal"] = "".join(c.refusal)
        if tool_calls:
            message["tool_calls"] = tool_calls
        out.append({"index": index, "message": message, "finish_reason": reason,
                    "logprobs": {"content": c.lp} if c.lp is not None else None})
    return {"id": new_id("chatcmpl"), "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": out, "usage": chat_usage(done.usage), **runtime_fields(done.extra)}


def _chat_part_delta(part: dict) -> dict:
    kind = part["k"]
    if kind == "tool":
        call: dict[str, Any] = {"index": part.get("n", 0)}
        if "id" in part:
            call["id"] = part["id"]
            call["type"] = "function"
        function = {"arguments": part.get("args", "")}
        if "name" in part:
            function["name"] = part["name"]
        call["function"] = function
        return {"tool_calls": [call]}
    key = {"text": "content", "reasoning": "reasoning_content", "refusal": "refusal"}[kind]
    return {key: part.get("t", "")}


class ChatStream:
    """Builds the SSE chunks of one streamed chat completion (same interface
    as ResponsesStream: opening, delta, closing, failed). A plain text delta
    is one small chunk; each typed part is a chunk of its own choice. A runtime
    that speaks OpenAI frames its stream as it does: its opening delta of a
    choice ("open" parts) and its own top-level fields ("extra" parts, Done.extra)
    come back in the chunks they came in."""

    def __init__(self, model: str, include_usage: bool) -> None:
        self.model = model
        self.include_usage = include_usage
        self.id = new_id("chatcmpl")
        self.created = int(time.time())
        self.opened: set[int] = set()  # choices whose first chunk (with the role) is out
        self.own_opening: set[int] = set()  # ... where the pool made that chunk (no runtime's opening came first)
        self._head = json.dumps({"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                                 "model": model}, separators=(",", ":"))[:-1]  # ends before the closing brace

    def _chunk(self, choices: list[dict], usage: dict | None = None, extra: dict | None = None) -> dict:
        tail = {"choices": choices}
        if usage is not None:
            tail["usage"] = usage
        if extra:
            tail.update(runtime_fields(extra))
        return {"data": self._head + "," + json.dumps(tail, separators=(",", ":"))[1:]}

    @staticmethod
    def entry(delta: dict, finish_reason: str | None = None, index: int = 0, logprobs=None) -> dict:
        return {"index": index, "delta": delta, "finish_reason": finish_reason, "logprobs": logprobs}

    def chunk(self, delta: dict, finish_reason: str | None = None, index: int = 0, logprobs=None) -> dict:
        return self._chunk([self.entry(delta, finish_reason, index, logprobs)])

    def opening(self, first=None) -> list[dict]:
        """The first chunk: the runtime's own opening, when its first output holds one
        (llama-server's "content": null), else OpenAI's ("content": "")."""
        if isinstance(first, Delta) and any(part["k"] == "open" and part.get("i", 0) == 0 for part in first.parts):
            return []  # delta() gives it, as the runtime sent it
        self.opened.add(0)
        self.own_opening.add(0)
        return [self.chunk({"role": "assistant", "content": ""})]

    def text_sse(self, text: str) -> bytes:
        """The SSE bytes of a plain text delta (the token path): what
        sse_frame(self.chunk({"content": text})) gives, without building the dicts."""
        return b"".join((self._text_pre, _json_str(text).encode(), self._text_post))

    @functools.cached_property
    def _text_pre(self) -> bytes:  # made on the first token (a subclass has its own _head by then)
        return self._text_prefix()

    def _text_prefix(self) -> bytes:
        return f'data: {self._head},"choices":[{{"index":0,"delta":{{"content":'.encode()

    _text_post = b'},"finish_reason":null,"logprobs":null}]}\n\n'

    def delta(self, event: Delta) -> list[dict]:
        out: list[list] = [[self.entry({"content": event.text}), None]] if event.text else []  # [entry, extra]
        opening = None  # the entry of a runtime's opening just made: its next part may join it
        for part in event.parts:
            kind = part["k"]
            if kind == "extra":  # the runtime's own fields of the chunk the parts before came in
                if out and out[-1][1] is None and not part.get("alone"):
                    out[-1][1] = part["x"]
                else:
                    out.append([None, part["x"]])
                continue
            index = part.get("i", 0)
            if kind == "open":
                if index in self.own_opening:  # the stream opened before the runtime did (it waited): once is enough
                    continue
                self.opened.add(index)
                opening = self.entry({"role": "assistant", **part.get("d", {})}, index=index)
                out.append([opening, None])
                continue
            delta, lp = self.part_delta(part), part.get("lp")
            if (opening is not None and opening["index"] == index and out[-1][0] is opening and out[-1][1] is None
                    and not opening["delta"].keys() & delta.keys()):
                opening["delta"].update(delta)  # the runtime opened with this output: one chunk, as it sent it
                opening["logprobs"] = {"content": lp} if lp is not None else None
                opening = None
                continue
            opening = None
            if index not in self.opened:
                self.opened.add(index)
                delta = {"role": "assistant", **delta}
            out.append([self.entry(delta, index=index, logprobs={"content": lp} if lp is not None else None), None])
        return [self._chunk([entry] if entry is not None else [], extra=extra) for entry, extra in out]

    @staticmethod
    def part_delta(part: dict) -> dict:
        return _chat_part_delta(part)

    def closing(self, done: Done) -> list[dict]:
        """A finish chunk per choice, usage (on the last finish chunk where the runtime put
        it there unasked, else in a chunk of its own if the client asked), and the
        runtime's own fields of its closing chunks on the last chunk, as llama-server does."""
        reasons = finish_reasons(done, max(len(done.finish_reasons), max(self.opened, default=0) + 1))
        out: list[list] = [[[self.entry({}, reason, index)], None] for index, reason in enumerate(reasons)]
        if done.usage_on_finish:
            out[-1][1] = chat_usage(done.usage)
        elif self.include_usage:
            out.append([[], chat_usage(done.usage)])
        events = [self._chunk(choices, usage, done.extra if n == len(out) - 1 else None)
                  for n, (choices, usage) in enumerate(out)]
        events.append({"data": "[DONE]"})
        return events

    @staticmethod
    def failed(err: PoolError) -> list[dict]:
        return [{"data": json.dumps(err.envelope(), separators=(",", ":"))}, {"data": "[DONE]"}]


# -- legacy completions ---------------------------------------------------------------------------------

def text_completion(model: str, choices: Choices, done: Done) -> dict:
    out = [{"index": index, "text": "".join(choices.get(index).text), "finish_reason": reason,
            "logprobs": choices.get(index).lp}
           for index, reason in enumerate(finish_reasons(done, choices.count(done)))]
    return {"id": new_id("cmpl"), "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": out, "usage": chat_usage(done.usage), **runtime_fields(done.extra)}


class CompletionStream(ChatStream):
    """SSE chunks of a streamed legacy completion: text per choice."""

    def __init__(self, model: str, include_usage: bool) -> None:
        super().__init__(model, include_usage)
        self.id = new_id("cmpl")
        self._head = json.dumps({"id": self.id, "object": "text_completion", "created": self.created,
                                 "model": model}, separators=(",", ":"))[:-1]

    @staticmethod
    def entry(delta: dict, finish_reason: str | None = None, index: int = 0, logprobs=None) -> dict:
        return {"index": index, "text": delta.get("content", ""), "finish_reason": finish_reason,
                "logprobs": logprobs}

    def opening(self, first=None) -> list[dict]:
        return []

    def _text_prefix(self) -> bytes:
        return f'data: {self._head},"choices":[{{"index":0,"text":'.encode()

    _text_post = b',"finish_reason":null,"logprobs":null}]}\n\n'

    def delta(self, event: Delta) -> list[dict]:
        out: list[list] = [[self.entry({"content": event.text}), None]] if event.text else []  # [entry, extra]
        for part in event.parts:
            if part["k"] == "extra":  # the runtime's own fields of the chunk the text before came in
                if out and out[-1][1] is None and not part.get("alone"):
                    out[-1][1] = part["x"]
                else:
                    out.append([None, part["x"]])
            elif part["k"] == "text":
                self.opened.add(part.get("i", 0))
                out.append([self.entry({"content": part.get("t", "")}, index=part.get("i", 0),
                                       logprobs=part.get("lp")), None])
        return [self._chunk([entry] if entry is not None else [], extra=extra) for entry, extra in out]


# -- embeddings -------------------------------------------------------------------------------------

def embeddings(model: str, done: Done) -> dict:
    result = dict(done.result)
    result.setdefault("object", "list")
    result["model"] = model
    return result
