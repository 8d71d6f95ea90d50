"""The wire codec: round trips, every kind of malformed frame, and a fuzzer.
`decode` must never raise, whatever bytes arrive."""

from __future__ import annotations

import asyncio

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import protocol as p
from runtime_worker.outbox import MERGE_LIMIT_CHARS, Outbox, coalesce

MESSAGES = [
    p.Hello(), p.Ready(capacity=4, info={"port": 1}),
    p.Submit(job="j", request={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}),
    p.Cancel(job="j"), p.Delta(job="j", text="tok"),
    p.Submit(job="j", request={"prompt": "hi"}, endpoint="completions"),
    p.Delta(job="j", parts=[{"k": "reasoning", "i": 0, "t": "hm"}, {"k": "text", "i": 1, "t": "a", "lp": [{}]},
                            {"k": "tool", "i": 0, "n": 0, "id": "c1", "name": "f", "args": "{"}]),
    p.Done(job="j", finish_reason="tool_calls", finish_reasons=["tool_calls", "length"],
           result={"data": [{"embedding": [0.5]}]}),
    p.Error(job="j", code="unsupported_parameter", message="no", param="tools"),
    p.Done(job="j", finish_reason="stop", usage={"input_tokens": 1, "output_tokens": 2}),
    p.Error(job=None, code="load_failed", message="no file"), p.Error(job="j", code="runtime_error", message="x"),
    p.Heartbeat(inflight=2), p.Shutdown(), p.Setup(options={"base_url": "https://u:p@h/v1", "env": {"T": "x"}}),
    p.Delta(job="j", parts=[{"k": "open", "i": 0, "d": {"content": None}}, {"k": "text", "i": 0, "t": "a"},
                            {"k": "extra", "x": {"timings": {"predicted_n": 1}}}]),
    p.Done(job="j", finish_reason="length", usage={"input_tokens": 1, "output_tokens": 2, "cached_tokens": 0},
           extra={"timings": {"predicted_n": 2}, "__verbose": {"prompt": "x"}}, usage_on_finish=True),
    p.Delta(job="j", tokens=0, tasks=[[1, 7], [0, 8]]),
]


def test_round_trip_every_message_type():
    for msg in MESSAGES:
        assert p.decode(p.encode(msg)) == msg


def frame(**fields) -> bytes:
    return msgpack.packb({"v": p.PROTOCOL_VERSION, **fields})


def test_malformed_frames_become_typed_errors():
    cases = {
        b"\xc1": "undecodable",
        b"": "undecodable",
        msgpack.packb([1, 2]): "not a map",
        frame(t="nope"): "unknown message type",
        frame(t="done", job="j"): "missing field 'finish_reason'",
        frame(t="delta", job="j", parts=[{"k": "sound", "t": "x"}]): "unknown part kind 'sound'",
        frame(t="delta", job="j", parts=[{"k": "text", "i": -1, "t": "x"}]): "part field 'i' is not a choice index",
        frame(t="delta", job="j", parts=[{"k": "tool", "n": 0, "args": 5}]): "part field 'args' has type int",
        frame(t="delta", job="j", parts=["x"]): "a part is a str",
        frame(t="delta", job="j", parts=[{"k": "open", "d": {"content": "text"}}]): "not a few empty ones",
        frame(t="delta", job="j", parts=[{"k": "open", "d": {str(i): None for i in range(9)}}]): "not a few empty",
        frame(t="delta", job="j", parts=[{"k": "extra", "x": [1]}]): "part field 'x' has type list",
        frame(t="done", job="j", finish_reason="stop", extra=[]): "field 'extra' has type list",
        frame(t="delta", job="j", text=5): "field 'text' has type int",
        frame(t="heartbeat", inflight=True): "field 'inflight' has type bool",
        frame(t="ready", capacity="4"): "field 'capacity' has type str",
        frame(t="delta", job="j", tasks=[[0, 1]] * 65): "65 runtime tasks, more than 64",
        frame(t="delta", job="j", tasks=[[0, -1]]): "not a [slot, task id] pair",
        frame(t="delta", job="j", tasks=[[0, 1, 2]]): "not a [slot, task id] pair",
        frame(t="delta", job="j", tasks=[[0, True]]): "not a [slot, task id] pair",
        frame(t="delta", job="j", tasks={"0": 1}): "field 'tasks' has type dict",
        msgpack.packb({"v": 99, "t": "delta", "job": "j", "text": "x"}): "protocol version 99",
        msgpack.packb({"t": "delta"}): "protocol version None",
    }
    for raw, reason in cases.items():
        err = p.decode(raw)
        assert isinstance(err, p.ProtocolError), raw
        assert reason in err.reason, (raw, err)


def test_errors_name_the_job_when_they_can():
    assert p.decode(frame(t="delta", job="j7", text=1)).job == "j7"
    assert p.decode(msgpack.packb({"v": p.PROTOCOL_VERSION, "t": "done", "job": "j8"})).job == "j8"
    assert p.decode(b"\xc1").job is None


def test_frame_cap():
    big = p.encode(p.Delta(job="j", text="x" * p.MAX_FRAME_BYTES))
    err = p.decode(big)
    assert isinstance(err, p.ProtocolError) and "cap" in err.reason


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=2048))
def test_decode_never_raises_on_random_bytes(raw):
    assert isinstance(p.decode(raw), (p.ProtocolError, *p.messages.MESSAGE_TYPES.values()))


values = st.recursive(st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats() | st.text(max_size=20)
                      | st.binary(max_size=20), lambda inner: st.lists(inner, max_size=4)
                      | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=10)


@settings(max_examples=500, deadline=None)
@given(st.sampled_from(sorted(p.messages.MESSAGE_TYPES)), st.dictionaries(
    st.sampled_from(["v", "job", "text", "pid", "backend", "capacity", "info", "request", "finish_reason",
                     "usage", "code", "message", "inflight", "parts", "endpoint", "finish_reasons", "result",
                     "param", "tokens"]), values, max_size=6))
def test_decode_never_raises_on_random_maps(kind, fields):
    raw = msgpack.packb({"t": kind, "v": p.PROTOCOL_VERSION, **fields})
    msg = p.decode(raw)
    if not isinstance(msg, p.ProtocolError):  # anything accepted has the declared field types
        for name, expected in p.messages.FIELD_TYPES[type(msg)].items():
            assert isinstance(getattr(msg, name), expected)


def test_outbox_merges_a_jobs_pending_deltas_but_never_across_its_end():
    batch = [p.Delta(job="a", text="1"), p.Delta(job="b", text="x"), p.Delta(job="a", text="2"),
             p.Done(job="a", finish_reason="stop"), p.Delta(job="a", text="late"), p.Delta(job="b", text="y"),
             p.Heartbeat(inflight=1), p.Error(job="b", code="runtime_error", message="boom"),
             p.Delta(job="b", text="z")]
    assert coalesce(batch) == [  # a merged delta carries the tokens of its parts
        p.Delta(job="a", text="12", tokens=2), p.Delta(job="b", text="xy", tokens=2),
        p.Done(job="a", finish_reason="stop"),
        p.Delta(job="a", text="late"), p.Heartbeat(inflight=1), p.Error(job="b", code="runtime_error",
                                                                         message="boom"),
        p.Delta(job="b", text="z")]


def test_a_delta_that_says_the_jobs_runtime_tasks_goes_apart_and_frames_without_it_read_as_before():
    told = p.Delta(job="a", tokens=0, tasks=[[1, 7]])
    batch = [p.Delta(job="a", text="1"), told, p.Delta(job="a", text="2"), p.Delta(job="a", text="3")]
    assert coalesce(batch) == [p.Delta(job="a", text="1"), told, p.Delta(job="a", text="23", tokens=2)]
    assert p.decode(p.encode(told)) == told
    # a worker that never says tasks (an older one, another runtime): its frames are as they were
    assert p.decode(frame(t="delta", job="a", text="x")) == p.Delta(job="a", text="x")
    assert "tasks" not in msgpack.unpackb(p.encode(p.Delta(job="a", text="x", tokens=2)))


def test_a_delta_says_how_many_tokens_it_carries_through_the_outbox():
    """The live tokens/s counts tokens: text put token by token leaves as one delta that
    carries their count, and a count travels the wire (one token: the short form)."""
    async def run() -> list:
        sent = []

        class Sock:
            async def send(self, frames):
                sent.extend(frames)
        box = Outbox(Sock())
        for text, tokens in (("a", 1), ("", 0), ("bc", 3), ("d", 1)):
            box.put_text("j", text, tokens)
        box.put(p.Delta(job="j", parts=[{"k": "reasoning", "t": "hm"}], tokens=2))
        task = asyncio.create_task(box.run())
        await box.flush(5)
        task.cancel()
        return [m for frame in sent for m in p.decode_many(frame)]

    got = asyncio.run(run())
    assert [m.tokens for m in got] == [7]  # one message: the text run merged with the parts after it
    assert [part["t"] for part in p.messages.delta_parts(got[0])] == ["abcd", "hm"]
    assert p.decode(p.encode(p.Delta(job="j", text="x", tokens=5))).tokens == 5
    assert len(msgpack.unpackb(p.encode(p.Delta(job="j", text="x")))) == 4  # no count on the wire for one
    assert p.decode(frame(t="delta", job="j", text="x", tokens="5")).reason == "delta: field 'tokens' has type str"
    for nonsense in (-1, p.messages.MAX_DELTA_TOKENS + 1):  # a worker is no more trusted than its runtime
        refused = p.decode(frame(t="delta", job="j", text="x", tokens=nonsense))
        assert isinstance(refused, p.ProtocolError) and refused.job == "j" and "tokens" in refused.reason


def test_outbox_keeps_raw_frames_in_place_and_caps_merged_text():
    assert coalesce([p.Delta(job="a", text="1"), b"raw", p.Delta(job="a", text="2")]) == [
        p.Delta(job="a", text="1"), b"raw", p.Delta(job="a", text="2")]
    big = "x" * (MERGE_LIMIT_CHARS // 2 + 1)
    merged = coalesce([p.Delta(job="a", text=big)] * 3)
    assert [len(m.text) for m in merged] == [len(big), len(big), len(big)]
    assert all(len(p.encode(m)) < p.MAX_FRAME_BYTES for m in merged)


def _coalesce_pairwise(batch):
    """The reference: each delta merged into its job's open one as it comes (merge_deltas)."""
    out, open_delta = [], {}
    for item in batch:
        if isinstance(item, p.Delta):
            at = open_delta.get(item.job)
            if at is not None and p.delta_size(out[at]) + p.delta_size(item) <= MERGE_LIMIT_CHARS:
                out[at] = p.merge_deltas(out[at], item)
                continue
            open_delta[item.job] = len(out)
        elif (job := getattr(item, "job", None)) is not None:
            open_delta.pop(job, None)
        out.append(item)
    return out


_deltas = st.lists(st.one_of(
    st.builds(lambda j, t, n: p.Delta(job=j, text=t, tokens=n), st.sampled_from("ab"), st.text(max_size=3),
              st.integers(0, 3)),
    st.builds(lambda j, t, n: p.Delta(job=j, parts=[{"k": "reasoning", "t": t}], tokens=n), st.sampled_from("ab"),
              st.text(max_size=3), st.integers(0, 3)),
    st.builds(lambda j: p.Done(job=j, finish_reason="stop"), st.sampled_from("ab"))), max_size=12)


@given(_deltas)
@settings(max_examples=300, deadline=None)
def test_coalesce_joins_text_runs_as_pairwise_merging_would(batch):
    assert coalesce(batch) == _coalesce_pairwise(batch)


def test_heartbeat_lists_the_workers_jobs():
    beat = p.Heartbeat(inflight=2, jobs=["a", "b"])
    assert p.decode(p.encode(beat)) == beat
    assert p.decode(frame(t="heartbeat", inflight=1, jobs="a")).reason == "heartbeat: field 'jobs' has type str"


def test_unencodable_values_are_named_by_path():
    assert p.find_unencodable({"messages": [{"content": "ok"}, {"content": "\ud83d"}]}) == (
        "messages.1.content", "text that is not valid Unicode (a lone surrogate)")
    assert p.find_unencodable({"max_tokens": 10**20}) == ("max_tokens", "integer out of range")
    assert p.find_unencodable({"a": [1, -(2**63), 2**64 - 1, 1.5, None, True, "é"]}) is None


def test_submit_frames_fail_at_admission_not_at_dispatch():
    from protocol.errors import ErrorCode, PoolError
    from supervisor.scheduling.jobs import encode_submit
    import pytest
    with pytest.raises(PoolError) as err:
        encode_submit("j", {"messages": [{"role": "user", "content": "x"}], "max_tokens": -(2**70)})
    assert err.value.code is ErrorCode.INVALID_REQUEST and err.value.param == "max_tokens"
    with pytest.raises(PoolError) as err:  # the backstop behind max_body_bytes
        encode_submit("j", {"messages": [{"role": "user", "content": "x" * p.MAX_FRAME_BYTES}]})
    assert err.value.code is ErrorCode.REQUEST_TOO_LARGE


def test_outbox_turns_an_unencodable_message_into_its_jobs_error():
    from runtime_worker.outbox import encode_or_fail
    failed = []
    frame_ = encode_or_fail(p.Delta(job="j", text="half \ud83d pair"), failed.append)
    msg = p.decode(frame_)
    assert isinstance(msg, p.Error) and msg.job == "j" and msg.code == "runtime_error"
    assert failed == ["j"]
    assert p.decode(encode_or_fail(p.Delta(job="k", text="fine"), failed.append)) == p.Delta(job="k", text="fine")
    assert failed == ["j"]


def test_optional_fields_at_their_default_stay_off_the_wire():
    assert msgpack.unpackb(p.encode(p.Delta(job="j", text="tok"))) == {"v": p.PROTOCOL_VERSION, "t": "delta",
                                                                       "job": "j", "text": "tok"}
    assert set(msgpack.unpackb(p.encode(p.Done(job="j", finish_reason="stop")))) == {"v", "t", "job",
                                                                                     "finish_reason"}


def test_merging_keeps_each_parts_order_and_never_joins_across_choices_or_kinds():
    text = lambda t, i=0, **kw: {"k": "text", "i": i, "t": t, **kw}  # noqa: E731
    tool = {"k": "tool", "i": 0, "n": 0, "id": "c", "name": "f", "args": "{"}
    more = {"k": "tool", "i": 0, "n": 0, "args": "}"}
    batch = [p.Delta(job="a", text="x"), p.Delta(job="a", text="y"),  # plain text: joined as text
             p.Delta(job="a", parts=[{"k": "reasoning", "i": 0, "t": "r"}]), p.Delta(job="a", text="z"),
             p.Delta(job="a", parts=[text("1", 1)]), p.Delta(job="a", parts=[text("w")]),
             p.Delta(job="a", parts=[tool]), p.Delta(job="a", parts=[more]),
             p.Delta(job="a", parts=[text("l", lp=[1])]), p.Delta(job="a", parts=[text("m", lp=[2])])]
    [merged] = coalesce(batch)
    assert merged == p.Delta(job="a", parts=[
        text("xy"), {"k": "reasoning", "i": 0, "t": "r"}, text("z"), text("1", 1), text("w"), tool, more,
        text("lm", lp=[1, 2])], tokens=10)  # the ten deltas' tokens
    assert coalesce(batch[:2]) == [p.Delta(job="a", text="xy", tokens=2)]
    # the supervisor's merge of what piled up for a slow client is the same
    import asyncio
    from supervisor.scheduling.jobs import Job
    job = Job("m", {"messages": [{"role": "user", "content": "x"}], "n": 2}, 10)  # the batch holds choice 1
    for d in batch:
        job.push(d)
    assert asyncio.run(job.next_event(lambda j: None)) == merged


def test_a_runtimes_streamed_choices_become_typed_parts():
    from runtime_worker.backends.base import PartsDelta, TextDelta
    from runtime_worker.openai_events import choice_event
    assert choice_event({"index": 0, "delta": {"content": "hi", "reasoning_content": None}}, chat=True) == \
        TextDelta("hi")  # the cheap common case
    # the runtime's opening of a message is relayed with its empty fields, as it sent them
    assert choice_event({"index": 0, "delta": {"role": "assistant", "content": None}}, chat=True) == \
        PartsDelta([{"k": "open", "i": 0, "d": {"content": None}}])  # llama-server
    assert choice_event({"index": 0, "delta": {"role": "assistant", "content": "", "refusal": None}}, chat=True) == \
        PartsDelta([{"k": "open", "i": 0, "d": {"content": "", "refusal": None}}])  # vLLM, OpenAI
    assert choice_event({"index": 1, "delta": {"role": "assistant", "content": "hi"}}, chat=True) == \
        PartsDelta([{"k": "open", "i": 1, "d": {}}, {"k": "text", "i": 1, "t": "hi"}])
    lp = [{"token": "a", "logprob": -1.0}]
    assert choice_event({"index": 1, "delta": {"content": "a"}, "logprobs": {"content": lp}}, chat=True) == \
        PartsDelta([{"k": "text", "i": 1, "t": "a", "lp": lp}])
    assert choice_event({"index": 0, "delta": {"reasoning": "r", "tool_calls": [
        {"index": 1, "id": "c", "type": "function", "function": {"name": "f", "arguments": "{"}}]}}, chat=True) == \
        PartsDelta([{"k": "reasoning", "i": 0, "t": "r"},
                    {"k": "tool", "i": 0, "n": 1, "args": "{", "id": "c", "name": "f"}])
    assert choice_event({"index": 0, "delta": {"refusal": "no"}}, chat=True) == \
        PartsDelta([{"k": "refusal", "i": 0, "t": "no"}])
    assert choice_event({"index": 0, "text": "x", "logprobs": None}, chat=False) == TextDelta("x")
    assert choice_event({"index": 1, "text": "y"}, chat=False) == PartsDelta([{"k": "text", "i": 1, "t": "y"}])


def test_a_whole_answer_keeps_the_runtimes_own_fields_within_their_bound():
    import json

    from runtime_worker.backends.base import Finished, JobError, TextDelta
    from protocol.messages import MAX_EXTRA_BYTES
    from runtime_worker.openai_events import answer_events
    answer = {"id": "x", "model": "m", "system_fingerprint": "b1", "timings": {"predicted_n": 2},
              "__verbose": {"prompt": "p"}, "usage": {"prompt_tokens": 3, "completion_tokens": 2},
              "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}]}
    text, end = answer_events(json.dumps(answer).encode(), chat=True, choices=1)
    assert text == TextDelta("hi")  # a whole answer has no opening to relay
    assert isinstance(end, Finished) and end.extra == {"timings": {"predicted_n": 2}, "__verbose": {"prompt": "p"}}
    answer["__verbose"] = {"prompt": "p" * MAX_EXTRA_BYTES}
    with pytest.raises(JobError, match="byte bound"):
        answer_events(json.dumps(answer).encode(), chat=True, choices=1)


def test_a_batch_decodes_to_the_same_messages_in_order():
    for count in (1, 2, 15, 16, 300, 70_000):  # each msgpack array header size
        msgs = [MESSAGES[i % len(MESSAGES)] for i in range(count)]
        batch = p.encode_batch([p.encode(m) for m in msgs])
        assert p.decode_many(batch) == msgs
    assert p.encode_batch([p.encode(MESSAGES[0])]) == p.encode(MESSAGES[0])  # one message stays a map
    assert p.decode_many(p.encode(MESSAGES[4])) == [MESSAGES[4]]


def test_a_bad_batch_item_is_an_error_in_its_place_and_the_rest_decode():
    good = {"v": p.PROTOCOL_VERSION, "t": "delta", "job": "a", "text": "x"}
    got = p.decode_many(msgpack.packb([good, {**good, "job": "b", "text": 5}, 7, good]))
    assert got[0] == got[3] == p.Delta(job="a", text="x")
    assert isinstance(got[1], p.ProtocolError) and got[1].job == "b" and "'text' has type int" in got[1].reason
    assert isinstance(got[2], p.ProtocolError) and got[2].job is None and "batch item is a int" in got[2].reason
    assert p.decode_many(msgpack.packb([])) == []
    for raw in (b"\xc1", b"\x93\x01", msgpack.packb("text")):  # garbage, a truncated array, no map
        [err] = p.decode_many(raw)
        assert isinstance(err, p.ProtocolError) and err.job is None


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(st.none(), st.integers(-2**63, 2**63 - 1), st.text(), st.dictionaries(
    st.sampled_from(["v", "t", "job", "text", "parts", "finish_reason"]),
    st.one_of(st.integers(-9, 9), st.text(), st.sampled_from(["delta", "done"]), st.lists(st.integers(-9, 9)))))))
def test_decode_many_never_raises(items):
    for msg in p.decode_many(msgpack.packb(items)):
        assert isinstance(msg, (p.ProtocolError, *p.messages.MESSAGE_TYPES.values()))


def test_the_outbox_sends_what_is_ready_across_jobs_as_one_frame():
    import asyncio
    from runtime_worker.outbox import Outbox

    class Sock:
        def __init__(self):
            self.sent: list[bytes] = []

        async def send(self, parts):
            [frame_] = parts
            self.sent.append(frame_)

    async def go():
        sock = Sock()
        box = Outbox(sock)
        sender = asyncio.create_task(box.run())
        box.put(p.Delta(job="a", text="1"))
        box.put(p.Delta(job="b", text="2"))
        box.put(p.Delta(job="a", text="3"))
        box.put(p.Done(job="b", finish_reason="stop"))
        box.put(b"raw")  # an opaque frame goes alone, in its place
        box.put(p.Delta(job="a", text="4"))
        await box.flush(5)
        sender.cancel()
        return sock.sent

    sent = asyncio.run(go())
    assert sent[1] == b"raw" and len(sent) == 3
    assert p.decode_many(sent[0]) == [p.Delta(job="a", text="13", tokens=2), p.Delta(job="b", text="2"),
                                      p.Done(job="b", finish_reason="stop")]
    assert p.decode_many(sent[2]) == [p.Delta(job="a", text="4")]


_puts = st.lists(st.one_of(
    st.tuples(st.just("text"), st.sampled_from("ab"), st.text(min_size=1, max_size=3)),
    st.tuples(st.just("parts"), st.sampled_from("ab"), st.text(max_size=3)),
    st.tuples(st.just("done"), st.sampled_from("ab"), st.just("")),
    st.tuples(st.just("raw"), st.just(""), st.just(""))), max_size=16)


@given(_puts)
def test_put_text_sends_what_putting_each_delta_would(puts):
    """put_text (a token without a message of its own) is an optimisation of put(Delta):
    the frames on the wire are the same, in the same order."""
    import asyncio
    from runtime_worker.outbox import Outbox

    class Sock:
        def __init__(self):
            self.sent: list = []

        async def send(self, parts):
            [frame_] = parts
            self.sent.append(frame_ if frame_ == b"raw" else p.decode_many(frame_))

    async def go(fast: bool):
        sock = Sock()
        box = Outbox(sock)
        sender = asyncio.create_task(box.run())
        for kind, job, text in puts:
            if kind == "text":
                box.put_text(job, text) if fast else box.put(p.Delta(job=job, text=text))
            elif kind == "parts":
                box.put(p.Delta(job=job, parts=[{"k": "reasoning", "t": text}]))
            elif kind == "done":
                box.put(p.Done(job=job, finish_reason="stop"))
            else:
                box.put(b"raw")
        await box.flush(5)
        sender.cancel()
        return sock.sent

    assert asyncio.run(go(True)) == asyncio.run(go(False))


@given(st.text(max_size=40), st.dictionaries(st.text(max_size=8), st.one_of(st.none(), st.integers(-2**63, 2**63 - 1),
                                                                           st.text(), st.lists(st.text(), max_size=3))),
       st.sampled_from(sorted(p.ENDPOINTS)), st.one_of(st.none(), st.dictionaries(st.text(max_size=8), st.text())))
def test_a_submit_frame_made_without_its_message_is_the_same_bytes(job, request, endpoint, headers):
    """encode_submit (once per request, no Submit object) writes what encode(Submit(...)) writes,
    and a worker reads it back as that Submit."""
    frame = p.encode_submit(job, request, endpoint, headers)
    assert frame == p.encode(p.Submit(job=job, request=request, endpoint=endpoint, headers=headers or {}))
    assert p.decode(frame) == p.Submit(job=job, request=request, endpoint=endpoint, headers=headers or {})
