"""Unit tests of the SSE shapes' fast path for plain text tokens, and of what one job may hold."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from protocol import Delta
from supervisor.edge.streams import sse_frame
from supervisor.shapes.openai import ChatStream, CompletionStream


@given(st.text())
def test_text_sse_is_the_chunk_sse_frame_gives(text):
    """The token path builds a plain text chunk's bytes directly: byte for byte
    what the generic path (a chunk dict through sse_frame) gives, escapes too."""
    for shape in (ChatStream("m", False), CompletionStream("m", True)):
        assert shape.text_sse(text) == sse_frame(shape.chunk({"content": text}))


# -- what a job may hold (issue 22): choice indexes below its n, output within its budget ------------

def _job(max_output_bytes: int = 10_000, **request):
    from supervisor.scheduling.jobs import Job
    return Job("m", {"messages": [{"role": "user", "content": "hi"}], **request}, 60,
               max_output_bytes=max_output_bytes)


def _codes(job) -> list:
    return [getattr(e, "code", None) and e.code.value for e in job.events]


def test_a_choice_index_at_or_past_n_ends_the_job_and_keeps_nothing_of_it():
    from protocol import Delta, Done
    job = _job(n=2)
    job.push(Delta(job=job.id, parts=[{"k": "text", "i": 1, "t": "a"}]))
    job.push(Delta(job=job.id, parts=[{"k": "text", "i": 3_000_000, "t": "b"}]))
    assert job.state.value == "finished" and _codes(job) == [None, "protocol_error"]
    job.push(Delta(job=job.id, text="late"))  # after the end: dropped, not held
    assert len(job.events) == 2
    done = _job(n=2)
    done.finish(Done(job=done.id, finish_reason="stop", finish_reasons=["stop"] * 3))
    assert _codes(done) == ["protocol_error"]


def test_output_past_the_budget_ends_the_job_whatever_carries_it():
    from protocol import Delta
    from supervisor.scheduling.jobs import output_size
    text = _job()
    for _ in range(9):
        text.push(Delta(job=text.id, text="x" * 1000))
    text.push(Delta(job=text.id, text="x" * 1001))
    assert _codes(text)[-1] == "runtime_error" and len(text.events) == 10
    lp = [{"token": "w", "logprob": -0.1, "bytes": [119],
           "top_logprobs": [{"token": f"t{i}", "logprob": -1.0, "bytes": [116]} for i in range(500)]}]
    delta = Delta(job="j", parts=[{"k": "text", "i": 0, "t": "w", "lp": lp}])
    assert output_size(delta) >= len(json.dumps(lp)) // 2  # logprobs count about as they weigh
    logprobs = _job()
    logprobs.push(delta)
    assert _codes(logprobs) == ["runtime_error"]


def test_loop_lag_is_measured_against_the_asked_wake_time_and_warned_past_a_second(caplog):
    import asyncio

    from supervisor.telemetry.loop_lag import LoopLag
    seen: list[float] = []
    now = [100.0]

    async def main():
        lag = LoopLag(seen.append, period_s=0.01, clock=lambda: now[0])
        lag.start()
        now[0] += 0.01  # on time
        await asyncio.sleep(0.05)
        now[0] += 2.51  # as if the loop had been held 2.5 s past the period
        await asyncio.sleep(0.05)
        await lag.close()
    asyncio.run(main())
    assert 0 in seen and 2.49 < max(seen) < 2.51 and min(seen) >= 0
    assert "the event loop was blocked for 2.50s" in caplog.text


# -- output limits (issue 33): bounded where the fields are declared, named in the 400 ----------------

def test_output_limits_over_the_cap_are_a_400_naming_the_field():
    from protocol.errors import PoolError
    from supervisor.edge.schemas import request_body
    from supervisor.shapes.openai import MAX_OUTPUT_TOKENS, ChatRequest, CompletionRequest
    from supervisor.shapes.responses import ResponsesRequest
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    cases = [(ChatRequest, chat, "max_tokens"), (ChatRequest, chat, "max_completion_tokens"),
             (CompletionRequest, {"model": "m", "prompt": "hi"}, "max_tokens"),
             (ResponsesRequest, {"model": "m", "input": "hi"}, "max_output_tokens")]
    for shape, body, field in cases:
        body, data = request_body(json.dumps({**body, field: MAX_OUTPUT_TOKENS}).encode(), "application/json", shape)
        assert getattr(body, field) == MAX_OUTPUT_TOKENS
        for value in (MAX_OUTPUT_TOKENS + 1, 10**18, 10**30):
            with pytest.raises(PoolError) as refused:
                request_body(json.dumps({**data, field: value}).encode(), "application/json", shape)
            assert refused.value.code.value == "invalid_request" and refused.value.param == field


# -- a runtime's framing relayed (issue 38): its opening, its own fields, where its usage goes ------------

def _data(events: list[dict]) -> list:
    return [json.loads(e["data"]) if e["data"] != "[DONE]" else "[DONE]" for e in events]


def test_a_chat_stream_frames_its_chunks_as_the_runtime_did():
    from protocol import Delta, Done
    shape = ChatStream("m", include_usage=False)
    progress = {"prompt_progress": {"total": 9, "cache": 0, "processed": 9}}
    first = Delta(job="j", parts=[{"k": "open", "i": 0, "d": {"content": None}}, {"k": "extra", "x": progress},
                                  {"k": "open", "i": 0, "d": {"content": None}}, {"k": "text", "i": 0, "t": "a"},
                                  {"k": "extra", "x": {"timings": {"predicted_n": 1}, "id": "not-the-pool's"}},
                                  {"k": "open", "i": 1, "d": {}}, {"k": "reasoning", "i": 1, "t": "r"}])
    assert shape.opening(first) == []  # the runtime's own opening comes with its output
    chunks = _data(shape.delta(first))
    assert [c["choices"][0]["delta"] for c in chunks] == [
        {"role": "assistant", "content": None}, {"role": "assistant", "content": None}, {"content": "a"},
        {"role": "assistant", "reasoning_content": "r"}]  # an opening without a clash joins its output
    assert chunks[0]["prompt_progress"] == progress["prompt_progress"] and "prompt_progress" not in chunks[1]
    assert chunks[2]["timings"] == {"predicted_n": 1} and chunks[2]["id"] == shape.id  # the pool's id stays
    head = {k: chunks[0][k] for k in ("id", "object", "created", "model")}
    alone = _data(shape.delta(Delta(job="j", parts=[{"k": "text", "i": 0, "t": "b"},
                                                    {"k": "extra", "x": {"note": 1}, "alone": True}])))
    assert alone[1] == {**head, "choices": [], "note": 1} and "note" not in alone[0]  # a chunk of their own
    end = _data(shape.closing(Done(job="j", finish_reason="stop", finish_reasons=["stop", "length"],
                                   usage={"input_tokens": 2, "output_tokens": 1, "cached_tokens": 0},
                                   extra={"timings": {"predicted_n": 2}})))
    assert [c["choices"] for c in end[:2]] == [
        [{"index": 0, "delta": {}, "finish_reason": "stop", "logprobs": None}],
        [{"index": 1, "delta": {}, "finish_reason": "length", "logprobs": None}]]
    assert "timings" not in end[0] and end[1]["timings"] == {"predicted_n": 2} and "usage" not in end[1]
    assert end[2] == "[DONE]"
    # no opening from the runtime (synthetic, exllamav3): OpenAI's
    assert _data(ChatStream("m", False).opening(Delta(job="j", text="a")))[0]["choices"][0]["delta"] == {
        "role": "assistant", "content": ""}


def test_usage_goes_where_the_runtime_put_it():
    from protocol import Done
    done = Done(job="j", finish_reason="length", usage={"input_tokens": 2, "output_tokens": 1, "cached_tokens": 0},
                extra={"timings": {}}, usage_on_finish=True)
    usage = {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3, "prompt_tokens_details": {"cached_tokens": 0}}
    for include_usage in (False, True):  # llama-server's legacy stream: on its finish chunk, asked or not
        *chunks, end = _data(CompletionStream("m", include_usage).closing(done))
        assert end == "[DONE]" and len(chunks) == 1 and chunks[0]["usage"] == usage
        assert chunks[0]["choices"][0]["finish_reason"] == "length" and chunks[0]["timings"] == {}
    chunks = _data(ChatStream("m", True).closing(Done(job="j", finish_reason="stop",
                                                      usage={"input_tokens": 2, "output_tokens": 1})))
    assert chunks[-2]["choices"] == [] and "prompt_tokens_details" not in chunks[-2]["usage"]  # not said: absent


def test_responses_and_messages_streams_place_or_leave_the_runtimes_fields():
    from protocol import Delta, Done
    from supervisor.shapes.anthropic import MessagesRequest, MessagesStream
    from supervisor.shapes.responses import ResponsesRequest, ResponsesStream, job_request_from_responses
    req = ResponsesRequest(model="m", input="x")
    shape = ResponsesStream(req, job_request_from_responses(req, {}))
    shape.opening()
    progress = {"prompt_progress": {"total": 9}}
    events = _data(shape.delta(Delta(job="j", parts=[{"k": "open", "i": 0, "d": {"content": None}},
                                                     {"k": "extra", "x": progress}])))
    assert [(e["type"], e.get("prompt_progress")) for e in events] == [("response.in_progress", {"total": 9})]
    events = _data(shape.delta(Delta(job="j", parts=[{"k": "text", "i": 0, "t": "a"},
                                                     {"k": "extra", "x": {"timings": {"predicted_n": 1}}}])))
    assert events[-1]["type"] == "response.output_text.delta" and events[-1]["timings"] == {"predicted_n": 1}
    assert [e["sequence_number"] for e in events] == sorted(e["sequence_number"] for e in events)
    final = _data(shape.closing(Done(job="j", finish_reason="stop", extra={"timings": {"predicted_n": 2}})))[-1]
    assert final["type"] == "response.completed" and final["timings"] == {"predicted_n": 2}
    # Anthropic's Messages have no such fields (llama-server's own Messages API leaves them out too)
    messages = MessagesStream(MessagesRequest(model="m", max_tokens=5, messages=[{"role": "user", "content": "x"}]))
    messages.opening()
    events = messages.delta(Delta(job="j", parts=[{"k": "open", "i": 0, "d": {"content": None}},
                                                  {"k": "text", "i": 0, "t": "a"}, {"k": "extra", "x": progress}]))
    assert "prompt_progress" not in json.dumps(events) and "text_delta" in json.dumps(events)


def test_a_stream_that_opened_while_waiting_opens_once():
    """A stream whose head went out before the runtime's first output (it waited past
    stream_head_hold_s) opened with OpenAI's first chunk; the runtime's own opening that
    follows is not a second one: one role chunk, then the text."""
    from supervisor.shapes.openai import ChatStream
    stream = ChatStream("m", include_usage=False)
    chunks = stream.opening("waiting") + stream.delta(
        Delta(job="j", parts=[{"k": "open", "d": {"content": None}}, {"k": "text", "t": "hi"}]))
    deltas = [json.loads(c["data"])["choices"][0]["delta"] for c in chunks]
    assert deltas == [{"role": "assistant", "content": ""}, {"content": "hi"}]


# -- Responses bodies mapped onto chat: tools, several text parts, why a response was cut --------------
CODEX_TOOLS = [  # as Codex sends them: function tools, a namespace of sub-agent tools, hosted tools
    {"type": "function", "name": "shell", "parameters": {"type": "object"}, "strict": False},
    {"type": "web_search", "external_web_access": False},
    {"type": "namespace", "name": "agents", "description": "Sub-agents", "tools": [
        {"type": "function", "name": "spawn_agent", "description": "start one", "parameters": {"type": "object"}},
        {"type": "function", "name": "shell", "parameters": {"type": "object"}},
        {"type": "custom", "name": "apply_patch", "format": {"type": "grammar"}}]},
    {"type": "image_generation"}]


def _responses_job(body: dict):
    import msgspec

    from supervisor.shapes.responses import ResponsesRequest, job_request_from_responses
    req = msgspec.convert({"model": "m", **body}, ResponsesRequest)
    return req, job_request_from_responses(req, {"model": "m", **body})


def test_namespace_tools_are_flattened_and_hosted_tools_skipped_and_said():
    history = [{"role": "user", "content": "go"},
               {"type": "function_call", "call_id": "c1", "name": "shell", "namespace": "agents", "arguments": "{}"},
               {"type": "function_call_output", "call_id": "c1", "output": "ok"}]
    _, job = _responses_job({"input": history, "tools": CODEX_TOOLS,
                             "tool_choice": {"type": "function", "name": "spawn_agent", "namespace": "agents"}})
    names = [t["function"]["name"] for t in job.request["tools"]]
    assert names == ["shell", "spawn_agent", "agents__shell"]  # a name another tool holds is qualified
    assert job.request["tools"][1]["function"] == {"name": "spawn_agent", "description": "start one",
                                                   "parameters": {"type": "object"}}
    assert job.tools.skipped_text() == "web_search, custom agents.apply_patch, image_generation"
    assert job.request["messages"][1]["tool_calls"][0]["function"]["name"] == "agents__shell"
    assert job.request["tool_choice"] == {"type": "function", "function": {"name": "spawn_agent"}}
    # the runtime's calls come back naming their namespace, as the client's tools were named
    assert job.tools.call_names("agents__shell") == {"name": "shell", "namespace": "agents"}
    assert job.tools.call_names("spawn_agent") == {"name": "spawn_agent", "namespace": "agents"}
    assert job.tools.call_names("shell") == {"name": "shell"}
    _, only_hosted = _responses_job({"input": "x", "tools": [{"type": "web_search"}, {"type": "file_search"}]})
    assert "tools" not in only_hosted.request and only_hosted.tools.skipped_text() == "web_search, file_search"


def test_a_streamed_namespaced_call_names_its_namespace():
    from protocol import Delta, Done
    from supervisor.shapes.responses import ResponsesStream
    req, job = _responses_job({"input": "x", "tools": CODEX_TOOLS, "stream": True})
    shape = ResponsesStream(req, job)
    shape.opening()
    events = _data(shape.delta(Delta(job="j", parts=[
        {"k": "tool", "i": 0, "n": 0, "id": "call_9", "name": "agents__shell", "args": "{}"}])))
    events += _data(shape.closing(Done(job="j", finish_reason="tool_calls")))
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert [(i["type"], i["name"], i.get("namespace"), i["call_id"]) for i in done] == [
        ("function_call", "shell", "agents", "call_9")]


def test_bad_namespace_tools_are_400s_naming_the_field():
    from protocol.errors import PoolError
    for tools, param in [([{"type": "namespace", "tools": []}], "tools.0.name"),
                         ([{"type": "namespace", "name": "a"}], "tools.0.tools"),
                         ([{"type": "namespace", "name": "a", "tools": [{"type": "function"}]}], "tools.0.tools.0.name"),
                         ([{"type": "function", "name": "f"}, {"type": "function", "name": "f"},
                           {"type": "namespace", "name": "a", "tools": [{"type": "function", "name": "f"},
                                                                        {"type": "function", "name": "f"}]}],
                          "tools.2.tools.1.name")]:
        with pytest.raises(PoolError) as err:
            _responses_job({"input": "x", "tools": tools})
        assert err.value.status == 400 and err.value.param == param, (tools, err.value.message)


@pytest.mark.parametrize("parts,text", [
    (["a", "b"], "a\nb"), (["a", "", "b"], "a\n\nb"), (["", "a"], "a"), (["a", ""], "a\n"), ([""], ""),
    (["Hi", "there"], "Hi\nthere")])
def test_text_parts_join_as_llama_server_joins_them(parts, text):
    _, job = _responses_job({"input": [{"role": "user", "content": [{"type": "input_text", "text": t}
                                                                    for t in parts]}]})
    assert job.request["messages"] == [{"role": "user", "content": text}]


@pytest.mark.parametrize("finish,usage,limit,context,want", [
    ("stop", {}, None, None, ("completed", None)),
    ("content_filter", {}, None, None, ("incomplete", "content_filter")),
    ("length", {"input_tokens": 10, "output_tokens": 5}, 5, 4096, ("incomplete", "max_output_tokens")),
    # no limit asked, and the context filled (llama-server stops one token short of it)
    ("length", {"input_tokens": 3934, "output_tokens": 161}, None, 4096, ("incomplete", "model_context_window_exceeded")),
    ("length", {"input_tokens": 90, "output_tokens": 10}, 500, 100, ("incomplete", "model_context_window_exceeded")),
    # no limit asked, far from the context: the runtime's own output limit
    ("length", {"input_tokens": 10, "output_tokens": 128}, None, 4096, ("incomplete", "max_output_tokens")),
    ("length", {"input_tokens": 10, "output_tokens": 128}, None, None, ("incomplete", "model_context_window_exceeded"))])
def test_the_incomplete_reason_names_what_stopped_the_response(finish, usage, limit, context, want):
    from protocol import Done
    from supervisor.shapes.responses import response_status
    assert response_status(Done(job="j", finish_reason=finish, usage=usage), limit, context) == want
