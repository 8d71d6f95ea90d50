"""msgpack codec with a frame cap and a decoder that never raises."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import msgpack

from protocol.messages import (
    FIELD_TYPES, MAX_DELTA_TOKENS, MAX_KV_EVENTS, MESSAGE_TYPES, Delta, Done, KvEvents, Message, part_error,
    tasks_error)

# 2: Submit.endpoint, Delta.parts, Done.finish_reasons and result; 3: batches (encode_batch);
# 4: Setup (the model's options over the socket, not in argv); 5: Done.timings (the runtime's own);
# 6: KvEvents (a runtime's KV-cache events); 7: Delta.tokens; "open" and "extra" delta parts,
# Done.extra and Done.usage_on_finish (a runtime's answer relayed to the letter); 8: Submit.headers;
# 9: Setup.warm_swap. Not bumped since: an optional field a reader of 9 skips (Delta.tasks)
PROTOCOL_VERSION = 9
# Twice the largest request body a pool may accept (supervisor config caps
# max_body_bytes at MAX_FRAME_BYTES // 2): msgpack never makes a JSON request
# much bigger, so a body under its cap always fits in one Submit frame.
MAX_FRAME_BYTES = 16 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class ProtocolError:
    """A frame that could not be decoded. `job` is set when the frame named one,
    so the supervisor can fail that job instead of leaving it waiting."""

    reason: str
    job: str | None = None


def _default(f: dataclasses.Field):
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


# per message type: (required fields, optional fields with their defaults). An optional field
# at its default is left off the wire: a plain text delta stays {"v", "t", "job", "text"}.
_ENCODE = {cls: (tuple(f.name for f in dataclasses.fields(cls)
                       if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING),
                 tuple((f.name, _default(f)) for f in dataclasses.fields(cls)
                       if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING))
           for cls in MESSAGE_TYPES.values()}


def _optional(cls: type, name: str) -> bool:
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    return f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING


# per message type: (field, expected type(s), may be absent), worked out once, not per frame
_SCHEMA = {cls: tuple((name, expected, _optional(cls, name)) for name, expected in FIELD_TYPES[cls].items())
           for cls in MESSAGE_TYPES.values()}
_packb = msgpack.Packer(use_bin_type=True).pack  # one packer: no per-message set-up on the token path
_unpackb = functools.partial(msgpack.unpackb, raw=False, strict_map_key=True)


def encode(msg: Message) -> bytes:
    if type(msg) is Delta and not msg.parts and msg.tokens == 1 and not msg.tasks:  # the token path: one map, no loops
        return _packb({"v": PROTOCOL_VERSION, "t": "delta", "job": msg.job, "text": msg.text})
    payload = {"v": PROTOCOL_VERSION, "t": msg.TYPE}
    required, optional = _ENCODE[type(msg)]
    for name in required:
        payload[name] = getattr(msg, name)
    for name, default in optional:
        value = getattr(msg, name)
        if value != default:
            payload[name] = value
    return _packb(payload)


def encode_submit(job: str, request: dict, endpoint: str = "chat", headers: dict | None = None) -> bytes:
    """encode(Submit(...)), the same bytes, with no message object made: once per request."""
    payload = {"v": PROTOCOL_VERSION, "t": "submit", "job": job, "request": request}
    if endpoint != "chat":
        payload["endpoint"] = endpoint
    if headers:
        payload["headers"] = headers
    return _packb(payload)


_INT_RANGE = (-(2**63), 2**64 - 1)  # what msgpack can carry


def find_unencodable(value, path: str = "") -> tuple[str, str] | None:
    """The first value inside `value` that msgpack cannot encode, as (dotted
    path, reason); None if there is none. Used to name the offending field of
    a client's request, not on the hot path."""
    if isinstance(value, bool) or value is None or isinstance(value, float):
        return None
    if isinstance(value, int):
        if not _INT_RANGE[0] <= value <= _INT_RANGE[1]:
            return path, "integer out of range"
        return None
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path, "text that is not valid Unicode (a lone surrogate)"
        return None
    if isinstance(value, (bytes, bytearray)):
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                return path, "a map key that is not text"
            found = find_unencodable(key, path) or find_unencodable(item, f"{path}.{key}" if path else key)
            if found:
                return found
        return None
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            if found := find_unencodable(item, f"{path}.{i}" if path else str(i)):
                return found
        return None
    return path, f"a value of type {type(value).__name__}"


def encode_batch(frames: list[bytes]) -> bytes:
    """Several encoded messages as one frame: a msgpack array of their maps,
    made by prefixing the array header (no re-encoding). One message stays a
    plain map. The caller keeps the total under MAX_FRAME_BYTES."""
    n = len(frames)
    if n == 1:
        return frames[0]
    head = bytes((0x90 | n,)) if n < 16 else b"\xdc" + n.to_bytes(2, "big") if n < 65536 else \
        b"\xdd" + n.to_bytes(4, "big")
    return head + b"".join(frames)


def decode(frame: bytes) -> Message | ProtocolError:
    """One message (a frame holding one map)."""
    if len(frame) > MAX_FRAME_BYTES:
        return ProtocolError(f"frame of {len(frame)} bytes exceeds the {MAX_FRAME_BYTES} byte cap")
    try:
        data = _unpackb(frame)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        return ProtocolError(f"undecodable msgpack: {type(exc).__name__}: {exc}")
    return _message(data)


def decode_many(frame: bytes) -> list[Message | ProtocolError]:
    """The messages of a frame: one map, or an array of maps (encode_batch),
    in order. A bad item is a ProtocolError in its place (naming its job when
    it can), the others decode as usual; a frame that is neither is one
    ProtocolError. Never raises."""
    if len(frame) > MAX_FRAME_BYTES:
        return [ProtocolError(f"frame of {len(frame)} bytes exceeds the {MAX_FRAME_BYTES} byte cap")]
    try:
        data = _unpackb(frame)
    except Exception as exc:
        return [ProtocolError(f"undecodable msgpack: {type(exc).__name__}: {exc}")]
    if type(data) is list:
        return [_message(item, "a batch item") for item in data]
    return [_message(data)]


def _message(data, what: str = "frame") -> Message | ProtocolError:
    if not isinstance(data, dict):
        return ProtocolError(f"{what} is a {type(data).__name__}, not a map")
    job = data.get("job") if isinstance(data.get("job"), str) else None
    if data.get("v") != PROTOCOL_VERSION:
        return ProtocolError(f"protocol version {data.get('v')!r}, expected {PROTOCOL_VERSION}", job)
    kind = data.get("t")
    if kind == "delta" and job is not None and type(data.get("text")) is str:  # the token path
        if len(data) == 4:
            return Delta(job, data["text"])  # {"v", "t", "job", "text"}, checked above
        tokens = data.get("tokens")
        if len(data) == 5 and type(tokens) is int and 0 <= tokens <= MAX_DELTA_TOKENS:
            return Delta(job, data["text"], tokens=tokens)  # merged tokens: {..., "tokens"}
    elif kind == "done" and len(data) == 5 and job is not None and type(data.get("finish_reason")) is str \
            and type(data.get("usage")) is dict:  # the usual end: {"v", "t", "job", "finish_reason", "usage"}
        return Done(job, data["finish_reason"], data["usage"])
    cls = MESSAGE_TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        return ProtocolError(f"unknown message type {kind!r}", job)
    kwargs = {}
    for name, expected, optional in _SCHEMA[cls]:
        if name not in data:
            if optional:
                continue
            return ProtocolError(f"{cls.TYPE}: missing field {name!r}", job)
        value = data[name]
        # bool is an int subclass; a bool where a count is expected is still wrong
        if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
            return ProtocolError(f"{cls.TYPE}: field {name!r} has type {type(value).__name__}", job)
        kwargs[name] = value
    if cls is KvEvents and len(kwargs.get("events", ())) > MAX_KV_EVENTS:
        return ProtocolError(f"kv_events: {len(kwargs['events'])} events, more than {MAX_KV_EVENTS}")
    if cls is Delta and not 0 <= kwargs.get("tokens", 1) <= MAX_DELTA_TOKENS:
        return ProtocolError(f"delta: tokens {kwargs['tokens']} is not between 0 and {MAX_DELTA_TOKENS}", job)
    if cls is Delta and kwargs.get("tasks") and (reason := tasks_error(kwargs["tasks"])):
        return ProtocolError(f"{cls.TYPE}: {reason}", job)
    if cls is Delta and kwargs.get("parts"):
        for part in kwargs["parts"]:
            if reason := part_error(part):
                return ProtocolError(f"delta: {reason}", job)
    return cls(**kwargs)
