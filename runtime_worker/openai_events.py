"""An OpenAI-compatible runtime's answer as the job's events: a streamed chunk's choices
as text or typed parts (choice_event; its opening and its own fields kept, to the letter),
a whole answer as the events its stream would have given (answer_events), and the end
(finished: finish reasons, usage, timings). Pure: the reading is runtime_worker/upstream.py's."""

from __future__ import annotations

import json

from protocol.choices import MAX_CHOICES
from protocol.errors import ErrorCode
from protocol.messages import MAX_EXTRA_BYTES, OPEN_FIELDS, TIMING_MAX, runtime_extra, runtime_timings
from runtime_worker.backends.base import Event, Finished, JobError, PartsDelta, TextDelta
from runtime_worker.upstream import json_object, runtime_reported

MAX_TOOL_CALLS = 1024  # a tool call index in one choice is below this


def answer_events(raw: bytes, chat: bool, choices: int) -> list[Event]:
    """A whole completion as the events its stream would have given."""
    answer = json_object(raw, "an answer")
    if "error" in answer:
        raise runtime_reported(answer["error"])
    events: list[Event] = []
    finishes: dict[int, str] = {}
    for choice in answer.get("choices") or ():
        index = choice_index(choice, choices)
        if chat:  # a message is one delta holding everything; its tool calls are numbered by place
            message = choice.get("message") or {}
            calls = [{**call, "index": n} for n, call in enumerate(message.get("tool_calls") or ())]
            message = {k: v for k, v in message.items() if k != "role"}  # a whole answer has no opening to relay
            choice = {"delta": {**message, "tool_calls": calls}, "logprobs": choice.get("logprobs"),
                      "finish_reason": choice.get("finish_reason")}
        if (event := choice_event(choice, chat, index=index)) is not None:
            events.append(event)
        if not choice.get("finish_reason"):
            raise JobError(ErrorCode.RUNTIME_ERROR, f"the runtime's answer has no finish_reason for choice {index}")
        finishes[index] = str(choice["finish_reason"])
    if 0 not in finishes:
        raise JobError(ErrorCode.RUNTIME_ERROR, "the runtime's answer has no choice 0")
    return [*events, finished(finishes, answer.get("usage"), len(events), answer.get("timings"),
                              checked_extra(answer))]


def checked_size(extra: dict) -> dict:
    if len(json.dumps(extra, separators=(",", ":"))) > MAX_EXTRA_BYTES:
        raise JobError(ErrorCode.RUNTIME_ERROR, f"the runtime's own fields of one chunk or answer are over the "
                       f"pool's {MAX_EXTRA_BYTES} byte bound on them")
    return extra


def checked_extra(obj: dict) -> dict:
    """The runtime's own top-level fields of a chunk or answer, within MAX_EXTRA_BYTES."""
    return checked_size(runtime_extra(obj))


def with_extra(event: TextDelta | PartsDelta, extra: dict) -> PartsDelta:
    """`event` with its chunk's own fields after it (an "extra" part)."""
    parts = [{"k": "text", "i": 0, "t": event.text}] if isinstance(event, TextDelta) else list(event.parts)
    return PartsDelta([*parts, {"k": "extra", "x": extra}], tokens=event.tokens)


def finished(finishes: dict[int, str], usage, produced: int, timings=None, extra: dict | None = None,
             usage_on_finish: bool = False) -> Finished:
    """The end of a completion: per choice finish reasons (below the request's
    `n`, so at most MAX_CHOICES; a choice that said nothing at all stopped), usage
    and the runtime's own timings (llama-server's `timings`; none from most others),
    and its own fields of its closing chunks or whole answer, relayed (`extra`)."""
    usage = usage if isinstance(usage, dict) else {}
    reasons = tuple(finishes.get(i, "stop") for i in range(max(finishes) + 1))
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return Finished(reasons[0], int(usage.get("prompt_tokens", 0)),
                    int(usage.get("completion_tokens", produced)), reasons if len(reasons) > 1 else (),
                    # None when the runtime did not say: never a made-up 0
                    cached_tokens=cached if isinstance(cached, int) and not isinstance(cached, bool) and cached >= 0
                    else None,
                    timings=runtime_timings(timings) or None, extra=extra or None,
                    usage_on_finish=usage_on_finish,
                    reasoning_tokens=int((usage.get("completion_tokens_details") or {}).get("reasoning_tokens")
                                         or 0))


def live_count(chunk: dict) -> int | None:
    """The output tokens a runtime says it has made so far, from a streamed chunk that
    holds output: llama-server's per-chunk timings (timings_per_token) or vLLM's running
    usage (continuous_usage_stats). None when it does not say: each event then counts one."""
    if not chunk.get("choices"):
        return None
    made = runtime_timings(chunk.get("timings")).get("predicted_n")
    if made is None and isinstance(chunk.get("usage"), dict):
        made = chunk["usage"].get("completion_tokens")
    return int(made) if isinstance(made, (int, float)) and not isinstance(made, bool) and 0 <= made < TIMING_MAX \
        else None


def choice_index(choice, choices: int) -> int:
    """A streamed choice's index, checked against the request's `n`: a runtime
    that names another choice broke the protocol (and must never make the pool
    hold a list that long)."""
    if not isinstance(choice, dict):
        raise JobError(ErrorCode.PROTOCOL_ERROR, "the runtime sent a choice that is not a JSON object")
    index = choice.get("index") or 0
    if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < choices:
        raise JobError(ErrorCode.PROTOCOL_ERROR, f"the runtime sent choice index {str(index)[:40]}, but the "
                       f"request asked for {choices} choice{'s' if choices > 1 else ''}")
    return index


def choice_event(choice: dict, chat: bool, index: int | None = None) -> TextDelta | PartsDelta | None:
    """One streamed choice as a worker event: plain content of choice 0 as a
    TextDelta (the common, cheap case), anything else as typed parts in the
    order of an OpenAI delta (reasoning, content with its logprobs, refusal,
    tool calls). `index`: the choice's, checked (choice_index) by the caller."""
    if index is None:
        index = choice_index(choice, MAX_CHOICES)
    parts: list[dict] = []
    if chat:
        delta = choice.get("delta") or {}
        text = delta.get("content")
        lp = (choice.get("logprobs") or {}).get("content")
        if "role" in delta:  # the runtime opens the message: its empty fields, as it sent them
            parts.append({"k": "open", "i": index, "d": opening_fields(delta)})
        elif index == 0 and text and not lp and not (delta.get("tool_calls") or delta.get("reasoning_content")
                                                     or delta.get("reasoning") or delta.get("refusal")):
            return TextDelta(text)
    else:
        delta = {}
        text, lp = choice.get("text"), choice.get("logprobs")
        if index == 0 and not lp and text:
            return TextDelta(text)
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
        n = call.get("index") or 0
        if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n < MAX_TOOL_CALLS:
            raise JobError(ErrorCode.PROTOCOL_ERROR, f"the runtime sent tool call index {str(n)[:40]}")
        part = {"k": "tool", "i": index, "n": n, "args": function.get("arguments") or ""}
        if call.get("id"):
            part["id"] = call["id"]
        if function.get("name"):
            part["name"] = function["name"]
        parts.append(part)
    return PartsDelta(parts) if parts else None


def opening_only(event: TextDelta | PartsDelta) -> bool:
    return isinstance(event, PartsDelta) and all(part["k"] == "open" for part in event.parts)


def opening_fields(delta: dict) -> dict:
    """The empty fields of a runtime's opening delta (llama-server's "content": null, vLLM's
    "content": "", OpenAI's "refusal": null), a few at most: what it holds is parts of its own."""
    fields = {k: v for k, v in delta.items() if k != "role" and v in (None, "") and len(k) <= 64}
    return dict(list(fields.items())[:OPEN_FIELDS])
