"""Ollama's API (issue 54), tried with the official `ollama` Python client against a real pool:
a synthetic model (its answers are deterministic: the same request through the pool's OpenAI
surface must give the same text) and the tiny GGUF on a real llama-server (options and format
reach the runtime). Through the same request path: keys, the request log, metrics."""

from __future__ import annotations

import json

import httpx
import ollama
import pytest

from tests.conftest import llama, synthetic
from tests.pool import wait_for

KEY = "sk-ollama"
CTX = 4096


@pytest.fixture(scope="module")
def pool(tmp_path_factory, llama_server_bin, tiny_gguf):
    from tests.pool import Pool
    pool = Pool(tmp_path_factory.mktemp("ollama"),
                [synthetic("syn", tokens=6), llama("tiny", tiny_gguf, llama_server_bin, ctx=CTX)],
                server={"api_key": KEY, "admin_key": "admin"})
    pool.http.headers["authorization"] = f"Bearer {KEY}"
    pool.start()
    try:
        yield pool
    finally:
        pool.stop()


@pytest.fixture
def client(pool):
    return ollama.Client(host=pool.url, headers={"Authorization": f"Bearer {KEY}"})


def test_the_listings_name_every_model_and_what_is_loaded(client, pool):
    assert client.list().models and {m.model for m in client.list().models} == {"syn:latest", "tiny:latest"}
    tiny = next(m for m in client.list().models if m.model == "tiny:latest")
    assert tiny.details.format == "gguf" and tiny.size > 0  # the model file's
    loaded = {m.model: m for m in client.ps().models}
    assert set(loaded) == {"syn:latest", "tiny:latest"}
    assert loaded["tiny:latest"].size > 0 and loaded["tiny:latest"].context_length == CTX
    shown = client.show("tiny")
    assert "completion" in shown.capabilities
    assert httpx.get(pool.url + "/api/version", headers={"Authorization": f"Bearer {KEY}"}).json()["version"]


def test_chat_whole_and_streamed_says_what_the_openai_surface_says(client, pool):
    messages = [{"role": "user", "content": "name three colours"}]
    openai = pool.http.post("/v1/chat/completions", json={"model": "syn", "messages": messages}).json()
    expected = openai["choices"][0]["message"]["content"]
    whole = client.chat(model="syn", messages=messages, stream=False)
    assert whole.message.content == expected and whole.done and whole.done_reason == "stop"
    assert whole.eval_count == 6 and whole.prompt_eval_count == openai["usage"]["prompt_tokens"]
    assert whole.total_duration >= whole.prompt_eval_duration + whole.eval_duration > 0
    lines = list(client.chat(model="syn:latest", messages=messages, stream=True))  # the tag is Ollama's
    assert "".join(line.message.content for line in lines) == expected
    assert [line.done for line in lines] == [False] * (len(lines) - 1) + [True] and lines[-1].eval_count == 6
    rows = wait_for(lambda: [r for r in pool.http.get("/admin/requests", params={"limit": 5}, headers={
        "Authorization": "Bearer admin"}).json()["requests"] if r["endpoint"] == "ollama_chat"], 10,
        what="the request log's rows of both chats")
    assert len(rows) == 2 and all(r["status"] == 200 and r["model"] == "syn" for r in rows), rows


def test_options_and_format_reach_the_runtime(client):
    raw = client.generate(model="tiny", prompt="Once upon a time", raw=True, stream=False,
                          options={"num_predict": 5, "temperature": 0, "seed": 1, "top_k": 1})
    assert raw.eval_count == 5 and raw.done_reason == "length" and raw.response
    again = client.generate(model="tiny", prompt="Once upon a time", raw=True, stream=False,
                            options={"num_predict": 5, "temperature": 0, "seed": 1, "top_k": 1})
    assert again.response == raw.response  # greedy: the same five tokens
    templated = client.generate(model="tiny", prompt="hi", system="be brief", stream=False,
                                options={"num_predict": 3})
    assert templated.eval_count == 3
    as_json = client.chat(model="tiny", messages=[{"role": "user", "content": "a JSON object"}], stream=False,
                          format={"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                          options={"num_predict": 40, "temperature": 0})
    if as_json.done_reason == "stop":  # the grammar let it finish: the object is whole
        assert isinstance(json.loads(as_json.message.content)["a"], int), as_json.message.content


@pytest.mark.parametrize("call, param", [
    (lambda c: c.chat(model="syn", messages=[{"role": "user", "content": "x"}], options={"mirostat": 1}),
     "options.mirostat"),
    (lambda c: c.chat(model="tiny", messages=[{"role": "user", "content": "x"}], options={"num_ctx": CTX * 4}),
     "options.num_ctx"),
    (lambda c: c.chat(model="syn", messages=[{"role": "user", "content": "x"}], think=True), "think"),
    (lambda c: c.generate(model="syn", prompt="x", template="{{ .Prompt }}"), "template"),
])
def test_what_the_pool_cannot_honour_is_a_400_naming_it(client, call, param):
    with pytest.raises(ollama.ResponseError) as refused:
        call(client)
    assert refused.value.status_code == 400 and refused.value.error.startswith(param), refused.value.error


def test_errors_come_in_ollamas_envelope_and_keys_are_asked(client, pool):
    with pytest.raises(ollama.ResponseError) as missing:
        client.chat(model="nope", messages=[{"role": "user", "content": "x"}])
    assert missing.value.status_code == 404 and "nope" in missing.value.error
    for path in ("/api/tags", "/api/ps"):
        r = httpx.get(pool.url + path)  # no key
        assert r.status_code == 401 and isinstance(r.json()["error"], str), r.text
    r = httpx.post(pool.url + "/api/chat", json={"model": "syn", "messages": []})
    assert r.status_code == 401 and isinstance(r.json()["error"], str)
