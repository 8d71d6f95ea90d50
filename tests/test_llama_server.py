"""A real llama-server, launched by the worker, driven through the pool.

The model is a tiny random-weight GGUF made by the test; its text is noise,
so assertions are about token counts, finish reasons, usage and processes."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import psutil
import pytest

from tests.conftest import IGNORE_EOS, llama
from tests.pool import wait_for
from tests.procs import frozen

pytestmark = pytest.mark.llama


def sse_events(response: httpx.Response):
    for line in response.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[6:])


def llama_child(pool, model: str) -> psutil.Process:
    worker = pool.workers(model)[0]
    [child] = [c for c in worker["children"] if c["name"] == "llama-server"]
    return psutil.Process(child["pid"])


def test_sdk_calls_through_llama_server(make_pool, tiny_gguf, llama_server_bin):
    pool = make_pool([llama("tiny", tiny_gguf, llama_server_bin, slots=2)])
    client = openai.OpenAI(base_url=pool.url + "/v1", api_key="unused", max_retries=0)

    # temperature 0 on the seeded random weights: the same tokens every run, no early EOS
    r = client.responses.create(model="tiny", input="hello", max_output_tokens=12, temperature=0)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 12 and r.usage.input_tokens > 0

    # no max_output_tokens: the model stops at its own EOS, so the stream ends "completed"
    deltas = 0
    with client.responses.stream(model="tiny", input="stream") as stream:
        for event in stream:
            deltas += event.type == "response.output_text.delta"
        final = stream.get_final_response()
    assert final.status == "completed" and final.usage.output_tokens >= deltas >= 1
    assert final.output_text == "".join(
        part.text for item in final.output for part in item.content)

    chat = client.chat.completions.create(model="tiny", max_tokens=7, temperature=0,
                                          messages=[{"role": "user", "content": "hi"}])
    assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == 7

    chunks = list(client.chat.completions.create(model="tiny", max_tokens=9, stream=True, temperature=0,
                                                 messages=[{"role": "user", "content": "hi"}],
                                                 stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens == 9

    # the runtime's own key is not in its argv (world-readable through ps), and without it
    # the runtime refuses a direct request: only the pool, with its slot count, gets in
    child = llama_child(pool, "tiny")
    port = pool.workers("tiny")[0]["runtime_info"]["port"]
    assert "--api-key" not in child.cmdline()
    direct = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=30,
                        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
    assert direct.status_code == 401
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"

    worker = pool.workers("tiny")[0]
    assert worker["capacity"] == 2 and worker["runtime_capacity"] == 2  # /props total_slots
    assert [c["name"] for c in worker["children"]] == ["llama-server"]


def test_concurrency_up_to_slots_and_no_further(make_pool, tiny_gguf, llama_server_bin):
    """Two generations fill both slots, then two more wait in the queue, never a third in
    flight; all four are served in full. llama-server is held (frozen) while the four arrive
    and the pool is looked at, so the full-and-queued state is there to be seen on any
    machine, and nothing is timed: the work is a few hundred tokens."""
    pool = make_pool([llama("tiny", tiny_gguf, llama_server_bin, slots=2, extra_args=IGNORE_EOS)])
    cap = pool.model("tiny")["effective_target_inflight"]
    assert cap == pool.workers("tiny")[0]["runtime_capacity"] == 2  # /props total_slots
    long, short = 600, 50
    peak = {"inflight": 0}

    def request(i, tokens):
        return httpx.post(pool.url + "/v1/chat/completions", timeout=300, json={
            "model": "tiny", "max_tokens": tokens, "messages": [{"role": "user", "content": f"q{i}"}]})

    def sample(inflight, queued):
        def check():
            v = pool.model("tiny")
            peak["inflight"] = max(peak["inflight"], v["runtime_inflight"])
            assert v["runtime_inflight"] <= cap
            return v["runtime_inflight"] == inflight and v["queue_depth"] == queued
        return check

    with ThreadPoolExecutor(cap + 2) as ex:
        with frozen(llama_child(pool, "tiny")):
            futures = [ex.submit(request, i, long) for i in range(cap)]
            wait_for(sample(cap, 0), 60, what="both slots busy")
            futures += [ex.submit(request, cap + i, short) for i in range(2)]
            wait_for(sample(cap, 2), 60, what="slots full and 2 queued")
        results = [f.result() for f in futures]
    assert [r.status_code for r in results] == [200] * (cap + 2)
    assert [r.json()["usage"]["completion_tokens"] for r in results] == [long] * cap + [short] * 2
    assert peak["inflight"] == cap


def test_unload_drains_a_real_generation(make_pool, tiny_gguf, llama_server_bin):
    """An unload while a generation is in the runtime waits for it: the generation runs to its
    end, then llama-server stops. llama-server is held (frozen) from before the request until
    the unload is seen in progress, so the job is in the runtime and unfinished on any machine,
    however late this client gets to look; then it is let go and runs out."""
    pool = make_pool([llama("tiny", tiny_gguf, llama_server_bin, extra_args=IGNORE_EOS)])
    child = llama_child(pool, "tiny")
    tokens = 400
    with ThreadPoolExecutor(2) as ex:
        with frozen(child):
            running = ex.submit(httpx.post, pool.url + "/v1/responses", timeout=300, json={
                "model": "tiny", "input": "x", "max_output_tokens": tokens})
            wait_for(lambda: pool.model("tiny")["runtime_inflight"] == 1, 60, what="submitted")
            unload = ex.submit(pool.http.post, "/admin/models/tiny/unload", timeout=300)  # waits out the drain
            wait_for(lambda: pool.model("tiny")["state"] == "unloading", 60, what="unloading")
            assert child.is_running() and pool.model("tiny")["runtime_inflight"] == 1  # still ours
            assert not running.done() and not unload.done()
        r = running.result()
        assert r.status_code == 200, r.text
        assert r.json()["status"] == "incomplete"  # it ran to max_output_tokens
        assert r.json()["usage"]["output_tokens"] == tokens
        assert unload.result().json()["state"] == "unloaded"
    wait_for(lambda: not child.is_running() or child.status() == psutil.STATUS_ZOMBIE, 10,
             what="llama-server gone")


def test_cancelled_stream_frees_its_slot(make_pool, tiny_gguf, llama_server_bin):
    pool = make_pool([llama("tiny", tiny_gguf, llama_server_bin, extra_args=IGNORE_EOS)])
    child = llama_child(pool, "tiny")
    with httpx.stream("POST", pool.url + "/v1/chat/completions", timeout=120, json={
            "model": "tiny", "stream": True, "max_tokens": 15000,
            "messages": [{"role": "user", "content": "x"}]}) as r:
        events = sse_events(r)
        while not next(events)["choices"][0]["delta"].get("content"):
            pass
        assert pool.model("tiny")["runtime_inflight"] == 1
    wait_for(lambda: pool.model("tiny")["runtime_inflight"] == 0, 10, what="slot freed")
    # llama-server itself stopped generating: within seconds it burns (almost) no CPU
    # (15,000 tokens keep it busy for 5 s or more: longer than the deadline)
    def quiet() -> bool:
        before = sum(child.cpu_times()[:2])
        time.sleep(0.5)
        return sum(child.cpu_times()[:2]) - before < 0.15
    wait_for(quiet, 3, interval=0, what="llama-server idle after the cancel")
    r = pool.http.post("/v1/chat/completions", json={
        "model": "tiny", "max_tokens": 5, "messages": [{"role": "user", "content": "again"}]})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5


def test_failed_loads_report_llama_server_errors(make_pool, tiny_gguf, llama_server_bin, tmp_path):
    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x00garbage" * 64)
    pool = make_pool([
        llama("missing", str(tmp_path / "nope.gguf"), llama_server_bin, load_on_start=False),
        llama("corrupt", str(corrupt), llama_server_bin, load_on_start=False),
        llama("good", tiny_gguf, llama_server_bin),
    ])
    r = pool.http.post("/admin/models/missing/load")
    assert r.status_code == 503 and r.json()["error"]["code"] == "load_failed"
    assert "model file not found" in r.json()["error"]["message"]
    r = pool.http.post("/admin/models/corrupt/load")
    assert r.status_code == 503
    assert "failed to load model" in r.json()["error"]["message"]  # llama-server's own words
    view = pool.model("corrupt")
    assert view["state"] == "failed" and "failed to load model" in view["error"]
    # the failed load's replica stays listed, with llama-server's words and no process (operators look there)
    [left] = pool.workers("corrupt")
    assert left["pid"] is None and "failed to load model" in (left["last_error"] or ""), left
    r = pool.http.post("/v1/chat/completions", json={
        "model": "good", "max_tokens": 3, "messages": [{"role": "user", "content": "still fine"}]})
    assert r.status_code == 200
    r = pool.http.post("/v1/responses", json={"model": "corrupt", "input": "x"})  # loads on demand: fails again
    assert r.status_code == 503 and r.json()["error"]["code"] == "load_failed"
    assert "failed to load model" in r.json()["error"]["message"]


def test_live_tokens_count_tokens_not_chunks(make_pool, tiny_gguf, llama_server_bin):
    """The live tokens/s counts what llama-server made, token by token as the deltas
    carry it (its per-chunk timings), not the worker's messages, which join many
    chunks: nothing is left for the job's end to add in one spike."""
    pool = make_pool([llama("tiny", tiny_gguf, llama_server_bin, extra_args=IGNORE_EOS)])
    worker = psutil.Process(pool.workers("tiny")[0]["pid"])
    chunks = 0
    with httpx.stream("POST", pool.url + "/v1/chat/completions", timeout=60, json={
            "model": "tiny", "max_tokens": 400, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "messages": [{"role": "user", "content": "count"}]}) as r:
        for chunk in sse_events(r):
            if not chunks and any(c["delta"].get("content") for c in chunk["choices"]):
                # the worker held a moment after the first token: what llama-server makes meanwhile
                # reaches it at once and leaves as one message (as on a busy machine), many tokens in it
                with frozen(worker):
                    time.sleep(0.5)
            chunks += any(c["delta"].get("content") for c in chunk["choices"])
            usage = chunk.get("usage") or {}
    assert usage["completion_tokens"] == 400 and 0 < chunks < 400  # the pool's chunks join several tokens
    worker = pool.workers("tiny")[0]
    assert worker["output_tokens"] == 400
    assert worker["output_tokens_at_end"] == 0
