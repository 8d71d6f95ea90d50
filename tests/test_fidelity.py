"""API fidelity: what the client sends reaches the runtime, what the runtime
answers reaches the client. The same requests go direct to a llama-server
and through the pool (same binary, model, slots and flags, temperature 0) and
must give the same answers; a scripted OpenAI server stands in for a runtime
that emits tool calls, reasoning and several choices; a runtime's 400 stays a
400; a backend without an OpenAI server refuses what it cannot honour."""

from __future__ import annotations

import json

import httpx
import openai
import pydantic
import pytest

from testkit.llama import direct_llama_server
from tests.conftest import IGNORE_EOS, llama, synthetic
from tests.pool import Pool
from tests.scripted_openai import ScriptedHandler, serve, sse_chunks

pytestmark = pytest.mark.llama

# a small batch: a prompt of a few hundred tokens is processed in several steps (return_progress)
LLAMA_FLAGS = ["--embeddings", "--pooling", "mean", "-b", "64", "-ub", "64"]
SLOTS, CTX = 2, 8192
HI = [{"role": "user", "content": "hi"}]


# -- a scripted OpenAI server: tool calls, reasoning, two choices, logprobs -------------------------------
LOGPROB = {"token": "other", "logprob": -0.5, "bytes": [111], "top_logprobs": []}
SCRIPT = [  # streamed choice deltas, as a runtime with a tool-call parser and a reasoning parser sends them
    {"index": 0, "delta": {"role": "assistant", "content": None, "reasoning_content": "think"}},
    {"index": 0, "delta": {"reasoning_content": " more"}},
    {"index": 0, "delta": {"content": "Calling"}},
    {"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                            "function": {"name": "get_weather", "arguments": ""}}]}},
    {"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": "{\"city\":"}}]}},
    {"index": 1, "delta": {"role": "assistant", "content": "other"}, "logprobs": {"content": [LOGPROB]}},
    {"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": "\"Paris\"}"}}]}},
    {"index": 0, "delta": {"tool_calls": [{"index": 1, "id": "call_2", "type": "function",
                                            "function": {"name": "get_time", "arguments": "{}"}}]}},
    {"index": 0, "delta": {}, "finish_reason": "tool_calls"},
    {"index": 1, "delta": {}, "finish_reason": "content_filter"},
]
USAGE = {"prompt_tokens": 7, "completion_tokens": 11, "total_tokens": 18,
         "prompt_tokens_details": {"cached_tokens": 3}, "completion_tokens_details": {"reasoning_tokens": 2}}


class ScriptedRuntime(ScriptedHandler):
    bodies: list[dict] = []

    def answer(self, body: dict) -> tuple[int, str, str]:
        if body.get("messages", [{}])[-1].get("content") == "refuse":
            return 400, "application/json", json.dumps(
                {"error": {"message": "scripted refusal: bad tool schema", "type": "invalid_request_error"}})
        # usage: always in a whole answer, in a stream only when asked for
        usage = USAGE if (body.get("stream_options") or {}).get("include_usage") or not body.get("stream") else None
        if body.get("messages", [{}])[-1].get("content") == "huge extra":  # its own field, over the pool's bound
            chunk = {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m", "x_debug": "d" * (1 << 20),
                     "choices": [{"index": 0, "delta": {"content": "a"}}]}
            return 200, "text/event-stream", f"data: {json.dumps(chunk)}\n\n" + sse_chunks(
                [{"index": 0, "delta": {}, "finish_reason": "stop"}], usage)
        if body.get("messages", [{}])[-1].get("content") == "own fields":  # a runtime's fields of its own
            head = {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m"}
            chunks = [{**head, "x_progress": {"done": 1}, "choices": [{"index": 0, "delta": {"role": "assistant",
                                                                                          "content": ""}}]},
                      {**head, "x_tick": 1, "choices": [{"index": 0, "delta": {"content": "a"}}]},
                      {**head, "choices": [{"index": 0, "delta": {"content": "b"}}]},
                      {**head, "x_note": "alone", "choices": []},
                      {**head, "x_end": {"n": 2}, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}]
            if usage:
                chunks.append({**head, "choices": [], "usage": usage})
            return 200, "text/event-stream", "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        n = body.get("n") or 1  # a runtime answers the choices asked for (the pool refuses others)
        return 200, "text/event-stream", sse_chunks([c for c in SCRIPT if c["index"] < n], usage)


@pytest.fixture(scope="module")
def scripted():
    with serve(ScriptedRuntime) as server:
        yield server


@pytest.fixture(scope="module")
def direct_url(llama_server_bin, tiny_gguf, tmp_path_factory):
    """A llama-server started by the test, with the flags the pool's gets; always killed."""
    log = tmp_path_factory.mktemp("direct") / "llama.log"
    with direct_llama_server(llama_server_bin, tiny_gguf, ["-c", str(CTX), "-np", str(SLOTS), *LLAMA_FLAGS],
                             log) as url:
        yield url


@pytest.fixture(scope="module")
def direct(direct_url):
    return openai.OpenAI(base_url=direct_url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def pool(llama_server_bin, tiny_gguf, scripted, tmp_path_factory):
    models = [llama("tiny", tiny_gguf, llama_server_bin, slots=SLOTS, ctx=CTX, extra_args=LLAMA_FLAGS),
              llama("plain", tiny_gguf, llama_server_bin, ctx=2048),  # no --embeddings
              llama("short", tiny_gguf, llama_server_bin, ctx=256, extra_args=IGNORE_EOS),  # its context fills
              {"name": "scripted", "backend": "openai_remote", "target_inflight": 2,
               "options": {"base_url": scripted.url + "/v1", "model": "upstream-name",
                           "extra_body": {"top_k": 5, "seed": 1}}},
              synthetic("syn", tokens=6)]
    p = Pool(tmp_path_factory.mktemp("fidelity"), models)
    p.start()
    yield p
    p.stop()


@pytest.fixture(scope="module")
def client(pool):
    return openai.OpenAI(base_url=pool.url + "/v1", api_key="unused", max_retries=0)


def choices_of(completion) -> list[dict]:
    """What a client reads of a chat completion's choices (ids and timings aside)."""
    out = []
    for c in sorted(completion.choices, key=lambda c: c.index):
        m = c.message
        out.append({"content": m.content, "finish_reason": c.finish_reason,
                    "reasoning": getattr(m, "reasoning_content", None),
                    "tool_calls": [(t.id, t.function.name, t.function.arguments) for t in m.tool_calls or []],
                    "logprobs": [(t.token, round(t.logprob, 4)) for t in (c.logprobs.content or [])]
                    if c.logprobs else None})
    return out


def streamed_choices(chunks) -> tuple[list[dict], object]:
    """The same, accumulated from streamed chunks the way a client does; and the usage."""
    acc: dict[int, dict] = {}
    usage = None
    for chunk in chunks:
        usage = chunk.usage or usage
        for c in chunk.choices:
            a = acc.setdefault(c.index, {"content": None, "finish_reason": None, "reasoning": None,
                                         "tool_calls": {}, "logprobs": None})
            d = c.delta
            if d.content:
                a["content"] = (a["content"] or "") + d.content
            if getattr(d, "reasoning_content", None):
                a["reasoning"] = (a["reasoning"] or "") + d.reasoning_content
            for t in d.tool_calls or []:
                call = a["tool_calls"].setdefault(t.index, [None, None, ""])
                call[0] = call[0] or t.id
                call[1] = call[1] or (t.function.name if t.function else None)
                call[2] += (t.function.arguments or "") if t.function else ""
            if c.logprobs and c.logprobs.content:
                a["logprobs"] = (a["logprobs"] or []) + [(t.token, round(t.logprob, 4)) for t in c.logprobs.content]
            a["finish_reason"] = c.finish_reason or a["finish_reason"]
    out = []
    for index in sorted(acc):
        a = acc[index]
        a["tool_calls"] = [tuple(a["tool_calls"][k]) for k in sorted(a["tool_calls"])]
        out.append(a)
    return out, usage


# -- equivalence with a real llama-server ---------------------------------------------------------------------

def test_chat_text_logprobs_and_two_choices_match_direct(direct, client):
    ask = dict(messages=HI, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2, n=2)
    want, got = direct.chat.completions.create(model="x", **ask), client.chat.completions.create(model="tiny", **ask)
    assert len(got.choices) == 2 and choices_of(got) == choices_of(want)
    assert choices_of(got)[0]["logprobs"] and got.choices[0].finish_reason == "length"
    assert got.usage.prompt_tokens == want.usage.prompt_tokens

    stream = dict(ask, stream=True, stream_options={"include_usage": True})
    want_s, _ = streamed_choices(direct.chat.completions.create(model="x", **stream))
    got_s, usage = streamed_choices(client.chat.completions.create(model="tiny", **stream))
    assert got_s == want_s and len(got_s) == 2 and got_s[0]["logprobs"]
    assert [c["content"] for c in got_s] == [c["content"] for c in choices_of(want)]
    assert usage.completion_tokens > 0


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=5)
    age: int = pydantic.Field(ge=0, le=99)


def test_json_schema_output_matches_direct_and_parses(direct, client):
    # bounded fields: llama-server's grammar then yields valid JSON even from random weights
    ask = dict(messages=HI, max_tokens=120, temperature=0, response_format=Person)
    want = direct.chat.completions.parse(model="x", **ask)
    got = client.chat.completions.parse(model="tiny", **ask)
    assert got.choices[0].message.content == want.choices[0].message.content
    assert got.choices[0].finish_reason == "stop"
    assert isinstance(got.choices[0].message.parsed, Person)


def test_a_text_cut_inside_a_character_is_what_the_runtime_returns(direct, client):
    """max_tokens ends the answer after a lone lead byte of a 3-byte character
    (the tiny model's byte token 0xE2, id 3 + 0xE2, forced by logit_bias).
    llama-server answers whole with U+FFFD for it; its stream drops it. A
    client that wants the answer whole gets the runtime's whole answer."""
    ask = dict(messages=HI, max_tokens=2, temperature=0, logit_bias={"229": 100})
    want = direct.chat.completions.create(model="m", **ask).choices[0]
    assert "\ufffd" in want.message.content  # the case under test: the runtime's replacement character
    got = client.chat.completions.create(model="tiny", **ask).choices[0]
    assert (got.message.content, got.finish_reason) == (want.message.content, want.finish_reason) == \
        (want.message.content, "length")
    ask = dict(prompt="hi", max_tokens=2, temperature=0, logit_bias={"229": 100})
    want = direct.completions.create(model="m", **ask).choices[0].text
    assert "\ufffd" in want and client.completions.create(model="tiny", **ask).choices[0].text == want


def test_legacy_completion_matches_direct(direct, client):
    ask = dict(prompt="the pool", max_tokens=5, temperature=0)
    want, got = direct.completions.create(model="x", **ask), client.completions.create(model="tiny", **ask)
    assert got.object == "text_completion" and got.model == "tiny"
    assert [(c.text, c.finish_reason) for c in got.choices] == [(c.text, c.finish_reason) for c in want.choices]
    chunks = list(client.completions.create(model="tiny", stream=True, stream_options={"include_usage": True},
                                            **ask))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 5


def test_embeddings_match_direct(direct, client):
    want = direct.embeddings.create(model="x", input=["the pool", "hi"])
    got = client.embeddings.create(model="tiny", input=["the pool", "hi"])
    assert got.model == "tiny" and len(got.data) == 2
    for w, g in zip(want.data, got.data):
        assert g.index == w.index and g.embedding == pytest.approx(w.embedding, abs=1e-5)
    assert got.usage.prompt_tokens == want.usage.prompt_tokens


def test_a_runtime_400_reaches_the_client_as_400_with_its_message(direct, client):
    ask = dict(messages=HI, max_tokens=2, response_format={"type": "bogus"})
    with pytest.raises(openai.BadRequestError) as want:
        direct.chat.completions.create(model="x", **ask)
    with pytest.raises(openai.BadRequestError) as got:
        client.chat.completions.create(model="tiny", **ask)
    assert got.value.status_code == 400 and got.value.code == "invalid_request"
    assert want.value.body["message"] in got.value.message
    with pytest.raises(openai.BadRequestError) as got:  # streamed: refused before the first token
        client.chat.completions.create(model="tiny", stream=True, **ask)
    assert want.value.body["message"] in got.value.message


# -- everything a runtime answers reaches the client ----------------------------------------------------------
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]
EXPECTED = [
    {"content": "Calling", "finish_reason": "tool_calls", "reasoning": "think more",
     "tool_calls": [("call_1", "get_weather", '{"city":"Paris"}'), ("call_2", "get_time", "{}")],
     "logprobs": None},
    {"content": "other", "finish_reason": "content_filter", "reasoning": None, "tool_calls": [],
     "logprobs": [("other", -0.5)]},
]


def test_tool_calls_reasoning_logprobs_and_choices_pass_through(client, scripted):
    scripted.bodies.clear()
    got = client.chat.completions.create(
        model="scripted", messages=[{"role": "user", "content": "weather?"}], tools=TOOLS,
        tool_choice="required", parallel_tool_calls=True, n=2, seed=42,
        extra_body={"chat_template_kwargs": {"enable_thinking": True}, "top_k": 9})
    assert choices_of(got) == EXPECTED
    assert got.usage.prompt_tokens == 7 and got.usage.completion_tokens == 11
    assert got.usage.prompt_tokens_details.cached_tokens == 3
    assert got.usage.completion_tokens_details.reasoning_tokens == 2

    # the client's body reached the runtime whole: the pool set only the model, the streaming
    # (off: this client wants the answer whole, so the runtime makes it whole),
    # and the model's extra_body under the client's fields
    sent = scripted.bodies[-1]
    assert sent["model"] == "upstream-name" and "stream" not in sent and "stream_options" not in sent
    assert sent["tools"] == TOOLS and sent["tool_choice"] == "required" and sent["parallel_tool_calls"] is True
    assert sent["n"] == 2 and sent["chat_template_kwargs"] == {"enable_thinking": True}
    assert sent["seed"] == 42 and sent["top_k"] == 9  # the client's win over extra_body's

    direct = openai.OpenAI(base_url=scripted.url + "/v1", api_key="unused", max_retries=0)
    ask = dict(messages=[{"role": "user", "content": "weather?"}], tools=TOOLS, n=2, stream=True)
    want_s, _ = streamed_choices(direct.chat.completions.create(model="m", **ask))
    got_s, usage = streamed_choices(client.chat.completions.create(
        model="scripted", stream_options={"include_usage": True}, **ask))
    assert got_s == want_s == EXPECTED
    assert usage.completion_tokens == 11
    assert scripted.bodies[-1]["stream"] is True and scripted.bodies[-1]["stream_options"] == {"include_usage": True}

    with pytest.raises(openai.BadRequestError) as err:  # the runtime's 400 through a remote too
        client.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "refuse"}])
    assert "scripted refusal: bad tool schema" in err.value.message


# -- backends without an OpenAI server ----------------------------------------------------------------------
def test_a_field_the_backend_cannot_honour_is_refused_by_name(client, pool):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="syn", messages=HI, tools=TOOLS)
    assert err.value.code == "unsupported_parameter" and err.value.param == "tools"
    assert "'tools'" in err.value.message and "synthetic" in err.value.message and "'syn'" in err.value.message
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="syn", messages=HI, n=2)
    assert err.value.param == "n"
    # neutral values ask for nothing beyond the default: accepted
    ok = client.chat.completions.create(model="syn", messages=HI, n=1, logprobs=False, seed=3, temperature=0.5)
    assert ok.choices[0].finish_reason == "stop"
    r = pool.http.post("/v1/chat/completions", json={"model": "syn", "messages": HI, "stream": True,
                                                      "response_format": {"type": "json_object"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"


def test_an_endpoint_the_model_cannot_serve_is_400_naming_it(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.embeddings.create(model="syn", input="x")
    assert err.value.code == "unsupported_endpoint" and "'syn'" in err.value.message
    assert "/v1/embeddings" in err.value.message
    with pytest.raises(openai.BadRequestError) as err:  # the runtime says it (llama-server's 501)
        client.embeddings.create(model="plain", input="x")
    assert err.value.code == "unsupported_endpoint" and "'plain'" in err.value.message
    assert "--embeddings" in err.value.message
    legacy = client.completions.create(model="syn", prompt="abc", max_tokens=3)
    assert legacy.choices[0].finish_reason == "length" and legacy.usage.completion_tokens == 3


def test_the_pool_still_checks_the_fields_it_reads(pool):
    for body, param in [({"messages": []}, "messages"), ({"messages": HI, "max_tokens": "5"}, "max_tokens"),
                        ({"messages": HI, "stream": "yes"}, "stream"), ({"messages": "hi"}, "messages"),
                        ({"messages": HI, "stream_options": {"include_usage": 1}}, "stream_options.include_usage")]:
        r = pool.http.post("/v1/chat/completions", json={"model": "syn", **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    r = pool.http.post("/v1/completions", json={"model": "syn"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = pool.http.post("/v1/embeddings", json={"model": "syn", "input": "x", "stream": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream"


# -- the Responses API mapped onto chat runtimes ---------------------------------------------------------
RESPONSES_TOOLS = [{"type": "function", "name": "get_weather", "description": "weather of a city",
                    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]
TURN = [{"role": "user", "content": "weather?"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}]},
        {"type": "function_call", "call_id": "call_0", "name": "get_weather", "arguments": '{"city":"Oslo"}'},
        {"type": "function_call_output", "call_id": "call_0", "output": "rain"}]


def items_of(response) -> list[tuple]:
    out = []
    for item in response.output:
        if item.type == "function_call":
            out.append(("function_call", item.call_id, item.name, item.arguments))
        elif item.type == "reasoning":
            out.append(("reasoning", "".join(c.text for c in item.content or [])))
        else:
            out.append(("message", "".join(c.text for c in item.content)))
    return out


RESPONSE_ITEMS = [("reasoning", "think more"), ("message", "Calling"),
                  ("function_call", "call_1", "get_weather", '{"city":"Paris"}'),
                  ("function_call", "call_2", "get_time", "{}")]


def test_responses_function_tools_map_both_ways(client, scripted):
    scripted.bodies.clear()
    r = client.responses.create(model="scripted", instructions="be brief", input=TURN, tools=RESPONSES_TOOLS,
                                tool_choice={"type": "function", "name": "get_weather"},
                                reasoning={"effort": "low"}, max_output_tokens=50, parallel_tool_calls=False,
                                text={"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}}})
    assert items_of(r) == RESPONSE_ITEMS and r.status == "completed"
    assert r.usage.input_tokens == 7 and r.usage.output_tokens == 11
    assert r.usage.input_tokens_details.cached_tokens == 3 and r.usage.output_tokens_details.reasoning_tokens == 2
    sent = scripted.bodies[-1]
    assert sent["messages"] == [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "reasoning_content": "hm", "tool_calls": [
            {"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_0", "content": "rain"}]
    assert sent["tools"] == [{"type": "function", "function": {
        "name": "get_weather", "description": "weather of a city", "parameters": RESPONSES_TOOLS[0]["parameters"]}}]
    assert sent["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert sent["response_format"] == {"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "object"}}}
    assert sent["reasoning_effort"] == "low" and sent["max_tokens"] == 50 and sent["parallel_tool_calls"] is False

    kinds = []
    with client.responses.stream(model="scripted", input="weather?", tools=RESPONSES_TOOLS) as stream:
        for event in stream:
            kinds.append(event.type)
        final = stream.get_final_response()
    assert items_of(final) == RESPONSE_ITEMS
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done") == 4
    assert kinds.count("response.function_call_arguments.done") == 2
    assert "response.function_call_arguments.delta" in kinds and "response.reasoning_text.delta" in kinds
    # each item closes before the next opens
    opened = [k for k in kinds if k.startswith("response.output_item.")]
    assert opened == ["response.output_item.added", "response.output_item.done"] * 4


def test_responses_structured_output_matches_chat_direct(direct, client):
    want = direct.chat.completions.parse(model="x", messages=HI, max_tokens=120, temperature=0,
                                         response_format=Person)
    got = client.responses.parse(model="tiny", input="hi", max_output_tokens=120, temperature=0,
                                 text_format=Person)
    assert got.output_text == want.choices[0].message.content
    assert isinstance(got.output_parsed, Person)


def test_responses_refuse_what_they_cannot_map(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model="scripted", input="x", previous_response_id="resp_1")
    assert err.value.param == "previous_response_id"
    with pytest.raises(openai.BadRequestError) as err:  # a backend that cannot honour tools says so
        client.responses.create(model="syn", input="x", tools=RESPONSES_TOOLS)
    assert err.value.code == "unsupported_parameter" and err.value.param == "tools"


# Codex's tools: its own functions, its sub-agents in a namespace, and hosted tools no local runtime has
CODEX_TOOLS = [{"type": "function", "name": "shell", "parameters": {"type": "object"}},
               {"type": "web_search", "external_web_access": False},
               {"type": "namespace", "name": "weather", "description": "Weather tools",
                "tools": [{"type": "function", "name": "get_weather", "parameters": RESPONSES_TOOLS[0]["parameters"]}]}]


def test_namespace_tools_are_flattened_and_hosted_tools_skipped(pool, scripted):
    """As llama-server's own Responses route, a tool with no Chat Completions equivalent is skipped
    (not a 400); the answer says which. A namespace's functions reach the runtime as functions,
    and its calls come back naming their namespace, as Codex dispatches them."""
    history = [{"role": "user", "content": "weather?"},
               {"type": "function_call", "call_id": "call_0", "name": "get_weather", "namespace": "weather",
                "arguments": '{"city":"Oslo"}'},
               {"type": "function_call_output", "call_id": "call_0", "output": "rain"}]
    scripted.bodies.clear()
    r = pool.http.post("/v1/responses", json={"model": "scripted", "input": history, "tools": CODEX_TOOLS})
    assert r.status_code == 200, r.text
    assert r.headers["x-llm-pool-skipped-tools"] == "web_search"
    sent = scripted.bodies[-1]
    assert [t["function"]["name"] for t in sent["tools"]] == ["shell", "get_weather"]
    assert sent["messages"][1]["tool_calls"][0]["function"]["name"] == "get_weather"
    calls = [(i["name"], i.get("namespace")) for i in r.json()["output"] if i["type"] == "function_call"]
    assert calls == [("get_weather", "weather"), ("get_time", None)]  # get_time: no tool of a namespace
    events = sse_json(pool.url, "/v1/responses", {"model": "scripted", "input": "x", "tools": CODEX_TOOLS,
                                                  "stream": True})
    done = [e["item"] for e in events if e["type"] == "response.output_item.done" and e["item"]["type"] == "function_call"]
    assert [(i["name"], i.get("namespace")) for i in done] == calls
    assert events[-1]["response"]["tools"] == CODEX_TOOLS  # the response echoes the tools as sent


def test_a_multi_part_prompt_is_rendered_as_llama_server_renders_it(direct_url, pool):
    """Several text parts of one message are joined as llama-server joins them (with newlines):
    the pool's prompt is direct llama-server's, token for token, on the Responses and chat surfaces."""
    parts = ["Hi", "there", "", "the pool model"]
    responses = {"instructions": "be brief", "max_output_tokens": 4, "temperature": 0, "input": [
        {"role": "developer", "content": [{"type": "input_text", "text": "one"}, {"type": "input_text", "text": "two"}]},
        {"role": "user", "content": [{"type": "input_text", "text": t} for t in parts]}]}
    want = httpx.post(direct_url + "/v1/responses", json={"model": "x", **responses}, timeout=60).json()
    got = pool.http.post("/v1/responses", json={"model": "tiny", **responses}).json()
    assert got["usage"]["input_tokens"] == want["usage"]["input_tokens"] > 10, (got["usage"], want["usage"])
    text = [c["text"] for i in got["output"] if i["type"] == "message" for c in i["content"]]
    assert text == [c["text"] for i in want["output"] if i["type"] == "message" for c in i["content"]]
    chat = {"max_tokens": 4, "temperature": 0, "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "system", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]},
        {"role": "user", "content": [{"type": "text", "text": t} for t in parts]}]}
    want = httpx.post(direct_url + "/v1/chat/completions", json={"model": "x", **chat}, timeout=60).json()
    got = pool.http.post("/v1/chat/completions", json={"model": "tiny", **chat}).json()
    assert got["usage"]["prompt_tokens"] == want["usage"]["prompt_tokens"]
    assert got["choices"][0]["message"] == want["choices"][0]["message"]
    # the count llama-server gives for the same chat with its parts joined by hand, as it joins them
    joined = [{"role": "system", "content": "be brief"}, {"role": "system", "content": "one\ntwo"},
              {"role": "user", "content": "Hi\nthere\n\nthe pool model"}]
    counted = httpx.post(direct_url + "/v1/chat/completions/input_tokens", json={"messages": joined}, timeout=60)
    assert counted.json()["input_tokens"] == got["usage"]["prompt_tokens"], counted.text


def test_a_response_cut_by_a_full_context_says_so(pool, client):
    """No output limit, a context of 256 tokens that fills: incomplete for the context window,
    not for max_output_tokens; with a limit that is reached, max_output_tokens."""
    r = client.responses.create(model="short", input="hi", temperature=0)
    assert r.status == "incomplete" and r.incomplete_details.reason == "model_context_window_exceeded"
    assert r.usage.input_tokens + r.usage.output_tokens >= 255
    events = sse_json(pool.url, "/v1/responses", {"model": "short", "input": "hi", "temperature": 0, "stream": True})
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "model_context_window_exceeded"}
    r = client.responses.create(model="short", input="hi", temperature=0, max_output_tokens=5)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"


# -- to the letter: what llama-server frames its answer with, the pool relays ---------------------------------
# (what the pool makes itself: the model name, ids, created, system_fingerprint; README "API fidelity")
POOL_OWNED = {"id", "created", "model", "system_fingerprint"}
LONG = [{"role": "user", "content": "This is a test " * 40}]  # several 64-token batches (return_progress)


def sse_json(base: str, path: str, body: dict) -> list[dict]:
    """The data events of one streamed answer, as JSON objects, in order."""
    with httpx.stream("POST", base + path, json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(line[6:]) for line in r.iter_lines()
                if line.startswith("data: ") and line != "data: [DONE]"]


def framing(chunks: list[dict]) -> list[tuple]:
    """What a chunk holds besides its text and numbers: which fields at the top, and its
    choices' deltas' keys with their empty values (the opening's null, a finish's {}). A run
    of alike chunks counts once: the pool joins the tokens of a client that fell behind."""
    out: list[tuple] = []
    for chunk in chunks:
        deltas = tuple((c.get("finish_reason"), tuple(sorted((k, v) for k, v in (c.get("delta") or {}).items()
                                                             if v in (None, "", "assistant"))))
                       for c in chunk.get("choices") or ())
        frame = (tuple(sorted(chunk.keys() - POOL_OWNED)), deltas)
        if not out or out[-1] != frame:
            out.append(frame)
    return out


def test_a_stream_opens_as_the_runtime_opens_it(direct_url, pool):
    """llama-server's first chunk is the role with "content": null; the pool's too. Every
    chunk, first to last, holds the fields and the empty values llama-server's held."""
    ask = {"messages": HI, "max_tokens": 5, "temperature": 0, "stream": True}
    want = sse_json(direct_url, "/v1/chat/completions", {"model": "x", **ask})
    got = sse_json(pool.url, "/v1/chat/completions", {"model": "tiny", **ask})
    assert got[0]["choices"][0]["delta"] == want[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}
    assert framing(got) == framing(want)
    assert all("role" not in c["choices"][0]["delta"] for c in got[1:])
    assert "timings" in got[-1] and got[-1]["timings"].keys() == want[-1]["timings"].keys()
    # a backend with no OpenAI server of its own opens as OpenAI does
    syn = sse_json(pool.url, "/v1/chat/completions", {"model": "syn", "messages": HI, "stream": True})
    assert syn[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}


def test_cached_tokens_0_is_what_the_runtime_said(direct_url, pool):
    ask = {"messages": HI, "max_tokens": 2, "temperature": 0, "cache_prompt": False}
    want = httpx.post(direct_url + "/v1/chat/completions", json={"model": "x", **ask}, timeout=60).json()
    got = pool.http.post("/v1/chat/completions", json={"model": "tiny", **ask}).json()
    assert got["usage"] == want["usage"] and want["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    stream = {**ask, "stream": True, "stream_options": {"include_usage": True}}
    want = sse_json(direct_url, "/v1/chat/completions", {"model": "x", **stream})[-1]
    got = sse_json(pool.url, "/v1/chat/completions", {"model": "tiny", **stream})[-1]
    assert got["usage"] == want["usage"] and got["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert got["choices"] == want["choices"] == []


def test_a_legacy_stream_has_the_usage_llama_server_sends_unasked(direct_url, pool):
    ask = {"prompt": "the pool", "max_tokens": 4, "temperature": 0, "stream": True, "cache_prompt": False}
    for extra in ({}, {"stream_options": {"include_usage": True}}):  # llama-server puts it on its last chunk, always
        want = sse_json(direct_url, "/v1/completions", {"model": "x", **ask, **extra})
        got = sse_json(pool.url, "/v1/completions", {"model": "tiny", **ask, **extra})
        assert framing(got) == framing(want)
        assert got[-1]["usage"] == want[-1]["usage"] and got[-1]["usage"]["completion_tokens"] == 4
        assert got[-1]["choices"][0]["finish_reason"] == want[-1]["choices"][0]["finish_reason"] == "length"
        assert "".join(c["choices"][0]["text"] for c in got) == "".join(c["choices"][0]["text"] for c in want)
        assert got[-1]["timings"]["predicted_n"] == want[-1]["timings"]["predicted_n"] == 4


def test_timings_per_token_and_return_progress_pass_both_ways(direct_url, pool):
    ask = {"messages": LONG, "max_tokens": 4, "temperature": 0, "stream": True, "cache_prompt": False,
           "stream_options": {"include_usage": True}, "timings_per_token": True, "return_progress": True}
    want = sse_json(direct_url, "/v1/chat/completions", {"model": "x", **ask})
    got = sse_json(pool.url, "/v1/chat/completions", {"model": "tiny", **ask})
    assert framing(got) == framing(want)

    def progress(chunks):
        return [{k: v for k, v in c["prompt_progress"].items() if k != "time_ms"}
                for c in chunks if "prompt_progress" in c]
    assert len(progress(want)) > 1 and progress(got) == progress(want)
    assert got[-1]["choices"] == [] and got[-1]["usage"] == want[-1]["usage"]
    assert got[-1]["timings"]["predicted_n"] == want[-1]["timings"]["predicted_n"] == 4

    del ask["return_progress"]  # llama-server's own test_chat_completion_with_timings_per_token
    want = sse_json(direct_url, "/v1/chat/completions", {"model": "x", **ask})
    got = sse_json(pool.url, "/v1/chat/completions", {"model": "tiny", **ask})
    assert framing(got) == framing(want)
    assert "timings" not in got[0] and got[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}
    texts = [c for c in got if c["choices"] and c["choices"][0]["delta"].get("content")]
    assert texts and all("predicted_per_second" in c["timings"] for c in texts)


def test_verbose_answers_carry_the_runtimes_own_record(direct_url, pool):
    ask = {"messages": [{"role": "system", "content": "Book"}, *HI], "max_tokens": 3, "temperature": 0,
           "verbose": True}
    want = httpx.post(direct_url + "/v1/chat/completions", json={"model": "x", **ask}, timeout=60).json()
    got = pool.http.post("/v1/chat/completions", json={"model": "tiny", **ask}).json()
    assert "Book" in got["__verbose"]["prompt"] and got["__verbose"]["prompt"] == want["__verbose"]["prompt"]
    assert got["__verbose"]["content"] == want["__verbose"]["content"] == got["choices"][0]["message"]["content"]
    assert got["timings"]["predicted_n"] == want["timings"]["predicted_n"] == 3
    quiet = pool.http.post("/v1/chat/completions", json={"model": "tiny", **ask, "verbose": False}).json()
    assert "__verbose" not in quiet and "timings" in quiet
    legacy = pool.http.post("/v1/completions", json={"model": "tiny", "prompt": "Book", "max_tokens": 2,
                                                     "verbose": True}).json()
    assert legacy["__verbose"]["prompt"].endswith("Book")


def test_responses_carry_llama_servers_telemetry(direct_url, pool):
    """llama-server's own test (test_responses_stream_with_llama_telemetry) through the pool:
    prompt progress on response.in_progress events, timings on text deltas and on the end."""
    ask = {"input": LONG[0]["content"], "max_output_tokens": 4, "temperature": 0, "stream": True,
           "timings_per_token": True, "return_progress": True}
    for url, model in ((direct_url, "x"), (pool.url, "tiny")):
        events = sse_json(url, "/v1/responses", {"model": model, **ask})
        progress = [e for e in events if "prompt_progress" in e]
        assert progress and {e["type"] for e in progress} == {"response.in_progress"}, (url, events)
        assert progress[-1]["prompt_progress"]["processed"] == progress[-1]["prompt_progress"]["total"] > 0
        assert any(e["type"] == "response.output_text.delta" and "predicted_per_second" in e.get("timings", {})
                   for e in events), url
        assert "timings" in events[-1] and events[-1]["type"] in ("response.completed", "response.incomplete")
        assert "usage" in events[-1]["response"]


def test_the_runtimes_own_request_fields_reach_it(client, scripted):
    """llama-server's request extensions reach the runtime as sent, from every surface."""
    own = {"return_progress": True, "timings_per_token": True, "verbose": True}
    for call in (lambda: client.chat.completions.create(model="scripted", messages=HI, extra_body=own),
                 lambda: client.completions.create(model="scripted", prompt="x", extra_body=own),
                 lambda: client.responses.create(model="scripted", input="x", extra_body=own)):
        scripted.bodies.clear()
        try:
            call()
        except openai.APIError:
            pass  # the scripted runtime answers chat only; what it was sent is what counts here
        assert {k: scripted.bodies[-1].get(k) for k in own} == own


def test_a_runtimes_own_fields_are_bounded(client):
    with pytest.raises(openai.InternalServerError) as err:
        client.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "huge extra"}],
                                       stream=True)
    assert err.value.status_code == 502 and "byte bound" in err.value.message
    assert client.chat.completions.create(model="scripted", messages=HI).choices  # and it serves on


def test_a_remote_runtimes_own_fields_come_back_on_their_chunks(pool, scripted):
    ask = {"messages": [{"role": "user", "content": "own fields"}], "stream": True}
    want = sse_json(scripted.url, "/v1/chat/completions", {"model": "m", **ask})
    got = sse_json(pool.url, "/v1/chat/completions", {"model": "scripted", **ask})
    assert framing(got) == framing(want)  # vLLM-style opening ("content": ""), each field on its chunk
    assert [c.get("x_progress") or c.get("x_tick") or c.get("x_note") or c.get("x_end") for c in got] == \
        [{"done": 1}, 1, None, "alone", {"n": 2}]
