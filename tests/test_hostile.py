"""Hostile and unlucky clients against real workers: values the wire cannot
carry, bodies at the caps, clients that give up at any moment, prompts too big
to cancel. After each: nothing in flight or queued, no worker restarted, and a
normal request answered within a second."""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import json
import os
import random
import signal
import socket
import threading
import time
import tomllib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import psutil
import tomli_w
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import llama, synthetic
from tests.pool import wait_for

CHAT = "/v1/chat/completions"


def chat_body(content="hi", **extra) -> dict:
    return {"model": "syn", "messages": [{"role": "user", "content": content}], **extra}


def assert_settled(pool, model: str = "syn", restarts: int = 0) -> None:
    """Every slot back, nothing queued, no unplanned restart, and a normal request served fast."""
    wait_for(lambda: pool.model(model)["runtime_inflight"] == 0 and pool.model(model)["queue_depth"] == 0,
             20, what=f"{model}: nothing in flight or queued ({pool.model(model)})")
    workers = pool.workers(model)
    assert [w["inflight"] for w in workers] == [0] * len(workers)
    assert sum(w["restarts"] for w in workers) == restarts
    supervisor = psutil.Process(pool.proc.pid)
    assert supervisor.memory_info().rss < 400 * 2**20 and supervisor.num_fds() < 300
    started = time.monotonic()
    r = pool.http.post(CHAT, json={**chat_body("normal"), "model": model, "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert time.monotonic() - started < 1.0


def test_values_msgpack_cannot_carry_get_400_naming_the_field(make_pool):
    pool = make_pool([synthetic("syn", replicas=2, target_inflight=4, capacity=4)])
    raw_surrogate = '{"model":"syn","messages":[{"role":"user","content":"\\ud83d"}]}'
    for _ in range(8):  # once 8 of these took every slot for good
        r = pool.http.post(CHAT, json=chat_body(max_tokens=10**20))
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == "invalid_request" and r.json()["error"]["param"] == "max_tokens"
        r = pool.http.post(CHAT, content=raw_surrogate, headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "messages.0.content"
        assert "surrogate" in r.json()["error"]["message"]
        r = pool.http.post("/v1/responses", content='{"model":"syn","input":"a\\udc00b","stream":true}',
                           headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request", r.text
    assert_settled(pool)
    # a restart re-queues nothing poisoned and the dispatch loop still runs
    assert pool.http.post("/admin/models/syn/restart").status_code == 200
    assert_settled(pool, restarts=2)


def test_body_just_under_the_cap_runs_and_one_over_gets_413(make_pool):
    pool = make_pool([synthetic("syn", tokens=3, max_prompt_chars=8_000_000)])
    cap = 4 * 1024 * 1024
    overhead = len(json.dumps(chat_body("")))
    r = pool.http.post(CHAT, content=json.dumps(chat_body("x" * (cap - 10 - overhead))),
                       headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text  # once its Submit frame went over the frame cap and hung
    r = pool.http.post(CHAT, content=json.dumps(chat_body("x" * (cap + 10))),
                       headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert_settled(pool)


def test_prompt_bounds_per_model(make_pool):
    pool = make_pool([synthetic("syn", max_messages=10, max_prompt_chars=1000, max_content_parts=20)])
    r = pool.http.post(CHAT, json={"model": "syn", "messages": [{"role": "user", "content": "m"}] * 11})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert "max_messages" in r.json()["error"]["message"]
    parts = [{"type": "text", "text": "p"}] * 11  # 22 parts in two messages: over 20, each message under it
    r = pool.http.post(CHAT, json={"model": "syn", "messages": [{"role": "user", "content": parts}] * 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert "22 content parts" in r.json()["error"]["message"] and "max_content_parts (20)" in r.json()["error"]["message"]
    r = pool.http.post("/v1/responses", json={"model": "syn", "input": "y" * 1001})
    assert r.status_code == 400 and "max_prompt_chars" in r.json()["error"]["message"]
    assert pool.http.post(CHAT, json={"model": "syn", "messages": [{"role": "user", "content": "m"}] * 10,
                                      "max_tokens": 1}).status_code == 200
    assert_settled(pool)


async def _abandon_round(url: str, n: int, concurrency: int, rng: random.Random) -> dict[str, int]:
    """`n` requests, half streaming, each given up after 0-150 ms, `concurrency` at a time."""
    outcomes = {"done": 0, "abandoned": 0}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=30, limits=limits) as client:
        gate = asyncio.Semaphore(concurrency)

        async def one(i: int) -> None:
            body = chat_body(f"abandon {i}", stream=i % 2 == 0)

            async def run() -> None:
                if body["stream"]:
                    async with client.stream("POST", CHAT, json=body) as r:
                        async for _ in r.aiter_bytes():
                            pass
                else:
                    await client.post(CHAT, json=body)
            async with gate:
                try:
                    await asyncio.wait_for(run(), rng.uniform(0, 0.15))
                    outcomes["done"] += 1
                except TimeoutError:
                    outcomes["abandoned"] += 1
        await asyncio.gather(*(one(i) for i in range(n)))
    return outcomes


def test_clients_that_give_up_at_any_moment_leak_no_slot(make_pool):
    # slow tokens keep jobs in flight, so most clients leave mid-job, some right after admission
    pool = make_pool([synthetic("syn", replicas=2, target_inflight=4, capacity=4, tps=40, tokens=20,
                                max_queue=1000)])
    rng = random.Random(11)
    for round_no in range(3):
        outcomes = asyncio.run(_abandon_round(pool.url, 300, 100, rng))
        assert outcomes["abandoned"] > 100, outcomes
        assert_settled(pool)
        print(f"round {round_no}: {outcomes}")


def test_runtime_text_that_cannot_be_encoded_fails_that_job_only(make_pool):
    model = synthetic("syn", target_inflight=2, capacity=2, tps=20, tokens=10)
    model["options"].update(chaos="lone_surrogate", chaos_prompt="split")
    pool = make_pool([model])
    with httpx.Client(base_url=pool.url, timeout=30) as other:
        with httpx.stream("POST", pool.url + CHAT, timeout=30,
                          json=chat_body("fine", stream=True)) as fine:
            r = pool.http.post(CHAT, json=chat_body("split"))
            assert r.status_code == 502 and r.json()["error"]["code"] == "runtime_error", r.text
            text = "".join(fine.iter_text())
        assert text.rstrip().endswith("data: [DONE]")
        assert other.post(CHAT, json=chat_body("after")).status_code == 200
    assert_settled(pool)


def busy(proc: psutil.Process, window_s: float = 0.3) -> bool:
    """The process used at least half a core over the next `window_s`."""
    before = sum(proc.cpu_times()[:2])
    time.sleep(window_s)
    return sum(proc.cpu_times()[:2]) - before >= window_s / 2


def test_a_runtime_still_busy_after_a_cancel_is_restarted(make_pool, tiny_gguf, llama_server_bin):
    # llama-server applies the chat template in its HTTP thread, out of reach of a closed
    # connection: 100,000 messages keep it busy for tens of seconds after the client left
    pool = make_pool([llama("tiny", tiny_gguf, llama_server_bin, max_messages=100_000, cancel_grace_s=3)])
    [child] = pool.workers("tiny")[0]["children"]
    runtime = psutil.Process(child["pid"])
    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "x"}] * 100_000,
                       "max_tokens": 1}).encode()
    with socket.create_connection(("127.0.0.1", pool.port)) as client:
        client.sendall(f"POST {CHAT} HTTP/1.1\r\nHost: 127.0.0.1:{pool.port}\r\nContent-Type: "
                       f"application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        wait_for(lambda: pool.model("tiny")["runtime_inflight"] == 1, 60, what="the job reached its worker")
        wait_for(lambda: busy(runtime), 60, interval=0, what="llama-server working on it")
    # the client is gone; the slot frees at once, the runtime stays busy, and is restarted
    wait_for(lambda: pool.model("tiny")["runtime_inflight"] == 0, 10, what="slot freed")
    worker = wait_for(lambda: next((w for w in pool.workers("tiny") if w["restarts"] == 1
                                    and w["state"] == "ready"), None), 60, what="the busy runtime restarted")
    # its worker killed the runtime and exited: the runtime's exit is the one shown, the reason says who
    assert worker["last_exit_code"] == -signal.SIGKILL and worker["worker_exit_code"] == 1
    crash = [e for e in pool.http.get("/admin/events").json()["events"] if e["kind"] == "crashed"]
    assert crash and "by its worker: still busy" in crash[-1]["message"], crash
    log = "\n".join(pool.http.get("/admin/models/tiny/logs", params={"lines": 500}).json()["lines"])
    assert "still busy" in log and "does not honour" in log
    assert pool.http.post(CHAT, json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                      "max_tokens": 2}).status_code == 200


async def _drop_after_first_byte(url: str, n: int) -> int:
    """`n` streams at once, each closed as soon as its first bytes arrive."""
    async with httpx.AsyncClient(base_url=url, timeout=30,
                                 limits=httpx.Limits(max_connections=n, max_keepalive_connections=0)) as client:
        async def one(i: int) -> int:
            async with client.stream("POST", CHAT, json=chat_body(f"drop {i}", stream=True)) as r:
                async for _ in r.aiter_raw():
                    return r.status_code
            return r.status_code
        return sum(code == 200 for code in await asyncio.gather(*(one(i) for i in range(n))))


def test_streams_dropped_after_the_first_byte_free_their_slots_at_once(make_pool):
    pool = make_pool([synthetic("syn", replicas=2, target_inflight=8, capacity=8, tps=20, tokens=200,
                                max_queue=500)])
    assert asyncio.run(_drop_after_first_byte(pool.url, 200)) == 200
    # 200 jobs of 10 s each: only cancels can free the 16 slots this fast
    wait_for(lambda: pool.model("syn")["runtime_inflight"] == 0 and pool.model("syn")["queue_depth"] == 0,
             8, what="every slot back")
    assert_settled(pool)


async def _flood(url: str, n: int) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=url, timeout=60,
                                 limits=httpx.Limits(max_connections=n)) as client:
        return await asyncio.gather(*(client.post(CHAT, json=chat_body(f"flood {i}", max_tokens=4))
                                      for i in range(n)))


def test_a_flood_past_max_queue_gets_429_and_the_queue_drains(make_pool):
    # 500 connections from one address: over the per-client cap (256), which makes room by
    # closing idle ones; this test is about the queue, so the cap is raised here
    pool = make_pool([synthetic("syn", target_inflight=2, capacity=2, tps=200, max_queue=64)],
                     server={"max_connections_per_client": 600})
    responses = asyncio.run(_flood(pool.url, 500))
    codes = collections.Counter(r.status_code for r in responses)
    assert set(codes) <= {200, 429} and codes[429] > 0 and codes[200] >= 64, codes
    rejected = next(r for r in responses if r.status_code == 429)
    assert rejected.json()["error"]["code"] == "queue_full" and rejected.headers["retry-after"] == "1"
    assert_settled(pool)


def test_a_slow_reader_of_a_fast_stream_costs_no_memory(make_pool):
    # 200,000 tokens as fast as the worker makes them, read 16 KiB at a time with pauses
    pool = make_pool([synthetic("syn", tokens=200_000)])
    supervisor = psutil.Process(pool.proc.pid)
    rss_before = supervisor.memory_info().rss
    peak = rss_before
    with pool.http.stream("POST", CHAT, json=chat_body("slow", stream=True)) as r:
        for i, _ in enumerate(r.iter_raw(16 * 1024)):
            if i % 50 == 0:
                time.sleep(0.05)
                peak = max(peak, supervisor.memory_info().rss)
    assert peak - rss_before < 64 * 2**20, (rss_before, peak)
    assert_settled(pool)


# -- bounds on what one request or one runtime answer may make the supervisor hold (issue 22) ---------

class HostileUpstream(BaseHTTPRequestHandler):
    """An OpenAI-compatible upstream that answers a streamed chat request with
    what `script` (set per test) writes: a list of SSE data lines, sent until
    the client goes; a request whose text is "normal" gets a plain short answer.
    `written` counts the bytes of the script that got out."""
    script: list[bytes] = []
    written = 0

    def log_message(self, *args):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        if body.get("messages", [{}])[-1].get("content") == "normal":
            self.wfile.write(sse_line({"index": 0, "delta": {"content": "fine"}, "finish_reason": "stop"}))
            self.wfile.write(b"data: [DONE]\n\n")
            return
        try:
            for line in type(self).script:
                self.wfile.write(line)
                type(self).written += len(line)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the worker stopped the job


@contextlib.contextmanager
def hostile_upstream(script: list[bytes]):
    handler = type("Scripted", (HostileUpstream,), {"script": script, "written": 0})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield handler, f"http://127.0.0.1:{server.server_address[1]}/v1"
    finally:
        server.shutdown()
        server.server_close()


def sse_line(choice: dict) -> bytes:
    return f"data: {json.dumps({'id': 'c', 'object': 'chat.completion.chunk', 'choices': [choice]})}\n\n".encode()


def remote(name: str, base_url: str, **extra) -> dict:
    return {"name": name, "backend": "openai_remote", "target_inflight": 2,
            "options": {"base_url": base_url, "model": "upstream"}, **extra}


def streamed_words(body: str) -> int:
    """Words of content in a chat stream's body (deltas that piled up travel merged)."""
    chunks = [json.loads(line[6:]) for line in body.splitlines() if line.startswith("data: {")]
    return len("".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices")).split())


def stream_text(pool, model: str, **extra) -> tuple[int, str]:
    """A streamed chat request read to its end: (status, the body)."""
    with pool.http.stream("POST", CHAT, json={**chat_body("go", stream=True), "model": model, **extra}) as r:
        return r.status_code, r.read().decode()


def test_request_fields_past_openai_ranges_get_400_naming_the_field(make_pool):
    """top_logprobs 0-20, n 1-128, logit_bias up to 300 entries, a legacy completion's
    logprobs 0-5: one small request once made llama-server answer 178 MiB."""
    script = [sse_line({"index": 0, "delta": {"content": "ok"}, "finish_reason": "stop"}), b"data: [DONE]\n\n"]
    with hostile_upstream(script) as (_, url):  # an upstream that takes any field (as llama-server does)
        _fields_in_and_out_of_range(make_pool([remote("syn", url)]))


def _fields_in_and_out_of_range(pool) -> None:
    bias = {str(t): 1 for t in range(301)}
    for path, body, param in [
            (CHAT, chat_body(logprobs=True, top_logprobs=50_000), "top_logprobs"),
            (CHAT, chat_body(logprobs=True, top_logprobs=-1), "top_logprobs"),
            (CHAT, chat_body(top_logprobs="5"), "top_logprobs"),
            (CHAT, chat_body(n=129), "n"),
            (CHAT, chat_body(logit_bias=bias), "logit_bias"),
            ("/v1/completions", {"model": "syn", "prompt": "hi", "logprobs": 6}, "logprobs"),
            ("/v1/completions", {"model": "syn", "prompt": "hi", "logit_bias": bias}, "logit_bias"),
            ("/v1/completions", {"model": "syn", "prompt": ["a"] * 17, "n": 128}, "prompt"),
            ("/v1/responses", {"model": "syn", "input": "hi", "top_logprobs": 21}, "top_logprobs")]:
        r = pool.http.post(path, json=body)
        assert r.status_code == 400, (path, body.keys(), r.text)
        assert r.json()["error"]["code"] == "invalid_request" and r.json()["error"]["param"] == param, r.text
    in_range = dict(list(bias.items())[:300])
    for path, body in [(CHAT, chat_body(logprobs=True, top_logprobs=20, n=1, logit_bias=in_range)),
                       ("/v1/completions", {"model": "syn", "prompt": "hi", "logprobs": 5}),
                       ("/v1/responses", {"model": "syn", "input": "hi", "top_logprobs": 0})]:
        r = pool.http.post(path, json=body)
        assert r.status_code == 200, (path, body.keys(), r.text)
    assert_settled(pool)


def test_a_choice_index_past_n_is_the_jobs_protocol_error_not_an_allocation(make_pool):
    """One upstream chunk with index 3,000,000 once built 3,000,001 choices in the
    supervisor (1.8 GB, a 16 s stall that killed every worker of every model)."""
    script = [sse_line({"index": 3_000_000, "delta": {"content": "x"}, "finish_reason": None}),
              sse_line({"index": 0, "delta": {}, "finish_reason": "stop"}), b"data: [DONE]\n\n"]
    with hostile_upstream(script) as (_, url):
        pool = make_pool([remote("evil", url), synthetic("syn", tokens=40, tps=20)])
        supervisor = psutil.Process(pool.proc.pid)
        rss_before = supervisor.memory_info().rss
        with concurrent.futures.ThreadPoolExecutor(1) as bystander:
            innocent = bystander.submit(stream_text, pool, "syn")  # a stream of 2 s on another model
            for stream in (False, True):
                if stream:
                    status, body = stream_text(pool, "evil")  # before the first byte: a plain 502
                    assert status == 502 and '"code":"protocol_error"' in body and "choice index 3000000" in body
                else:
                    r = pool.http.post(CHAT, json={**chat_body("go"), "model": "evil"})
                    assert r.status_code == 502 and r.json()["error"]["code"] == "protocol_error", r.text
            status, body = innocent.result()
        assert status == 200 and streamed_words(body) == 40 and body.endswith("data: [DONE]\n\n")
        # generous: the bug held 1.8 GB; the choices of one request are a few KiB
        assert supervisor.memory_info().rss - rss_before < 64 * 2**20
        assert_settled(pool, "evil")
        assert_settled(pool, "syn")


def test_one_jobs_output_past_max_job_output_bytes_ends_that_job_only(make_pool):
    """An upstream that sends 48 MiB for one request: the job ends with 502
    runtime_error once it passes max_job_output_bytes (2 MiB here), its worker
    stops reading, and a stream on another model goes on untouched."""
    piece = "y" * 32 * 1024
    script = [sse_line({"index": 0, "delta": {"content": piece}, "finish_reason": None})] * 1536
    script += [sse_line({"index": 0, "delta": {}, "finish_reason": "stop"}), b"data: [DONE]\n\n"]
    total = sum(len(line) for line in script)
    with hostile_upstream(script) as (upstream, url):
        pool = make_pool([remote("flood", url), synthetic("syn", tokens=40, tps=20)],
                         server={"max_job_output_bytes": 2 * 2**20})
        supervisor = psutil.Process(pool.proc.pid)
        rss_before = supervisor.memory_info().rss
        with concurrent.futures.ThreadPoolExecutor(1) as bystander:
            innocent = bystander.submit(stream_text, pool, "syn")
            r = pool.http.post(CHAT, json={**chat_body("go"), "model": "flood"})
            assert r.status_code == 502 and r.json()["error"]["code"] == "runtime_error", r.text
            assert "max_job_output_bytes" in r.json()["error"]["message"]
            status, body = stream_text(pool, "flood")  # past the first byte: an error event ends it
            assert status == 200 and '"code":"runtime_error"' in body and "max_job_output_bytes" in body
            assert '"finish_reason":"stop"' not in body and body.count(piece) <= 64
            status, text = innocent.result()
        assert status == 200 and streamed_words(text) == 40 and text.endswith("data: [DONE]\n\n")
        # generous: one job may hold 2 MiB (and its JSON); without the budget it held all 48 MiB, twice
        assert supervisor.memory_info().rss - rss_before < 48 * 2**20
        wait_for(lambda: pool.model("flood")["runtime_inflight"] == 0, 20, what="the flood jobs stopped")
        assert upstream.written < total  # the worker stopped reading: the upstream could not send it all
        assert_settled(pool, "syn")


def test_client_text_echoed_in_errors_is_cut(make_pool):
    """A 1,000,000-character model name once came back whole in the 404, and into the request log."""
    pool = make_pool([synthetic("syn", tokens=2)])
    name = "m" * 1_000_000
    r = pool.http.post(CHAT, json={**chat_body(), "model": name})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    message = r.json()["error"]["message"]
    assert len(message) < 400 and "999744 more characters" in message
    # a tool type the runtime would skip is skipped, never a 400 (as llama-server does): the answer
    # names it, cut, in its header
    r = pool.http.post("/v1/responses", json={"model": "syn", "input": "hi", "tools": [{"type": "t" * 100_000}]})
    skipped = r.headers["x-llm-pool-skipped-tools"]
    assert r.status_code == 200 and skipped.startswith("ttt") and len(skipped) <= 420, (r.status_code, skipped[:500])
    r = pool.http.post(CHAT, content=json.dumps({**chat_body(), "metadata": {"k" * 100_000: "\ud800"}}),
                       headers={"content-type": "application/json"})  # a lone surrogate under a long key
    assert r.status_code == 400 and len(r.json()["error"]["message"]) < 600 and len(r.json()["error"]["param"]) < 400
    missing = wait_for(lambda: next((row for row in pool.http.get("/admin/requests").json()["requests"]
                                     if row["status"] == 404), None), 5, what="the 404 in the request log")
    assert len(missing["error_message"]) < 1200 and len(missing["model"]) < 300
    assert_settled(pool)


def test_the_supervisor_reports_its_event_loop_lag(make_pool):
    """A stopped loop (SIGSTOP here: as a blocking call would) shows on /metrics as a
    gauge and a histogram, and as a warning in the log past 1 s."""
    pool = make_pool([synthetic("syn", tokens=2)])
    metrics = pool.http.get("/metrics").text
    assert "llm_pool_event_loop_lag_seconds " in metrics
    assert 'llm_pool_event_loop_lag_distribution_seconds_bucket{le="1.0"}' in metrics
    os.kill(pool.proc.pid, signal.SIGSTOP)
    try:
        time.sleep(1.5)  # a stall to measure (the workers wait liveness_s, 5 s, before they give up)
    finally:
        os.kill(pool.proc.pid, signal.SIGCONT)

    def over_a_second() -> float:
        samples = {s.name + str(s.labels): s.value for family in text_string_to_metric_families(
            pool.http.get("/metrics").text) for s in family.samples}
        count = samples["llm_pool_event_loop_lag_distribution_seconds_count{}"]
        return count - samples["llm_pool_event_loop_lag_distribution_seconds_bucket{'le': '1.0'}"]
    wait_for(over_a_second, 5, what="a lag measure over 1 s")
    wait_for(lambda: "the event loop was blocked for 1." in pool.log(), 5, what="the warning in the log")
    assert_settled(pool)


def test_a_renamed_models_old_name_reaches_it_as_an_alias_while_the_old_one_drains(make_pool):
    """Reload renaming x to y with aliases = ["x"] while x drains a long job:
    requests for x once got 404 for the whole drain."""
    x = synthetic("x", tps=10, tokens=40)  # a 4 s job keeps x draining
    pool = make_pool([x])
    with pool.http.stream("POST", CHAT, json={**chat_body("long", stream=True), "model": "x"}) as long_job:
        lines = long_job.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        config = tomllib.loads(pool.config_path.read_text())
        config["models"] = [{**x, "name": "y", "aliases": ["x"], "options": {**x["options"], "tokens_per_second": 0}}]
        pool.config_path.write_text(tomli_w.dumps(config))
        r = pool.http.post("/admin/reload")
        assert r.status_code == 200 and r.json()["added"] == ["y"] and r.json()["removed"] == ["x"], r.text
        wait_for(lambda: pool.model("y")["state"] == "loaded", 15, what="y loaded")
        assert pool.model("x")["state"] == "unloading"  # still draining the long job
        r = pool.http.post(CHAT, json={**chat_body(), "model": "x", "max_tokens": 2})
        assert r.status_code == 200, r.text
        assert pool.model("x")["state"] == "unloading"  # served by y during the drain
        rest = "".join(lines)
    assert rest.endswith("[DONE]")  # the draining job finished whole
    wait_for(lambda: "x" not in pool.models(), 15, what="x gone")
    assert pool.http.post(CHAT, json={**chat_body(), "model": "x", "max_tokens": 2}).status_code == 200
