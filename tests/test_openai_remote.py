"""openai_remote against a real OpenAI-compatible server on loopback: a second
pool (itself fronting a real llama-server) with an API key."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.conftest import llama, synthetic
from tests.pool import wait_for

pytestmark = pytest.mark.llama


def remote(name: str, upstream, model: str, **extra) -> dict:
    return {"name": name, "backend": "openai_remote", "target_inflight": 2,
            "options": {"base_url": upstream.url + "/v1", "model": model, "api_key_env": "UPSTREAM_KEY"},
            **extra}


def test_openai_remote_streams_and_maps_upstream_errors(make_pool, tiny_gguf, llama_server_bin):
    upstream = make_pool([llama("tiny", tiny_gguf, llama_server_bin, slots=2),
                          synthetic("busy", tps=20, tokens=60, max_queue=0)],
                         server={"api_key": "upstream-secret", "admin_key": "upstream-admin"})
    upstream.http.headers["Authorization"] = "Bearer upstream-admin"  # the test watches it as its operator
    pool = make_pool([remote("remote", upstream, "tiny"), remote("remote-missing", upstream, "nope"),
                      remote("remote-busy", upstream, "busy")],
                     env={"UPSTREAM_KEY": "upstream-secret"})
    client = openai.OpenAI(base_url=pool.url + "/v1", api_key="unused", max_retries=0)

    r = client.responses.create(model="remote", input="hi", max_output_tokens=6, temperature=0)  # no early EOS
    assert r.status == "incomplete" and r.usage.output_tokens == 6 and r.usage.input_tokens > 0
    chunks = list(client.chat.completions.create(model="remote", max_tokens=5, stream=True, temperature=0,
                                                 messages=[{"role": "user", "content": "x"}],
                                                 stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens == 5
    assert pool.workers("remote")[0]["capacity"] == 2  # the configured target_inflight

    # upstream 404 (unknown model there) is a 502 here, never a 200
    with pytest.raises(openai.InternalServerError) as exc:
        client.responses.create(model="remote-missing", input="x")
    assert exc.value.status_code == 502 and "upstream 404" in exc.value.message

    # upstream 429 (its queue is full) stays a 429
    with ThreadPoolExecutor(1) as ex:
        hog = ex.submit(httpx.post, upstream.url + "/v1/responses", timeout=30,
                        headers={"Authorization": "Bearer upstream-secret"},
                        json={"model": "busy", "input": "hog"})
        wait_for(lambda: upstream.model("busy")["runtime_inflight"] == 1, 10, what="upstream busy")
        r = pool.http.post("/v1/responses", json={"model": "remote-busy", "input": "x"})
        assert r.status_code == 429 and r.json()["error"]["code"] == "upstream_rate_limited"
        # a streaming request fails before its first token: a plain (retryable) 429 too
        with pytest.raises(openai.RateLimitError) as exc:
            client.responses.create(model="remote-busy", input="x", stream=True)
        assert exc.value.code == "upstream_rate_limited"
        assert hog.result().status_code == 200


def test_openai_remote_without_its_key_fails_to_load(make_pool):
    pool = make_pool([{"name": "r", "backend": "openai_remote", "load_on_start": False,
                       "options": {"base_url": "http://127.0.0.1:9/v1", "model": "m",
                                   "api_key_env": "LLM_POOL_TEST_UNSET_KEY"}}])
    r = pool.http.post("/admin/models/r/load")
    assert r.status_code == 503 and "LLM_POOL_TEST_UNSET_KEY" in r.json()["error"]["message"]
    assert pool.model("r")["state"] == "failed"


def test_openai_remote_reuses_its_upstream_connection(make_pool):
    """Streams are read to the end of the body (past [DONE]), so one keep-alive
    connection carries job after job instead of a new TCP connection per job."""
    import psutil

    upstream = make_pool([synthetic("s", tokens=8)], server={"api_key": "upstream-secret"})
    pool = make_pool([remote("r", upstream, "s")], env={"UPSTREAM_KEY": "upstream-secret"})
    worker = psutil.Process(pool.workers("r")[0]["pid"])

    def local_ports() -> set[int]:
        return {c.laddr.port for c in worker.net_connections("tcp")
                if c.raddr and c.raddr.port == upstream.port and c.status == psutil.CONN_ESTABLISHED}

    texts = []
    for i in range(4):
        r = pool.http.post("/v1/chat/completions", json={"model": "r", "messages": [{"role": "user",
                                                                                    "content": "x"}]})
        assert r.status_code == 200
        texts.append(r.json()["choices"][0]["message"]["content"])
        if i == 0:
            first = local_ports()
    assert len(set(texts)) == 1 and len(first) == 1
    assert local_ports() == first


def test_openai_remote_in_front_of_a_llama_server_loses_no_request(make_pool, tiny_gguf, llama_server_bin,
                                                                   tmp_path):
    """llama-server announces keep-alive but may close a connection after a stream,
    racing the next request on it (scripts/bench saw 3 of 125 such requests fail
    before the retry on a stale connection). Back-to-back streams through the
    keep-alive client must all succeed. The race is rare: this run does not
    always meet it, so it guards the path, not the exact timing."""
    from types import SimpleNamespace

    from testkit.llama import direct_llama_server

    args = ["-c", "4096", "-np", "4", "--api-key", "upstream-secret"]
    with direct_llama_server(llama_server_bin, tiny_gguf, args, tmp_path / "llama.log") as url:
        upstream = SimpleNamespace(url=url)
        pool = make_pool([{**remote("r", upstream, "tiny"), "target_inflight": 4}],
                         env={"UPSTREAM_KEY": "upstream-secret"})

        def one(i: int) -> int:
            with httpx.stream("POST", pool.url + "/v1/chat/completions", timeout=60, json={
                    "model": "r", "stream": True, "max_tokens": 16,
                    "messages": [{"role": "user", "content": str(i)}]}) as r:
                r.read()
                return r.status_code
        with ThreadPoolExecutor(4) as ex:
            codes = list(ex.map(one, range(200)))
        assert codes == [200] * 200
