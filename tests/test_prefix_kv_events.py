"""A real worker that reports its cache (the synthetic backend's `kv_events` chaos:
it claims KV events, as a vLLM worker relaying them does) sends malformed KV
events with every job: the supervisor skips and counts them, keeps the worker,
keeps serving, and takes the well-formed events that follow. (The events of a
real engine: tests/test_vllm_serve.py; the decoder and index: tests/test_kv_index.py.)"""

from __future__ import annotations

import httpx

from runtime_worker.backends.synthetic import KV_CHAOS_EVENTS
from tests.conftest import synthetic
from tests.pool import wait_for


def test_malformed_kv_events_are_skipped_not_fatal(make_pool):
    model = synthetic("syn", replicas=2, target_inflight=2, capacity=2, routing="prefix")
    model["options"]["chaos"] = "kv_events"
    pool = make_pool([model])
    for i in range(4):
        r = httpx.post(pool.url + "/v1/chat/completions", timeout=30, json={
            "model": "syn", "messages": [{"role": "user", "content": f"hello {i}"}]})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]

    def indexes() -> list[dict]:
        return [w["routing"].get("kv_index") or {} for w in pool.workers("syn")]
    # every job's events were applied: its malformed ones counted, then a reset and one good block
    wait_for(lambda: sum(i.get("resets", 0) for i in indexes()) == 4, 10, what="4 jobs' KV events applied")
    kv = indexes()
    assert sum(i["malformed"] for i in kv) == 4 * len(KV_CHAOS_EVENTS)  # each one skipped, none fatal
    assert all(i["blocks"] == 1 for i in kv if i)  # after each reset: the one well-formed block
    workers = pool.workers("syn")
    assert [w["restarts"] for w in workers] == [0, 0] and all(w["protocol_errors"] == 0 for w in workers)
    text = httpx.get(pool.url + "/metrics").text
    assert "llm_pool_kv_index_resets_total" in text and "llm_pool_kv_index_blocks" in text
