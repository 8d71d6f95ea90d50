"""Message types. Each is a frozen dataclass whose fields are the wire fields;
`TYPE` is its tag ("t") on the wire. Field types are checked on decode."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, ClassVar


@dataclass(frozen=True, slots=True)
class Hello:
    """The worker's first word: it is connected (the supervisor knows its pid and backend already)."""
    TYPE: ClassVar[str] = "hello"


@dataclass(frozen=True, slots=True)
class Setup:
    """The supervisor's answer to Hello: the model's backend options (secrets
    among them: vLLM's env, URLs with credentials, extra_body tokens), which
    never travel in the worker's argv. The worker loads its runtime once it has them."""
    TYPE: ClassVar[str] = "setup"
    options: dict = field(default_factory=dict)
    # warm swaps (runtime_worker/warm_swap.py): {"dir", "budget_mb", "save_timeout_s"}; empty: off
    warm_swap: dict = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Ready:
    TYPE: ClassVar[str] = "ready"
    capacity: int  # honest number of jobs the runtime can run at once
    info: dict = field(default_factory=dict)  # e.g. child pid, port, n_ctx


# /v1/chat/completions, /v1/completions, /v1/embeddings, /v1/messages (a runtime's own route: its
# body is Anthropic's); then the runtime's own calls, each answered whole (Done.result): /tokenize,
# /detokenize, /apply-template, /v1/rerank, /v1/messages/count_tokens, /v1/chat/completions/input_tokens
ENDPOINTS = ("chat", "completions", "embeddings", "messages", "tokenize", "detokenize", "apply_template", "rerank",
             "count_tokens", "input_tokens")
# Calls a runtime answers outside its generation slots: a worker runs up to LIGHT_CALLS_PER_WORKER
# of them beside its capacity's jobs (the supervisor hands them over past the model's queue)
LIGHT_ENDPOINTS = frozenset({"tokenize", "detokenize", "apply_template", "count_tokens", "input_tokens"})
LIGHT_CALLS_PER_WORKER = 8


@dataclass(frozen=True, slots=True)
class Submit:
    TYPE: ClassVar[str] = "submit"
    job: str
    # the client's OpenAI body for `endpoint`, less what the pool owns (model, stream, stream_options);
    # "stream": false when the client wants the answer whole (a runtime that can answer whole does)
    request: dict
    endpoint: str = "chat"  # one of ENDPOINTS
    # HTTP headers for the runtime's own route, as the client sent them (a Messages request's
    # anthropic-version and anthropic-beta); empty for every other job
    headers: dict = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Cancel:
    TYPE: ClassVar[str] = "cancel"
    job: str


@dataclass(frozen=True, slots=True)
class Delta:
    """Output of a job. `text` is content text of choice 0: the common case,
    one short string on the wire. Anything else travels as typed `parts`, in
    the order the runtime produced them (after `text`, if both are set):

        {"k": "text" | "reasoning" | "refusal", "i": choice, "t": str, "lp": logprobs}
        {"k": "tool", "i": choice, "n": tool index, "id": str, "name": str, "args": str}
        {"k": "open", "i": choice, "d": {field: None or ""}}
        {"k": "extra", "x": {field: value}, "alone": True}

    "i" defaults to 0; "lp" (the runtime's logprobs of those tokens: a list of
    entries for chat, its own object for legacy completions) is optional; a tool
    part's "id" and "name" come with its first fragment, "args" is a fragment
    of the JSON arguments. The last two relay a runtime's answer to the letter: "open"
    is its opening of a choice's message (its delta with the role), with the empty
    fields it held (llama-server's "content": null, vLLM's "content": ""); "extra"
    holds the runtime's own top-level fields of the chunk the parts before it came in
    (llama-server's `timings` with timings_per_token, `prompt_progress` with
    return_progress), or, "alone", of a chunk that held nothing else: see EXTRA_OWNED
    and MAX_EXTRA_BYTES. `tokens`: the output tokens it carries (as the runtime
    counted them, else one per runtime event; a merged delta carries their sum), so
    the live tokens/s counts tokens, not messages. `tasks`: see tasks_error."""
    TYPE: ClassVar[str] = "delta"
    job: str
    text: str = ""
    parts: list = field(default_factory=list)
    tokens: int = 1
    tasks: list = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Done:
    TYPE: ClassVar[str] = "done"
    job: str
    finish_reason: str  # choice 0's: "stop" | "length" | "tool_calls" | "content_filter" | ... | "cancelled"
    usage: dict = field(default_factory=dict)  # {"input_tokens", "output_tokens"}
    finish_reasons: list = field(default_factory=list)  # per choice, when there are several (n > 1)
    result: dict = field(default_factory=dict)  # a non-streamed answer (embeddings: {"data", "usage"})
    timings: dict = field(default_factory=dict)  # the runtime's own phase timings (runtime_timings), if it gave any
    # the runtime's own top-level fields of its closing chunks or whole answer (llama-server's
    # `timings`, `__verbose`), relayed as they came: see EXTRA_OWNED and MAX_EXTRA_BYTES
    extra: dict = field(default_factory=dict)
    usage_on_finish: bool = False  # the runtime sent usage on its finish chunk, unasked (llama-server's legacy stream)


# Delta.tasks: the runtime's own tasks that serve the job, as [slot, task id] pairs (llama-server's
# `id N | task T` of its log lines), said once, as soon as the worker learned them, on a delta of
# their own (no text, no parts, 0 tokens: no output); left off otherwise. An optional field, so a
# frame without it (an older worker, a runtime that names no tasks) reads as before, and a
# reader that knows no `tasks` reads that delta as an empty one. At most MAX_RUNTIME_TASKS.
MAX_RUNTIME_TASKS = 64
RUNTIME_TASK_MAX = 2**31 - 1  # a slot or task id past this is no llama-server's (int32)


def tasks_error(tasks: list) -> str | None:
    """What is wrong with a Delta's `tasks`, or None."""
    if len(tasks) > MAX_RUNTIME_TASKS:
        return f"{len(tasks)} runtime tasks, more than {MAX_RUNTIME_TASKS}"
    for pair in tasks:
        if not (isinstance(pair, list) and len(pair) == 2
                and all(type(v) is int and 0 <= v <= RUNTIME_TASK_MAX for v in pair)):
            return "a runtime task is not a [slot, task id] pair of non-negative ints"
    return None


@dataclass(frozen=True, slots=True)
class Error:
    TYPE: ClassVar[str] = "error"
    job: str | None  # None: the runtime itself failed (e.g. load failure)
    code: str  # an ErrorCode value
    message: str
    param: str | None = None  # the request field at fault, when one is
    # job None, code runtime_crashed (runtime_timeout: its worker killed it): the native runtime's
    # own exit (negative: the signal that ended it), which the worker's own exit (code 1) would hide
    exit_code: int | None = None


@dataclass(frozen=True, slots=True)
class Heartbeat:
    TYPE: ClassVar[str] = "heartbeat"
    inflight: int = 0
    jobs: list = field(default_factory=list)  # worker -> supervisor: the ids of the jobs it runs
    submits_seen: int = 0  # worker -> supervisor: Submits received so far


@dataclass(frozen=True, slots=True)
class KvEvents:
    """Worker -> supervisor: what the runtime's prefix cache stored and dropped
    (vLLM's KV-cache events), in the engine's order, at most MAX_KV_EVENTS a
    message. Each event is a list:

        ["stored", [block hash, ...], parent hash | None, [token id, ...], block size, extra]
        ["removed", [block hash, ...]]
        ["cleared"]

    A block hash is bytes or an int, as the engine made it; `extra` is true when
    the engine hashed more than the tokens (LoRA, images, a cache salt).
    `reset`: events were lost before these (a gap in the engine's sequence, a
    relay restart): what the receiver knew of the cache is no longer exact."""
    TYPE: ClassVar[str] = "kv_events"
    events: list = field(default_factory=list)
    reset: bool = False


MAX_KV_EVENTS = 256  # events in one KvEvents message
MAX_DELTA_TOKENS = 1_000_000  # output tokens one Delta may say it carries (a joined run stays far below)


@dataclass(frozen=True, slots=True)
class Shutdown:
    TYPE: ClassVar[str] = "shutdown"


Message = Hello | Setup | Ready | Submit | Cancel | Delta | Done | Error | Heartbeat | KvEvents | Shutdown

MESSAGE_TYPES: dict[str, type] = {
    cls.TYPE: cls for cls in (Hello, Setup, Ready, Submit, Cancel, Delta, Done, Error, Heartbeat, KvEvents, Shutdown)
}

# Expected Python types per field, checked on decode (msgpack gives plain types).
FIELD_TYPES: dict[type, dict[str, Any]] = {
    Hello: {},
    Setup: {"options": dict, "warm_swap": dict},
    Ready: {"capacity": int, "info": dict},
    Submit: {"job": str, "request": dict, "endpoint": str, "headers": dict},
    Cancel: {"job": str},
    Delta: {"job": str, "text": str, "parts": list, "tokens": int, "tasks": list},
    Done: {"job": str, "finish_reason": str, "usage": dict, "finish_reasons": list, "result": dict, "timings": dict,
           "extra": dict, "usage_on_finish": bool},
    Error: {"job": (str, type(None)), "code": str, "message": str, "param": (str, type(None)),
            "exit_code": (int, type(None))},
    Heartbeat: {"inflight": int, "jobs": list, "submits_seen": int},
    KvEvents: {"events": list, "reset": bool},
    Shutdown: {},
}


# -- a runtime's own timings -----------------------------------------------------------------------
# llama-server's `timings` object (final stream chunk, whole answer): the fields the pool keeps.
TIMING_COUNTS = ("prompt_n", "predicted_n", "cache_n")  # tokens
TIMING_MEASURES = ("prompt_ms", "prompt_per_second", "predicted_ms", "predicted_per_second")
TIMING_MAX = 1e12  # past this a figure is nonsense, not a measurement


def runtime_timings(raw) -> dict:
    """The known timing fields of `raw` that are finite, non-negative numbers
    below TIMING_MAX; anything else (unknown keys, strings, NaN) is left out.
    The worker applies it to what its runtime sent, the supervisor to what a
    worker sent: at most seven numbers cross, whatever the runtime said."""
    if not isinstance(raw, dict):
        return {}
    out = {}
    for name in TIMING_COUNTS + TIMING_MEASURES:
        value = raw.get(name)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < TIMING_MAX:
            out[name] = int(value) if name in TIMING_COUNTS else float(value)
    return out


# -- a runtime's own fields, relayed --------------------------------------------------------------------
# The top-level fields of an OpenAI chunk or answer that the pool makes itself (its model name, its
# ids, its choices and usage from the job's parts and counts); every other top-level field is the
# runtime's own and is relayed as it came (an "extra" part, Done.extra). system_fingerprint is the
# pool's too: one answer may come from any replica, and it rides on every chunk of llama-server's,
# which would take each token off the plain-text path.
EXTRA_OWNED = frozenset(("id", "object", "created", "model", "choices", "usage", "system_fingerprint", "error"))
MAX_EXTRA_BYTES = 1024 * 1024  # a runtime's own fields of one chunk or answer, as JSON; past it the job fails
OPEN_FIELDS = 8  # the empty fields an "open" part may carry


def runtime_extra(obj: dict) -> dict:
    """The runtime's own top-level fields of a chunk or answer (EXTRA_OWNED aside)."""
    return {k: v for k, v in obj.items() if k not in EXTRA_OWNED}


# -- delta parts ------------------------------------------------------------------------------------
TEXT_KINDS = frozenset(("text", "reasoning", "refusal"))
RELAY_KINDS = frozenset(("open", "extra"))  # parts that carry no output, only how the runtime framed it
_PART_FIELDS = {"t": str, "args": str, "id": str, "name": str, "d": dict, "x": dict}


def part_error(part) -> str | None:
    """Why a delta part is malformed, or None."""
    if not isinstance(part, dict):
        return f"a part is a {type(part).__name__}, not a map"
    kind = part.get("k")
    if kind not in TEXT_KINDS and kind != "tool" and kind not in RELAY_KINDS:
        return f"unknown part kind {kind!r}"
    for key in ("i", "n"):
        if key in part and (not isinstance(part[key], int) or isinstance(part[key], bool) or part[key] < 0):
            return f"part field {key!r} is not a choice index"
    for key, expected in _PART_FIELDS.items():
        if key in part and not isinstance(part[key], expected):
            return f"part field {key!r} has type {type(part[key]).__name__}"
    if kind == "open":
        fields = part.get("d", {})
        if len(fields) > OPEN_FIELDS or any(not isinstance(k, str) or len(k) > 64 or v not in (None, "")
                                            for k, v in fields.items()):
            return "an open part's fields are not a few empty ones"
    return None


def delta_parts(delta: Delta) -> list[dict]:
    """All of a delta's output as parts, in order."""
    if not delta.text:
        return delta.parts
    return [{"k": "text", "i": 0, "t": delta.text}, *delta.parts]


def delta_size(delta: Delta) -> int:
    """A cheap size estimate (characters) of a delta, for merge limits."""
    size = len(delta.text)
    for part in delta.parts:
        size += 32 + len(part.get("t", "")) + len(part.get("args", "")) + 256 * len(part.get("lp") or ())
        if "x" in part:  # rare (a client asked for the runtime's own fields): measured exactly
            size += len(json.dumps(part["x"], separators=(",", ":")))
    return size


def _mergeable(a: dict, b: dict) -> bool:
    """Two adjacent parts that are one run of text: same kind, same choice,
    and logprobs that concatenate (both absent or both lists)."""
    return (a["k"] == b["k"] and a["k"] in TEXT_KINDS and a.get("i", 0) == b.get("i", 0)
            and type(a.get("lp")) is type(b.get("lp")) and isinstance(a.get("lp"), (list, type(None))))


def merge_deltas(a: Delta, b: Delta) -> Delta:
    """`b` appended to `a` (same job). Plain text stays plain text; otherwise
    the parts are concatenated in order, and only adjacent text runs of one
    kind and one choice are joined: never across choices, never a tool part."""
    tokens = min(MAX_DELTA_TOKENS, a.tokens + b.tokens)  # a joined count stays a valid one
    if not a.parts and not b.parts:
        return Delta(job=a.job, text=a.text + b.text, tokens=tokens)
    parts = list(delta_parts(a))
    for part in delta_parts(b):
        if parts and _mergeable(parts[-1], part):
            last = parts[-1]
            joined = {**last, "t": last.get("t", "") + part.get("t", "")}
            if "lp" in last:
                joined["lp"] = last["lp"] + part["lp"]
            parts[-1] = joined
        else:
            parts.append(part)
    return Delta(job=a.job, parts=parts, tokens=tokens)
