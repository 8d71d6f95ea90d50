"""The runtime's own calls, per model, on the same pipeline as every request: /tokenize,
/detokenize, /apply-template, /v1/rerank (and /rerank) and Anthropic's count_tokens; and
`capabilities` in /v1/models. Against llama-server itself (the tiny GGUF, and a tiny
reranker) pool vs direct; on the synthetic runtime for what the pool decides (which calls
a backend has, the queue a light call skips, scopes and errors)."""

from __future__ import annotations

import json
import logging
import socket
from concurrent.futures import ThreadPoolExecutor

import anthropic
import httpx
import psutil
import pytest

from protocol import LIGHT_CALLS_PER_WORKER
from runtime_worker.backends import backend_class
from supervisor.config import ModelConfig
from supervisor.models.capabilities import CALLS, capabilities, native_input_tokens, native_messages
from testkit.llama import direct_llama_server
from testkit.tiny_gguf import write_tiny_gguf
from tests.conftest import llama, synthetic
from tests.pool import wait_for
from tests.procs import frozen

CONFIGS = [
    ("llama_server", {"model": "m.gguf"}),
    ("llama_server", {"model": "m.gguf", "reranking": True}),
    ("llama_server", {"model": "m.gguf", "extra_args": ["--rerank"]}),
    ("vllm_serve", {"model": "m"}),
    ("vllm_serve", {"model": "m", "reranking": True}),
    ("synthetic", {}),
    ("openai_remote", {"base_url": "http://127.0.0.1:9/v1", "model": "m"}),
    ("exllamav3", {"model": "m"}),
]


@pytest.mark.parametrize("backend,options", CONFIGS)
def test_capabilities_agree_with_what_each_worker_serves(backend, options):
    """The supervisor lists (and admits) what the worker's backend then serves: no call is
    listed that the worker refuses, and none refused up front that the worker would serve."""
    cfg = ModelConfig(name="m", backend=backend, options=options)
    served = backend_class(backend)(options, 1, logging.getLogger("test")).endpoints
    listed = set(capabilities(cfg))
    # messages and its count: the runtime's own routes on llama-server; elsewhere translated to chat
    # (counted by a tokenize of that chat)
    # and a chat's input_tokens: llama-server's own route; elsewhere a tokenize of the chat
    translated = {"count_tokens": "tokenize", "messages": "chat", "input_tokens": "tokenize"}
    for call in (*CALLS, "messages"):
        native = native_input_tokens(cfg) if call == "input_tokens" else native_messages(cfg)
        asked = call if native else translated.get(call, call)
        assert (call in listed) == (asked in served), (backend, options, call)
    assert "chat" in listed and "chat" in served and ("completions" in listed) == ("completions" in served)


@pytest.fixture(scope="module")
def syn_pool(tmp_path_factory):
    from tests.pool import Pool
    pool = Pool(tmp_path_factory.mktemp("pool"),
                [synthetic("syn", tokens=5, max_prompt_chars=1000), synthetic("slow", tps=5, tokens=400), synthetic("other")],
                tenants=[{"name": "team", "keys": ["sk-team"], "models": ["syn", "slow"]}],
                server={"admin_key": "sk-admin", "liveness_s": 60}).start()  # a held worker is not killed
    yield pool
    pool.stop()


def post(pool, path: str, body: dict, key: str = "sk-team") -> httpx.Response:
    return pool.http.post(path, json=body, headers={"Authorization": f"Bearer {key}"})


def test_calls_are_served_scoped_and_refused_by_name(syn_pool):
    models = syn_pool.http.get("/v1/models", headers={"Authorization": "Bearer sk-team"}).json()["data"]
    listed = {m["id"]: m for m in models}
    assert listed["syn"]["capabilities"] == ["chat", "completions", "responses", "messages", "count_tokens",
                                             "input_tokens", "tokenize"]
    answer = post(syn_pool, "/tokenize", {"model": "syn", "content": "the pool  model"})
    assert answer.status_code == 200 and answer.json()["count"] == 3 and len(answer.json()["tokens"]) == 3
    for path, body in [("/detokenize", {"tokens": [1, 2]}), ("/apply-template", {"messages": []}),
                       *((path, {"query": "q", "documents": ["d"]})
                         for path in ("/v1/rerank", "/rerank", "/v1/reranking", "/reranking"))]:
        refused = post(syn_pool, path, {"model": "syn", **body})
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "unsupported_endpoint", path
        assert path in refused.json()["error"]["message"] or path in ("/rerank", "/v1/reranking", "/reranking")
    keyless = syn_pool.http.post("/tokenize", json={"model": "syn", "content": "x"})
    assert keyless.status_code == 401 and keyless.json()["error"]["code"] == "unauthorized"
    # out of the tenant's scope: the same 404 as a model that does not exist
    for model in ("other", "nope"):
        hidden = post(syn_pool, "/tokenize", {"model": model, "content": "x"})
        assert hidden.status_code == 404 and hidden.json()["error"]["code"] == "model_not_found"
    bad = post(syn_pool, "/v1/rerank", {"model": "syn", "query": "q", "documents": []})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "documents"
    assert post(syn_pool, "/tokenize", {"content": "x"}).json()["error"]["param"] == "model"
    too_long = post(syn_pool, "/tokenize", {"model": "syn", "content": "x " * 501})
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "content"
    def logged():
        rows = syn_pool.http.get("/admin/requests", params={"limit": 50},
                                 headers={"Authorization": "Bearer sk-admin"}).json()["requests"]
        return {(r["endpoint"], r["status"]) for r in rows}
    wait_for(lambda: {("tokenize", 200), ("detokenize", 400)} <= logged(), timeout=10,
             what="the calls in the request log")


def test_count_tokens_is_what_a_message_would_prompt(syn_pool):
    client = anthropic.Anthropic(base_url=syn_pool.url, api_key="sk-team", max_retries=0)
    ask = dict(model="syn", system="be brief and kind",
               messages=[{"role": "user", "content": "how many tokens are here"},
                         {"role": "assistant", "content": "let me count"},
                         {"role": "user", "content": [{"type": "text", "text": "now please"}]}])
    counted = client.messages.count_tokens(**ask)
    created = client.messages.create(max_tokens=3, **ask)
    assert counted.input_tokens == created.usage.input_tokens == 4 + 5 + 3 + 2  # a word is a token here
    with pytest.raises(anthropic.NotFoundError) as hidden:
        client.messages.count_tokens(model="other", messages=[{"role": "user", "content": "x"}])
    assert hidden.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.count_tokens(model="syn", messages=[{"role": "robot", "content": "x"}])
    assert bad.value.body["type"] == "error" and "role" in bad.value.body["error"]["message"]


def test_chat_input_tokens_is_what_a_chat_would_prompt(syn_pool):
    """llama-server's /v1/chat/completions/input_tokens (and /chat/completions/input_tokens),
    on a runtime without it: its /tokenize of the chat."""
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "how many are here"}]
    created = post(syn_pool, "/v1/chat/completions", {"model": "syn", "messages": messages, "max_tokens": 2})
    for path in ("/v1/chat/completions/input_tokens", "/chat/completions/input_tokens"):
        counted = post(syn_pool, path, {"model": "syn", "messages": messages})
        assert counted.status_code == 200, counted.text
        assert counted.json() == {"object": "response.input_tokens",
                                  "input_tokens": created.json()["usage"]["prompt_tokens"]}
    bad = post(syn_pool, "/v1/chat/completions/input_tokens", {"model": "syn", "messages": []})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages"
    assert post(syn_pool, "/v1/chat/completions/input_tokens",
                {"model": "other", "messages": messages}).status_code == 404


def _open_stream(pool, model: str, content: str) -> socket.socket:
    """A streamed chat request sent on a raw connection that is never read: closing it is the
    client leaving (its job is cancelled)."""
    body = json.dumps({"model": model, "stream": True, "messages": [{"role": "user", "content": content}]})
    sock = socket.create_connection(("127.0.0.1", pool.port))
    sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer sk-team\r\n"
                 f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}".encode())
    return sock


def test_a_light_call_skips_the_queue_of_a_busy_model(syn_pool):
    """Every slot of `slow` generates and a request waits in its queue: a tokenize is answered
    at once all the same (it takes no generation slot), and the two keep their places."""
    def figures():
        models = syn_pool.http.get("/admin/models", headers={"Authorization": "Bearer sk-admin"}).json()["models"]
        m = {m["name"]: m for m in models}["slow"]
        return m["runtime_inflight"], m["queue_depth"]
    running = _open_stream(syn_pool, "slow", "first")
    queued = None
    try:
        wait_for(lambda: figures() == (1, 0), timeout=30, what="the first request running")
        queued = _open_stream(syn_pool, "slow", "second")
        wait_for(lambda: figures() == (1, 1), timeout=30, what="the second request queued")
        answer = syn_pool.http.post("/tokenize", json={"model": "slow", "content": "a b"}, timeout=10,
                                    headers={"Authorization": "Bearer sk-team"})
        assert answer.status_code == 200 and answer.json()["count"] == 2, answer.text
        assert figures() == (1, 1)
    finally:
        for sock in (running, queued):
            if sock is not None:
                sock.close()
    wait_for(lambda: figures() == (0, 0), timeout=30, what="both requests cancelled")


def test_light_calls_take_no_slot_and_more_than_a_worker_takes_beside_them_queue(syn_pool):
    """A model of one slot, its worker held (SIGSTOP) while 12 tokenize calls arrive: 8
    (LIGHT_CALLS_PER_WORKER) go past the queue beside the slot, the 9th takes the slot, 3 wait
    in the queue; let go, every one is answered (the worker runs the 9th in its slot)."""
    def figures():
        models = syn_pool.http.get("/admin/models", headers={"Authorization": "Bearer sk-admin"}).json()["models"]
        m = {m["name"]: m for m in models}["syn"]
        return m["runtime_inflight"], m["queue_depth"]
    workers = syn_pool.http.get("/admin/workers", headers={"Authorization": "Bearer sk-admin"}).json()["workers"]
    worker = psutil.Process(next(w["pid"] for w in workers if w["model"] == "syn"))
    with ThreadPoolExecutor(12) as ex:
        with frozen(worker):
            calls = [ex.submit(post, syn_pool, "/tokenize", {"model": "syn", "content": f"w {i}"}) for i in range(12)]
            wait_for(lambda: figures() == (LIGHT_CALLS_PER_WORKER + 1, 11 - LIGHT_CALLS_PER_WORKER), 30,
                     what="8 light calls beside the slot, one in it, the rest queued")
        answers = [c.result() for c in calls]
    assert [a.status_code for a in answers] == [200] * 12, [a.text for a in answers if a.status_code != 200]
    assert all(a.json()["count"] == 2 for a in answers)
    wait_for(lambda: figures() == (0, 0), 10, what="all answered")
    # the worker and the pool agree the slot is free again: a generation takes it
    chat = post(syn_pool, "/v1/chat/completions", {"model": "syn", "messages": [{"role": "user", "content": "x"}]})
    assert chat.status_code == 200, chat.text


# -- llama-server: the pool against the same runtime asked directly ---------------------------------------------
@pytest.mark.llama
def test_tokenize_detokenize_template_and_count_match_llama_server(llama_server_bin, tiny_gguf, tmp_path, make_pool):
    with direct_llama_server(llama_server_bin, tiny_gguf, ["-c", "4096", "-np", "1"], tmp_path / "direct.log") as url:
        pool = make_pool([llama("tiny", tiny_gguf, llama_server_bin, ctx=4096)])
        direct = httpx.Client(base_url=url, timeout=30)
        listed = {m["id"]: m for m in pool.http.get("/v1/models").json()["data"]}
        assert {"tokenize", "detokenize", "apply_template", "count_tokens"} <= set(listed["tiny"]["capabilities"])
        assert "rerank" not in listed["tiny"]["capabilities"]
        for path, body in [("/tokenize", {"content": "the pool model token", "with_pieces": True}),
                           ("/tokenize", {"content": "<s>the", "add_special": True, "parse_special": True}),
                           ("/apply-template", {"messages": [{"role": "system", "content": "be brief"},
                                                             {"role": "user", "content": "hi"}]})]:
            pooled = pool.http.post(path, json={"model": "tiny", **body})
            assert pooled.status_code == 200, pooled.text
            assert pooled.json() == direct.post(path, json=body).json(), path
        tokens = pool.http.post("/tokenize", json={"model": "tiny", "content": "the pool"}).json()["tokens"]
        assert tokens and pool.http.post("/detokenize", json={"model": "tiny", "tokens": tokens}).json() == \
            direct.post("/detokenize", json={"tokens": tokens}).json()
        ask = dict(model="tiny", system="be brief", messages=[{"role": "user", "content": "the pool model"}])
        counted = anthropic.Anthropic(base_url=pool.url, api_key="unused", max_retries=0).messages.count_tokens(**ask)
        assert counted.input_tokens == anthropic.Anthropic(
            base_url=url, api_key="unused", max_retries=0).messages.count_tokens(**ask).input_tokens > 3
        chat = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": [
            {"type": "text", "text": "the pool"}, {"type": "text", "text": "model"}]}]}
        for path in ("/v1/chat/completions/input_tokens", "/chat/completions/input_tokens"):
            pooled = pool.http.post(path, json={"model": "tiny", **chat})
            assert pooled.status_code == 200, pooled.text
            assert pooled.json() == direct.post(path, json=chat).json()
            assert pooled.json()["input_tokens"] > 3 and pooled.json()["object"] == "response.input_tokens"
        refused = pool.http.post("/v1/rerank", json={"model": "tiny", "query": "q", "documents": ["d"]})
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "unsupported_endpoint"
        direct.close()


@pytest.mark.llama
def test_rerank_matches_llama_server(llama_server_bin, tmp_path, make_pool):
    reranker = str(write_tiny_gguf(tmp_path / "reranker.gguf", reranker=True))
    model = llama("rr", reranker, llama_server_bin, ctx=4096)
    model["options"]["reranking"] = True  # the pool starts it with --reranking
    body = {"query": "the pool", "documents": ["the model", "token pool", "the the"], "top_n": 2}
    with direct_llama_server(llama_server_bin, reranker, ["-c", "4096", "--reranking"],
                             tmp_path / "direct.log") as url:
        pool = make_pool([model])
        direct = httpx.post(url + "/v1/rerank", json=body, timeout=30).json()
        assert "rerank" in {m["id"]: m for m in pool.http.get("/v1/models").json()["data"]}["rr"]["capabilities"]
        for path in ("/v1/rerank", "/rerank", "/v1/reranking", "/reranking"):  # llama-server's aliases too
            pooled = pool.http.post(path, json={"model": "rr", **body})
            assert pooled.status_code == 200, pooled.text
            answer = pooled.json()
            assert answer["model"] == "rr" and answer["results"] == direct["results"]
            assert len(answer["results"]) == 2 and answer["usage"] == direct["usage"]
