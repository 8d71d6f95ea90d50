"""Message types. Each is a frozen dataclass whose fields are the wire fields;
`TYPE` is its tag ("t") on the wire. Field types are checked on decode."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar


@dataclass(frozen=True, slots=True)
class Hello:
    """The worker's first word: it is connected (the supervisor knows its pid and backend already)."""
    TYPE: ClassVar[str] = "hello"


@dataclass(frozen=True, slots=True)
class Ready:
    TYPE: ClassVar[str] = "ready"
    capacity: int  # honest number of jobs the runtime can run at once
    info: dict = field(default_factory=dict)  # e.g. child pid, port, n_ctx


@dataclass(frozen=True, slots=True)
class Submit:
    TYPE: ClassVar[str] = "submit"
    job: str
    request: dict  # {"messages": [...], "max_tokens": int|None, "temperature", "top_p", "stop"}


@dataclass(frozen=True, slots=True)
class Cancel:
    TYPE: ClassVar[str] = "cancel"
    job: str


@dataclass(frozen=True, slots=True)
class Delta:
    TYPE: ClassVar[str] = "delta"
    job: str
    text: str


@dataclass(frozen=True, slots=True)
class Done:
    TYPE: ClassVar[str] = "done"
    job: str
    finish_reason: str  # "stop" | "length" | "cancelled"
    usage: dict = field(default_factory=dict)  # {"input_tokens", "output_tokens"}


@dataclass(frozen=True, slots=True)
class Error:
    TYPE: ClassVar[str] = "error"
    job: str | None  # None: the runtime itself failed (e.g. load failure)
    code: str  # an ErrorCode value
    message: str


@dataclass(frozen=True, slots=True)
class Heartbeat:
    TYPE: ClassVar[str] = "heartbeat"
    inflight: int = 0
    jobs: list = field(default_factory=list)  # worker -> supervisor: the ids of the jobs it runs
    submits_seen: int = 0  # worker -> supervisor: Submits received so far


@dataclass(frozen=True, slots=True)
class Shutdown:
    TYPE: ClassVar[str] = "shutdown"


Message = Hello | Ready | Submit | Cancel | Delta | Done | Error | Heartbeat | Shutdown

MESSAGE_TYPES: dict[str, type] = {
    cls.TYPE: cls for cls in (Hello, Ready, Submit, Cancel, Delta, Done, Error, Heartbeat, Shutdown)
}

# Expected Python types per field, checked on decode (msgpack gives plain types).
FIELD_TYPES: dict[type, dict[str, Any]] = {
    Hello: {},
    Ready: {"capacity": int, "info": dict},
    Submit: {"job": str, "request": dict},
    Cancel: {"job": str},
    Delta: {"job": str, "text": str},
    Done: {"job": str, "finish_reason": str, "usage": dict},
    Error: {"job": (str, type(None)), "code": str, "message": str},
    Heartbeat: {"inflight": int, "jobs": list, "submits_seen": int},
    Shutdown: {},
}
