"""Wire protocol between the supervisor and its runtime workers.

Transport: one ZeroMQ ROUTER socket in the supervisor (bound to an ipc path in
a private 0700 directory), one DEALER socket per worker whose routing identity
is the replica id. Every message is ONE frame holding one msgpack map (or an
array of them; see below):

    DEALER (worker) --[ msgpack map ]--> ROUTER (supervisor)
                                          sees [ identity | msgpack map ]

    map = { "v": PROTOCOL_VERSION, "t": <type>, ...fields of that type }

    worker -> supervisor                    supervisor -> worker
    ------------------------------------    -----------------------------------
    hello                                   setup     options{}   (the answer to hello)
                                            submit    job, request{...}, endpoint,
                                                      headers{}
    ready   capacity, info{}                cancel    job
    delta   job, text, parts[], tokens,     heartbeat
            tasks[]
    done    job, finish_reason, usage{},    shutdown
            finish_reasons[], result{},
            timings{}, extra{},
            usage_on_finish
    error   job|None, code, message, param?,
            exit_code? (a dead runtime's own)
    heartbeat inflight, jobs[], submits_seen
    kv_events events[], reset

  hello is sent on connect; the supervisor answers with setup, the model's
  options (secrets among them: never in the worker's argv), and the worker
  loads its runtime; ready follows once the runtime can take jobs, carrying its honest capacity; a load failure is an
  `error` with job None. Every submitted job ends with exactly one `done` or
  `error`, also when it was cancelled (finish_reason "cancelled").
  An optional field at its default is left off the wire (a plain text delta
  of one token carries only job and text); see messages.Delta for the typed
  parts and `tokens` (the output tokens a delta carries, 0..MAX_DELTA_TOKENS).
  `tasks` (on a delta of its own, with no output): the runtime's [slot,
  task id] pairs that serve the job, where the worker learned them
  (llama-server); see messages.tasks_error.
  kv_events (a vLLM worker with routing "prefix") relays the engine's
  KV-cache events, in order, MAX_KV_EVENTS at most a message; see messages.KvEvents.

Either side may send several messages as one frame, a msgpack array of those
maps (`encode_batch`): what its sender had ready in one wake-up, across jobs,
in order (a worker's deltas and results; the supervisor's submits, cancels
and heartbeats of one loop turn). Frames above MAX_FRAME_BYTES are refused. `decode` and
`decode_many` never raise: any malformed frame (or item of a batch) comes back
as a `ProtocolError` value naming what was wrong.
"""

from protocol.codec import (
    MAX_FRAME_BYTES, PROTOCOL_VERSION, ProtocolError, decode, decode_many, encode, encode_batch, encode_submit,
    find_unencodable)
from protocol.messages import (
    ENDPOINTS,
    LIGHT_CALLS_PER_WORKER,
    LIGHT_ENDPOINTS,
    Cancel,
    Delta,
    Done,
    Error,
    Heartbeat,
    Hello,
    KvEvents,
    MAX_DELTA_TOKENS,
    MAX_KV_EVENTS,
    MAX_RUNTIME_TASKS,
    Message,
    Ready,
    Setup,
    Shutdown,
    Submit,
    delta_parts,
    delta_size,
    merge_deltas,
    runtime_timings,
    tasks_error,
)

__all__ = [
    "MAX_FRAME_BYTES", "PROTOCOL_VERSION", "ProtocolError", "decode", "decode_many", "encode", "encode_batch",
    "encode_submit", "find_unencodable",
    "Cancel", "Delta", "Done", "Error", "Heartbeat", "Hello", "KvEvents", "MAX_DELTA_TOKENS", "MAX_KV_EVENTS", "MAX_RUNTIME_TASKS", "Message", "Ready", "Setup",
    "Shutdown", "Submit", "ENDPOINTS", "LIGHT_ENDPOINTS", "LIGHT_CALLS_PER_WORKER", "delta_parts", "delta_size", "merge_deltas",
    "runtime_timings", "tasks_error",
]
