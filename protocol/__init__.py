"""Wire protocol between the supervisor and its runtime workers.

Transport: one ZeroMQ ROUTER socket in the supervisor (bound to an ipc path in
a private 0700 directory), one DEALER socket per worker whose routing identity
is the replica id. Every message is ONE frame holding one msgpack map:

    DEALER (worker) --[ msgpack map ]--> ROUTER (supervisor)
                                          sees [ identity | msgpack map ]

    map = { "v": PROTOCOL_VERSION, "t": <type>, ...fields of that type }

    worker -> supervisor                    supervisor -> worker
    ------------------------------------    -----------------------------------
    hello   pid, backend                    submit    job, request{...}, endpoint
    ready   capacity, info{}                cancel    job
    delta   job, text, parts[]              heartbeat
    done    job, finish_reason, usage{},    shutdown
            finish_reasons[], result{}
    error   job|None, code, message
    heartbeat inflight, jobs[], submits_seen

  hello is sent on connect (before the runtime loads); ready follows once the
  runtime can take jobs, carrying its honest capacity; a load failure is an
  `error` with job None. Every submitted job ends with exactly one `done` or
  `error`, also when it was cancelled (finish_reason "cancelled").
  An optional field at its default is left off the wire (a plain text delta
  carries only job and text); see messages.Delta for the typed parts.

Frames above MAX_FRAME_BYTES are refused. `decode` never raises: any malformed
frame comes back as a `ProtocolError` value naming what was wrong.
"""

from protocol.codec import MAX_FRAME_BYTES, PROTOCOL_VERSION, ProtocolError, decode, encode, find_unencodable
from protocol.messages import (
    ENDPOINTS,
    Cancel,
    Delta,
    Done,
    Error,
    Heartbeat,
    Hello,
    Message,
    Ready,
    Shutdown,
    Submit,
    delta_parts,
    delta_size,
    merge_deltas,
)

__all__ = [
    "MAX_FRAME_BYTES", "PROTOCOL_VERSION", "ProtocolError", "decode", "encode", "find_unencodable",
    "Cancel", "Delta", "Done", "Error", "Heartbeat", "Hello", "Message", "Ready",
    "Shutdown", "Submit", "ENDPOINTS", "delta_parts", "delta_size", "merge_deltas",
]
