"""vLLM's KV-cache events, relayed to the supervisor (routing "prefix").

vLLM started with `--kv-events-config '{"enable_kv_cache_events": true,
"publisher": "zmq", "endpoint": "ipc://..."}'` binds a PUB socket there and
publishes, per engine step with cache changes, one message of three frames:

    topic (bytes) | sequence number (8 bytes, big-endian) | msgpack payload

The payload is an array [ts, events, data_parallel_rank?]; each event is a map
tagged by "type": BlockStored {block_hashes, parent_block_hash, token_ids,
block_size, extra_keys, medium, group_idx, ...}, BlockRemoved {block_hashes,
medium, group_idx, ...} or AllBlocksCleared {}. A block hash is bytes (sha256)
or an int. (vllm/distributed/kv_events.py; checked against a real run in
tests/test_vllm_serve.py.)

`decode_frame` turns one message into the compact events of protocol.KvEvents
(pure, never raises); `KvEventRelay` subscribes, checks the sequence, and hands
bounded batches to the worker's sender. A gap in the sequence is asked of the
engine's replay socket (a ROUTER: the first missing number, 8 bytes big-endian,
answered by the buffered messages from it, each as [b"", topic, seq, payload],
then an end marker of sequence -1), live messages held meanwhile. A gap the
replay cannot fill within REPLAY_TIMEOUT_S, a malformed message or a backlog
past MAX_PENDING_EVENTS is sent on as `reset`: the supervisor then knows its
copy of this cache is no longer exact."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import msgpack
import zmq
import zmq.asyncio

from protocol import MAX_KV_EVENTS
from protocol.loop_socket import LoopSocket

MAX_BLOCKS_PER_EVENT = 256  # a longer BlockStored is split (each piece's parent: the last block before it)
MAX_HASH_BYTES = 64  # sha256 is 32
MAX_PENDING_EVENTS = 16 * MAX_KV_EVENTS  # not yet handed to the sender: past this, drop them and reset
MAX_PAYLOAD_BYTES = 16 * 1024 * 1024
REPLAY_TIMEOUT_S = 2.0
MAX_HELD_MESSAGES = 1024  # live messages held while a replay runs: past this, the replay is given up
END_SEQ = -1  # the replay's end marker
_CACHE_MEDIA = (None, "GPU")  # the engine's own cache; offloaded tiers are not what a request reuses first

log = logging.getLogger("runtime_worker.kv_events")


class MalformedEvents(ValueError):
    pass


def _hash(value):
    if isinstance(value, bytes) and 0 < len(value) <= MAX_HASH_BYTES:
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise MalformedEvents(f"a block hash of type {type(value).__name__}")


def _hashes(value) -> list:
    if not isinstance(value, list):
        raise MalformedEvents("block_hashes is not a list")
    return [_hash(h) for h in value]


def _event(raw) -> list[list]:
    """One engine event as compact events (several, for a long BlockStored); [] for
    one that concerns another cache (an offload medium, another KV group)."""
    if not isinstance(raw, dict):
        raise MalformedEvents(f"an event is a {type(raw).__name__}")
    kind = raw.get("type")
    if kind == "AllBlocksCleared":
        return [["cleared"]]
    if raw.get("medium") not in _CACHE_MEDIA or raw.get("group_idx") not in (None, 0):
        return []
    if kind == "BlockRemoved":
        hashes = _hashes(raw.get("block_hashes"))
        return [["removed", hashes[i:i + MAX_BLOCKS_PER_EVENT]] for i in range(0, len(hashes), MAX_BLOCKS_PER_EVENT)]
    if kind != "BlockStored":
        raise MalformedEvents(f"unknown event type {kind!r}")
    hashes = _hashes(raw.get("block_hashes"))
    parent = raw.get("parent_block_hash")
    parent = None if parent is None else _hash(parent)
    size, tokens = raw.get("block_size"), raw.get("token_ids")
    if not isinstance(size, int) or isinstance(size, bool) or not 0 < size <= 65536:
        raise MalformedEvents("block_size is not a positive int")
    if not isinstance(tokens, list) or len(tokens) != len(hashes) * size:
        raise MalformedEvents("token_ids do not fill the stored blocks")
    if not all(type(t) is int for t in tokens):
        raise MalformedEvents("a token id is not an int")
    extra = bool(raw.get("extra_keys") and any(raw["extra_keys"])) or raw.get("lora_name") is not None
    out = []
    for i in range(0, len(hashes), MAX_BLOCKS_PER_EVENT):
        piece = hashes[i:i + MAX_BLOCKS_PER_EVENT]
        out.append(["stored", piece, parent, tokens[i * size:(i + len(piece)) * size], size, extra])
        parent = piece[-1]
    return out


def decode_frame(parts: list[bytes]) -> tuple[int, list[list]] | str:
    """(sequence number, compact events) of one published message, or why it is malformed."""
    if len(parts) != 3:
        return f"a {len(parts)}-part message, not 3"
    _topic, seq, payload = parts
    if len(seq) != 8:
        return f"a sequence number of {len(seq)} bytes"
    if len(payload) > MAX_PAYLOAD_BYTES:
        return f"a payload of {len(payload)} bytes"
    try:
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        return f"undecodable msgpack: {type(exc).__name__}"
    if not isinstance(batch, list) or len(batch) < 2 or not isinstance(batch[1], list):
        return "the payload is not [ts, events, ...]"
    events = []
    try:
        for raw in batch[1]:
            events.extend(_event(raw))
    except MalformedEvents as exc:
        return str(exc)
    return int.from_bytes(seq, "big", signed=True), events


class KvEventRelay:
    """Subscribes to the engine's publisher and hands its events, in order and in
    batches of at most MAX_KV_EVENTS, to `send(events, reset)`; fills gaps from
    `replay_endpoint` when there is one."""

    def __init__(self, ctx: zmq.Context, endpoint: str, send: Callable[[list, bool], None],
                 replay_endpoint: str | None = None) -> None:
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 1024)  # a stalled worker loses messages past this (a gap), not memory
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_PAYLOAD_BYTES + 4096)  # a bigger message drops the connection
        sock.connect(endpoint)  # before the engine binds: it then delivers from its first batch
        self._ctx = ctx
        self._send = send
        self._replay_endpoint = replay_endpoint
        self._replay_sock: zmq.asyncio.Socket | None = None
        self._replay_task: asyncio.Task | None = None
        self._held: list[tuple[int, list]] | None = None  # live messages while a replay runs
        self._next_seq: int | None = 0
        self._pending: list = []
        self._reset = False
        self.batches = self.events = self.gaps = self.malformed = self.replayed = 0
        self.sock = LoopSocket(sock, self.on_message)  # served from now on, by the running loop

    @property
    def replaying(self) -> bool:
        return self._held is not None

    def close(self) -> None:
        if self._replay_task is not None:
            self._replay_task.cancel()
        if self._replay_sock is not None:  # closed here: the context's term waits for every socket
            self._replay_sock.close(linger=0)
        self.sock.close()

    def on_message(self, parts: list[bytes]) -> None:
        decoded = decode_frame(parts)
        if isinstance(decoded, str):
            self.malformed += 1
            log.error("a malformed KV-event message from the runtime (%s): the supervisor's exact index of "
                      "this replica resets", decoded)
            self._lost()
            self._next_seq = None  # its number is unknown: take the next one as it comes
        else:
            self._accept(*decoded)
        self.flush()

    def _accept(self, seq: int, events: list) -> None:
        if self._held is not None:  # a replay runs: this waits for it, in order
            if len(self._held) < MAX_HELD_MESSAGES:
                self._held.append((seq, events))
                return
            self._replay_task.cancel()  # too far behind: given up (its done-callback resets)
            self._held.append((seq, events))
            return
        if self._next_seq is not None and seq != self._next_seq:
            if self._replay_endpoint is not None and seq > self._next_seq:
                self._held = [(seq, events)]
                self._replay_task = asyncio.create_task(self._replay(self._next_seq, seq), name="kv-replay")
                self._replay_task.add_done_callback(self._replayed)
                return
            self._gap(seq)
        self._next_seq = seq + 1
        self.batches += 1
        self.events += len(events)
        self._pending.extend(events)
        if len(self._pending) > MAX_PENDING_EVENTS:
            log.warning("%d KV events waiting to be sent: dropped, the exact index resets", len(self._pending))
            self._lost()

    def _gap(self, seq: int) -> None:
        self.gaps += 1
        log.warning("KV events %s..%d were lost: the supervisor's exact index of this replica resets",
                    self._next_seq, seq - 1)
        self._lost()

    async def _replay(self, start: int, stop: int) -> list[tuple[int, list]] | None:
        """Messages start..stop-1 from the engine's replay buffer; None if it has not them all."""
        sock = self._replay_sock = zmq.asyncio.Socket.from_socket(self._ctx.socket(zmq.DEALER))
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_PAYLOAD_BYTES + 4096)
        got: list[tuple[int, list]] = []
        try:
            sock.connect(self._replay_endpoint)
            await sock.send_multipart([b"", start.to_bytes(8, "big")])
            async with asyncio.timeout(REPLAY_TIMEOUT_S):
                while True:
                    parts = await sock.recv_multipart()
                    if len(parts) == 4 and int.from_bytes(parts[2], "big", signed=True) == END_SEQ:
                        break
                    decoded = decode_frame(parts[1:])
                    if isinstance(decoded, str):
                        return None
                    if decoded[0] == start + len(got) and decoded[0] < stop:
                        got.append(decoded)
        except TimeoutError:
            return None
        finally:
            sock.close(linger=0)
            self._replay_sock = None
        return got if len(got) == stop - start else None

    def _replayed(self, task: asyncio.Task) -> None:
        """The replay ended: its messages, then the held ones, in order; or, if it
        could not fill the gap, a reset and the held ones."""
        if not task.cancelled() and task.exception() is not None:
            log.error("replaying lost KV events failed: %r", task.exception())
        filled = None if task.cancelled() or task.exception() is not None else task.result()
        held, self._held, self._replay_task = self._held or [], None, None
        if filled:
            self.replayed += len(filled)
            held = filled + held
        else:
            self._gap(held[0][0] if held else 0)
            self._next_seq = None
        for seq, events in held:
            self._accept(seq, events)
        self.flush()

    def _lost(self) -> None:
        self._pending.clear()
        self._reset = True

    def flush(self) -> None:
        while self._pending or self._reset:
            batch, self._pending = self._pending[:MAX_KV_EVENTS], self._pending[MAX_KV_EVENTS:]
            self._send(batch, self._reset)
            self._reset = False
