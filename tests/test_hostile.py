"""Hostile and unlucky clients against real workers: values the wire cannot
carry, bodies at the caps, clients that give up at any moment, prompts too big
to cancel. After each: nothing in flight or queued, no worker restarted, and a
normal request answered within a second."""

from __future__ import annotations

import asyncio
import json
import random
import socket
import time

import httpx
import psutil

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
    pool = make_pool([synthetic("syn", max_messages=10, max_prompt_chars=1000)])
    r = pool.http.post(CHAT, json={"model": "syn", "messages": [{"role": "user", "content": "m"}] * 11})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert "max_messages" in r.json()["error"]["message"]
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
    assert worker["last_exit_code"] == 1
    log = "\n".join(pool.http.get("/admin/models/tiny/logs", params={"lines": 500}).json()["lines"])
    assert "still busy" in log and "does not honour" in log
    assert pool.http.post(CHAT, json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                      "max_tokens": 2}).status_code == 200
