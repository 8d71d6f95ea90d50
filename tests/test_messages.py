"""Anthropic's Messages API (/v1/messages) on the same pipeline as the OpenAI surface:
the translation both ways (pure tests), then the unmodified `anthropic` SDK against real
pools: the synthetic runtime, an OpenAI-compatible runtime scripted to call tools and
think (openai_remote), and llama-server on the tiny GGUF against the same llama-server
answering /v1/messages itself."""

from __future__ import annotations

import asyncio
import json
import re
import socket

import anthropic
import pytest
from starlette.datastructures import Headers

from protocol import Delta, Done, decode
from protocol.errors import ErrorCode, PoolError
from runtime_worker.anthropic_relay import relay_messages
from runtime_worker.backends.base import Finished, TextDelta
from runtime_worker.native_server import OpenAIClient
from supervisor.shapes import anthropic as ashapes
from supervisor.config import ModelConfig
from supervisor.edge.schemas import request_body
from supervisor.edge.streams import sse_frame
from supervisor.scheduling.jobs import Job
from supervisor.models.capabilities import forwarded_headers
from supervisor.admission.prompt_bounds import check_prompt_bounds
from tests.conftest import llama, synthetic
from tests.test_cli import cli, table_rows
from testkit.llama import direct_llama_server
from tests.pool import Pool, wait_for
from tests.scripted_openai import ScriptedHandler, serve, sse_chunks

JSON = "application/json"
TOOLS = [{"name": "get_weather", "description": "weather of a city",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]


def translated(body: dict) -> dict:
    req, data = request_body(json.dumps(body).encode(), JSON, ashapes.MessagesRequest)
    return ashapes.job_request_from_messages(req, data)


# -- the translation ---------------------------------------------------------------------------------------
def test_a_conversation_with_tools_becomes_a_chat_request():
    sent = translated({
        "model": "m", "max_tokens": 50, "system": [{"type": "text", "text": "be brief"}],
        "temperature": 0.5, "top_k": 3, "stop_sequences": ["END"], "metadata": {"user_id": "u-1"},
        "tools": TOOLS, "tool_choice": {"type": "any", "disable_parallel_tool_use": True}, "seed": 7,
        "service_tier": "auto",
        "messages": [
            {"role": "user", "content": "weather in Oslo?"},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "x"},
                                              {"type": "text", "text": "Checking."},
                                              {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                               "input": {"city": "Oslo"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "rain"},
                                         {"type": "text", "text": "and tomorrow?"}]}]})
    assert sent == {
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "weather in Oslo?"},
            {"role": "assistant", "content": "Checking.", "reasoning_content": "hm", "tool_calls": [
                {"id": "toolu_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'}}]},
            {"role": "tool", "tool_call_id": "toolu_1", "content": "rain"},
            {"role": "user", "content": "and tomorrow?"}],
        "max_tokens": 50, "temperature": 0.5, "top_k": 3, "stop": ["END"], "user": "u-1",
        "tools": [{"type": "function", "function": {"name": "get_weather", "description": "weather of a city",
                                                    "parameters": TOOLS[0]["input_schema"]}}],
        "tool_choice": "required", "parallel_tool_calls": False, "seed": 7}  # service_tier: Anthropic's own


def test_images_become_image_parts():
    sent = translated({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is it?"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}},
        {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}]}]})
    assert sent["messages"][0]["content"] == [
        {"type": "text", "text": "what is it?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]


@pytest.mark.parametrize("body, param", [
    ({"messages": [{"role": "user", "content": "x"}]}, "max_tokens"),  # required in this API
    ({"max_tokens": 5, "messages": [{"role": "tool", "content": "x"}]}, "messages.0.role"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "document"}]}]}, "messages.0.content.0"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "web_search_20250305",
                                                                                   "name": "w"}]}, "tools.0.type"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "sometimes"}},
     "tool_choice.type"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "temperature": 1.5}, "temperature"),
    ({"max_tokens": 5, "messages": []}, "messages"),
])
def test_what_cannot_be_honoured_is_a_400_naming_it(body, param):
    with pytest.raises(PoolError) as refused:
        translated({"model": "m", **body})
    assert refused.value.status == 400 and refused.value.param == param


def test_a_stream_opens_and_closes_each_block_in_order():
    req, _ = request_body(b'{"model": "m", "max_tokens": 9, "messages": [{"role": "user", "content": "x"}]}',
                          JSON, ashapes.MessagesRequest)
    stream = ashapes.MessagesStream(req)
    events = stream.opening()
    events += stream.delta(Delta(job="j", text="", parts=[{"k": "reasoning", "i": 0, "t": "hm"}]))
    events += stream.delta(Delta(job="j", text="Hi"))
    events += stream.delta(Delta(job="j", text="", parts=[{"k": "tool", "i": 0, "n": 0, "id": "c1",
                                                          "name": "get_weather", "args": '{"city":'},
                                                         {"k": "tool", "i": 0, "n": 0, "args": '"Oslo"}'}]))
    events += stream.closing(Done(job="j", finish_reason="tool_calls", usage={"input_tokens": 3,
                                                                             "output_tokens": 4}))
    shown = [(e["event"], json.loads(e["data"])) for e in events]
    kinds = [(name, data.get("delta", {}).get("type") or (data.get("content_block") or {}).get("type"))
             for name, data in shown]
    assert kinds == [
        ("message_start", None),
        ("content_block_start", "thinking"), ("content_block_delta", "thinking_delta"),
        ("content_block_delta", "signature_delta"), ("content_block_stop", None),
        ("content_block_start", "text"), ("content_block_delta", "text_delta"), ("content_block_stop", None),
        ("content_block_start", "tool_use"), ("content_block_delta", "input_json_delta"),
        ("content_block_delta", "input_json_delta"), ("content_block_stop", None),
        ("message_delta", None), ("message_stop", None)]
    assert [d["index"] for n, d in shown if n.startswith("content_block")] == [0, 0, 0, 0, 1, 1, 1, 2, 2, 2, 2]
    assert shown[-2][1]["delta"]["stop_reason"] == "tool_use" and shown[-2][1]["usage"]["output_tokens"] == 4


def test_the_text_fast_path_writes_what_the_general_one_does():
    """MessagesStream.text_sse (plain text deltas, the token path) against delta() + frames, with a
    text block to open, one open, and one to reopen after a thinking block."""
    req, _ = request_body(b'{"model": "m", "max_tokens": 9, "messages": [{"role": "user", "content": "x"}]}',
                          JSON, ashapes.MessagesRequest)
    fast, general = ashapes.MessagesStream(req), ashapes.MessagesStream(req)
    steps = [Delta(job="j", text="Hi"), Delta(job="j", text=' "there" \u00e9\n'),
             Delta(job="j", parts=[{"k": "reasoning", "t": "hm"}]), Delta(job="j", text="back \U0001f600")]
    for delta in steps:
        wanted = b"".join(sse_frame(e) for e in general.delta(delta))
        got = fast.text_sse(delta.text) if delta.text else b"".join(sse_frame(e) for e in fast.delta(delta))
        assert got == wanted


def test_errors_take_anthropics_envelope_and_types():
    for code, status, kind in [(ErrorCode.INVALID_REQUEST, 400, "invalid_request_error"),
                               (ErrorCode.INVALID_API_KEY, 401, "authentication_error"),
                               (ErrorCode.MODEL_NOT_FOUND, 404, "not_found_error"),
                               (ErrorCode.RATE_LIMIT_EXCEEDED, 429, "rate_limit_error"),
                               (ErrorCode.QUEUE_FULL, 529, "overloaded_error"),
                               (ErrorCode.NO_HEALTHY_REPLICA, 529, "overloaded_error"),
                               (ErrorCode.RUNTIME_CRASHED, 502, "api_error")]:
        got_status, body = ashapes.error_envelope(PoolError(code, "why"))
        assert (got_status, body) == (status, {"type": "error", "error": {"type": kind, "message": "why"}})


# -- real clients, real runtimes ------------------------------------------------------------------------------
class ToolRuntime(ScriptedHandler):
    """Thinks, says a word, then calls a tool; answers a tool result with plain text."""
    bodies: list[dict] = []

    def answer(self, body: dict) -> tuple[int, str, str]:
        usage = {"prompt_tokens": 12, "completion_tokens": 5, "total_tokens": 17}
        if body["messages"][-1]["role"] == "tool":
            return 200, "text/event-stream", sse_chunks(
                [{"index": 0, "delta": {"role": "assistant", "content": "Rain in Oslo."}},
                 {"index": 0, "delta": {}, "finish_reason": "stop"}], usage)
        return 200, "text/event-stream", sse_chunks([
            {"index": 0, "delta": {"role": "assistant", "content": None, "reasoning_content": "need weather"}},
            {"index": 0, "delta": {"content": "Checking."}},
            {"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "call_9", "type": "function",
                                                    "function": {"name": "get_weather", "arguments": "{\"city\":"}}]}},
            {"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": "\"Oslo\"}"}}]}},
            {"index": 0, "delta": {}, "finish_reason": "tool_calls"}], usage)


@pytest.fixture(scope="module")
def scripted():
    with serve(ToolRuntime) as server:
        yield server


@pytest.fixture(scope="module")
def pool(scripted, tmp_path_factory):
    p = Pool(tmp_path_factory.mktemp("messages"), [
        synthetic("syn", tokens=6),
        {"name": "scripted", "backend": "openai_remote", "target_inflight": 2,
         "options": {"base_url": scripted.url + "/v1", "model": "upstream"}},
        synthetic("cold", load_on_start=False, load_on_demand=False),
        synthetic("full", ttft_ms=60_000, max_queue=0, request_timeout_s=120)])
    p.start()
    yield p
    p.stop()


@pytest.fixture
def client(pool):
    return anthropic.Anthropic(base_url=pool.url, api_key="unused", max_retries=0)


def test_the_sdk_creates_and_streams_a_message(client):
    whole = client.messages.create(model="syn", max_tokens=100, messages=[{"role": "user", "content": "hello"}])
    assert whole.type == "message" and whole.role == "assistant" and whole.model == "syn"
    assert whole.stop_reason == "end_turn" and whole.usage.output_tokens == 6
    text = whole.content[0].text
    assert len(text.split()) == 6

    short = client.messages.create(model="syn", max_tokens=2, messages=[{"role": "user", "content": "hello"}])
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 2

    with client.messages.stream(model="syn", max_tokens=100, messages=[{"role": "user", "content": "hello"}]) as s:
        streamed = "".join(s.text_stream)
        final = s.get_final_message()
    assert streamed == text == final.content[0].text and final.stop_reason == "end_turn"


def test_a_tool_round_trip_through_an_openai_compatible_runtime(client, scripted):
    scripted.bodies.clear()
    ask = dict(model="scripted", max_tokens=64, tools=TOOLS, messages=[{"role": "user", "content": "weather?"}])
    with client.messages.stream(**ask) as s:
        kinds = [event.type for event in s]
        first = s.get_final_message()
    assert "input_json" in kinds and "thinking" in kinds  # the SDK's own events for the deltas
    assert [b.type for b in first.content] == ["thinking", "text", "tool_use"]
    call = first.content[2]
    assert call.name == "get_weather" and call.input == {"city": "Oslo"} and first.stop_reason == "tool_use"
    assert scripted.bodies[-1]["tools"][0]["function"]["parameters"] == TOOLS[0]["input_schema"]

    second = client.messages.create(**{**ask, "messages": [
        *ask["messages"], {"role": "assistant", "content": [b.model_dump() for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "rain"}]}]})
    assert second.content[0].text == "Rain in Oslo." and second.stop_reason == "end_turn"
    sent = scripted.bodies[-1]["messages"]
    assert sent[-1] == {"role": "tool", "tool_call_id": call.id, "content": "rain"}
    assert sent[-2]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city":"Oslo"}'}
    assert sent[-2]["reasoning_content"] == "need weather"


def test_errors_reach_the_sdk_as_its_own_types(client, pool):
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.create(model="nope", max_tokens=5, messages=[{"role": "user", "content": "x"}])
    assert missing.value.body["error"]["type"] == "not_found_error"
    assert missing.value.response.headers.get("request-id")
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(model="syn", max_tokens=5, messages=[{"role": "user", "content": [
            {"type": "document", "source": {}}]}])
    assert bad.value.body["error"]["type"] == "invalid_request_error" and "document" in bad.value.message
    body = json.dumps({"model": "full", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}).encode()
    with socket.create_connection(("127.0.0.1", pool.port), timeout=10) as holder:  # takes the one slot
        holder.sendall(b"POST /v1/messages HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
                       b"content-length: %d\r\n\r\n%s" % (len(body), body))
        wait_for(lambda: pool.model("full")["runtime_inflight"] == 1, 10, what="the slot taken")
        with pytest.raises(anthropic.APIStatusError) as busy:  # a queue with no room: the API's "overloaded"
            client.messages.create(model="full", max_tokens=5, messages=[{"role": "user", "content": "x"}])
    assert busy.value.status_code == 529 and busy.value.body["error"]["type"] == "overloaded_error"
    assert busy.value.response.headers.get("retry-after")
    # the OpenAI surface keeps its own envelope
    r = pool.http.post("/v1/chat/completions", json={"model": "nope", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_keys_as_x_api_key_and_the_models_list(make_pool):
    pool = make_pool([synthetic("syn", tokens=3), synthetic("other", tokens=3)],
                     server={"admin_key": "sk-admin"}, tenants=[{"name": "team", "keys": ["sk-team"]}])
    with pytest.raises(anthropic.AuthenticationError) as refused:
        anthropic.Anthropic(base_url=pool.url, api_key="sk-wrong", max_retries=0).messages.create(
            model="syn", max_tokens=5, messages=[{"role": "user", "content": "x"}])
    assert refused.value.body["error"]["type"] == "authentication_error"
    client = anthropic.Anthropic(base_url=pool.url, api_key="sk-team", max_retries=0)
    assert client.messages.create(model="syn", max_tokens=5, messages=[{"role": "user", "content": "x"}]).content
    page = client.models.list(limit=1)
    assert [m.id for m in page.data] == ["syn"] and page.has_more and page.data[0].type == "model"
    assert page.data[0].max_input_tokens is None  # the synthetic runtime reports no context window
    assert [m.id for m in client.models.list()] == ["syn", "other"]  # the SDK pages on by after_id


# -- pool against llama-server answering /v1/messages itself --------------------------------------------------
@pytest.mark.llama
def test_pool_and_direct_llama_server_give_the_same_message(llama_server_bin, tiny_gguf, tmp_path, make_pool):
    with direct_llama_server(llama_server_bin, tiny_gguf, ["-c", "4096", "-np", "1"], tmp_path / "direct.log") as url:
        pool = make_pool([llama("tiny", tiny_gguf, llama_server_bin, ctx=4096)])
        ask = dict(model="tiny", max_tokens=12, messages=[{"role": "user", "content": "hi"}],
                   extra_body={"temperature": 0})  # greedy (this SDK release takes no temperature argument)
        direct = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0).messages.create(**ask)
        pooled_client = anthropic.Anthropic(base_url=pool.url, api_key="unused", max_retries=0)
        pooled = pooled_client.messages.create(**ask)
        # the model page gives the context window the pool knows (llama-server's context per slot)
        assert [(m.id, m.max_input_tokens) for m in pooled_client.models.list()] == [("tiny", 4096)]
    assert [b.type for b in pooled.content] == [b.type for b in direct.content]
    assert pooled.content[0].text == direct.content[0].text
    assert pooled.stop_reason == direct.stop_reason == "max_tokens"
    assert pooled.usage.output_tokens == direct.usage.output_tokens == 12
    assert pooled.usage.input_tokens == direct.usage.input_tokens
    assert pooled.model == "tiny"  # direct names its model file there


# -- context windows a client can act on ------------------------------------------------------------------------
def test_a_runtimes_context_refusal_is_worded_for_each_family():
    from runtime_worker.upstream import upstream_error
    llama_says = json.dumps({"error": {"code": 400, "type": "exceed_context_size_error", "n_prompt_tokens": 1852,
                                       "n_ctx": 256, "message": "request (1852 tokens) exceeds the available "
                                                                "context size (256 tokens), try increasing it"}})
    vllm_says = json.dumps({"object": "error", "message": "This model's maximum context length is 2048 tokens. "
                            "However, you requested 3000 tokens (2990 in the messages, 10 in the completion). "
                            "Please reduce the length of the messages or completion.", "code": 400})
    for text, n, m in [(llama_says, 1852, 256), (vllm_says, 3000, 2048)]:
        err = upstream_error(400, text)
        assert err.code == ErrorCode.CONTEXT_LENGTH_EXCEEDED
        assert err.message == (f"This model's maximum context length is {m} tokens. However, your messages "
                               f"resulted in {n} tokens. Please reduce the length of the messages.")
        status, body = ashapes.error_envelope(PoolError(ErrorCode(err.code), err.message))
        assert (status, body["error"]) == (400, {"type": "invalid_request_error",
                                                 "message": f"prompt is too long: {n} tokens > {m} maximum"})
    assert upstream_error(400, '{"error": {"message": "bad tool schema"}}').code == ErrorCode.INVALID_REQUEST


@pytest.mark.llama
def test_a_prompt_over_the_context_gets_each_familys_words(llama_server_bin, tiny_gguf, make_pool):
    import openai
    pool = make_pool([llama("tiny", tiny_gguf, llama_server_bin, ctx=256)])
    listed = {m["id"]: m for m in pool.http.get("/v1/models").json()["data"]}
    assert listed["tiny"]["context_length"] == listed["tiny"]["max_model_len"] == 256
    assert pool.model("tiny")["context_length"] == 256
    shown = cli("models", "-o", "wide", url=pool.url)
    assert {r["NAME"]: r for r in table_rows(shown.stdout)}["tiny"]["CONTEXT"] == "256", shown.stdout
    long = "hello " * 300
    with pytest.raises(openai.BadRequestError) as openai_refused:
        openai.OpenAI(base_url=pool.url + "/v1", api_key="unused", max_retries=0).chat.completions.create(
            model="tiny", max_tokens=5, messages=[{"role": "user", "content": long}])
    assert openai_refused.value.code == "context_length_exceeded"
    assert re.fullmatch(r"This model's maximum context length is 256 tokens\. However, your messages resulted in "
                        r"\d+ tokens\. Please reduce the length of the messages\.", openai_refused.value.body["message"])
    with pytest.raises(anthropic.BadRequestError) as anthropic_refused:
        anthropic.Anthropic(base_url=pool.url, api_key="unused", max_retries=0).messages.create(
            model="tiny", max_tokens=5, messages=[{"role": "user", "content": long}])
    assert re.fullmatch(r"prompt is too long: \d+ tokens > 256 maximum", anthropic_refused.value.body["error"]["message"])


# -- affinity: a session's requests on one replica, and a per-request stamp that moves nothing --------------
STAMPED = "x-anthropic-billing-header: cc_version=2.1.37.0d9; cc_entrypoint=cli; cch={};\nYou are a coding agent."


def test_claude_codes_per_request_stamp_is_made_constant():
    chats = [translated({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}],
                         "system": [{"type": "text", "text": STAMPED.format(cch)}, {"type": "text", "text": "Be brief."}]})
             for cch in ("fa690", "0aaa9")]
    assert chats[0] == chats[1]
    assert chats[0]["messages"][0]["content"] == STAMPED.format("fffff") + "\nBe brief."
    plain = "a system prompt that says cch=12345; as text"
    assert translated({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}],
                       "system": plain})["messages"][0]["content"] == plain


def test_a_session_header_and_a_stamped_prompt_keep_to_one_replica(make_pool):
    """routing = "session": Claude Code's X-Claude-Code-Session-Id is the key (its stamp changing
    on every request); routing = "prefix": the stamped system prompt still matches its prefix."""
    pool = make_pool([synthetic("s", replicas=3, routing="session"),
                      synthetic("p", replicas=3, routing="prefix")])
    long_system = STAMPED + " Follow the house rules. " * 40  # several prefix blocks
    for n in range(6):
        for model, headers in (("s", {"X-Claude-Code-Session-Id": "9b2c"}), ("p", {})):
            client = anthropic.Anthropic(base_url=pool.url, api_key="unused", max_retries=0,
                                         default_headers=headers)
            client.messages.create(model=model, max_tokens=3, system=long_system.format(f"{n:05x}"),
                                   messages=[{"role": "user", "content": f"turn {n}"}])
    by_model = {}
    for w in pool.workers():
        by_model.setdefault(w["model"], []).append(w["routing"]["decisions"])
    assert sorted(d["session"] for d in by_model["s"]) == [0, 0, 6]
    # the first request had no cache anywhere; each later one found its prefix on that replica
    assert sorted(d["prefix_hit"] for d in by_model["p"]) == [0, 0, 5]


@pytest.mark.llama
def test_llama_servers_own_messages_route_through_the_pool(llama_server_bin, tiny_gguf, tmp_path, make_pool):
    """llama_server models take /v1/messages on llama-server's own route: the same blocks and
    text streamed (deltas that were ready together go out as one), the same stop reason and
    usage with its cache reads, and the stop sequence it matched, which a chat answer cannot tell."""
    def events(base_url: str, **ask) -> tuple[list, dict]:
        client = anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0)
        with client.messages.stream(**ask) as stream:
            kinds = [e.type for e in stream if e.type not in ("content_block_delta", "text")]
            final = stream.get_final_message().model_dump(exclude={"id", "model"})
        return kinds, final

    ask = dict(model="tiny", max_tokens=8, messages=[{"role": "user", "content": "hi"}],
               extra_body={"temperature": 0})
    with direct_llama_server(llama_server_bin, tiny_gguf, ["-c", "4096", "-np", "1"], tmp_path / "direct.log") as url:
        pool = make_pool([llama("tiny", tiny_gguf, llama_server_bin, ctx=4096)])
        (direct_kinds, direct), (pooled_kinds, pooled) = events(url, **ask), events(pool.url, **ask)
        assert pooled_kinds == direct_kinds and pooled_kinds[0] == "message_start"
        assert pooled["content"] == direct["content"] and pooled["content"][0]["text"]
        assert pooled["stop_reason"] == direct["stop_reason"] == "max_tokens"
        assert pooled["usage"]["input_tokens"] == direct["usage"]["input_tokens"] > 0
        stop = dict(ask, max_tokens=60, stop_sequences=["\n\n"])  # the tiny model writes newlines
        said = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0).messages.create(**stop)
        got = anthropic.Anthropic(base_url=pool.url, api_key="unused", max_retries=0).messages.create(**stop)
    assert said.stop_sequence == got.stop_sequence == "\n\n"
    assert got.stop_reason == "stop_sequence"  # llama-server says end_turn; the API's reason is stop_sequence
    assert (got.usage.input_tokens, got.usage.output_tokens) == (said.usage.input_tokens, said.usage.output_tokens)
    assert got.usage.cache_read_input_tokens == said.usage.cache_read_input_tokens
    assert got.model == "tiny"


def test_a_messages_fallback_of_another_backend_gets_its_own_way(llama_server_bin, tmp_path, make_pool):
    """A llama_server model would take the body on llama-server's own route; its load failed,
    so its fallback (synthetic) serves, by the translation to chat: each model its own way."""
    ghost = llama("ghost", str(tmp_path / "missing.gguf"), llama_server_bin)
    ghost["fallbacks"] = ["syn"]
    pool = make_pool([synthetic("syn", tokens=8), ghost], wait_ready=False)
    wait_for(lambda: pool.http.get("/ready").status_code == 200, timeout=60, what="ready")
    client = anthropic.Anthropic(base_url=pool.url, api_key="unused", max_retries=0)
    raw = client.messages.with_raw_response.create(model="ghost", max_tokens=4,
                                                   messages=[{"role": "user", "content": "hi"}])
    answer = raw.parse()
    assert raw.headers["x-llm-pool-served-by"] == "syn" and answer.model == "syn"
    assert answer.stop_reason == "max_tokens" and answer.usage.output_tokens == 4


def test_a_runtimes_own_route_gets_the_clients_anthropic_headers():
    """anthropic-version and anthropic-beta reach the runtime's own /v1/messages as the client
    sent them, and nothing else of the client's does: what admission forwards
    (capabilities.forwarded_headers, a header on two lines comma-joined) travels in the job's
    frame (Submit.headers) and the worker's relay sends it. The runtime here is scripted:
    neither llama-server nor vLLM reads these headers, so neither can show that they arrived."""
    class Messages(ScriptedHandler):
        bodies: list[dict] = []
        seen: list[dict] = []

        def answer(self, body):
            type(self).seen.append({k.lower(): v for k, v in self.headers.items()})
            events = [{"type": "message_start", "message": {"usage": {"input_tokens": 3, "output_tokens": 0}}},
                      {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "hi"}},
                      {"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 1}},
                      {"type": "message_stop"}]
            return 200, "text/event-stream", "".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n" for e in events)

    client_headers = {"anthropic-version": "2023-06-01", "anthropic-beta": "fine-grained-tool-streaming-2025-05-14",
                      "x-api-key": "sk-secret", "x-claude-code-session-id": "s1"}
    assert forwarded_headers("chat", client_headers) is None  # only a runtime's own Anthropic routes get them
    two_lines = Headers(raw=[(b"anthropic-beta", b"a-1"), (b"anthropic-beta", b"b-2"), (b"x-other", b"x")])
    assert forwarded_headers("count_tokens", two_lines) == {"anthropic-beta": "a-1, b-2"}
    assert forwarded_headers("messages", {"anthropic-beta": "x" * 2000}) is None  # left out whole, never cut
    job = Job("m", {"max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}, 60, endpoint="messages",
              headers=forwarded_headers("messages", client_headers))
    submit = decode(job.frame)
    assert submit.headers == {"anthropic-version": "2023-06-01",
                              "anthropic-beta": "fine-grained-tool-streaming-2025-05-14"}

    async def relay(url: str) -> list:
        client = OpenAIClient(url + "/v1", None)
        try:
            return [e async for e in relay_messages(client, submit.request, submit.headers)]
        finally:
            await client.aclose()

    with serve(Messages) as runtime:
        events = asyncio.run(relay(runtime.url))
    assert [e.text for e in events if isinstance(e, TextDelta)] == ["hi"]
    assert isinstance(events[-1], Finished) and events[-1].input_tokens == 3
    [seen] = Messages.seen
    assert seen["anthropic-version"] == "2023-06-01" and seen["anthropic-beta"].startswith("fine-grained")
    assert "x-api-key" not in seen and "x-claude-code-session-id" not in seen


def test_max_prompt_chars_counts_every_anthropic_block_with_text():
    """A native Messages body goes to the runtime as sent: the prompt bound counts the text in a
    tool_result's content (a string or blocks) and a thinking block's thinking, not only `text`."""
    cfg = ModelConfig(name="m", backend="synthetic", max_prompt_chars=100)
    long = "x" * 101
    for content in ([{"type": "tool_result", "tool_use_id": "t", "content": long}],
                    [{"type": "tool_result", "tool_use_id": "t", "content": [{"type": "text", "text": long}]}],
                    [{"type": "thinking", "thinking": long, "signature": ""}]):
        with pytest.raises(PoolError) as refused:
            check_prompt_bounds(cfg, {"messages": [{"role": "user", "content": content}]})
        assert "max_prompt_chars" in refused.value.message
    check_prompt_bounds(cfg, {"messages": [{"role": "user", "content": [{"type": "thinking", "thinking": "x" * 100}]}]})
