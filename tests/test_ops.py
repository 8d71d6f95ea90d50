"""Ops and security surfaces: /metrics against the admin view, keys, body cap."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import synthetic
from tests.pool import wait_for


def scrape(pool) -> dict[tuple, float]:
    samples = {}
    for family in text_string_to_metric_families(pool.http.get("/metrics").text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def value(samples, name, **labels) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def test_metrics_match_the_admin_view_under_load(make_pool):
    pool = make_pool([synthetic("m", target_inflight=4, capacity=2, tps=20, tokens=20, max_queue=10),
                      synthetic("other", replicas=2)])
    with ThreadPoolExecutor(5) as ex:
        futures = [ex.submit(httpx.post, pool.url + "/v1/responses", timeout=60,
                             json={"model": "m", "input": str(i), "stream": i % 2 == 0}) for i in range(5)]
        wait_for(lambda: pool.model("m")["queue_depth"] == 3, 10, what="3 queued")
        samples, view = scrape(pool), pool.model("m")
        assert value(samples, "llm_pool_queue_depth", model="m") == view["queue_depth"] == 3
        assert value(samples, "llm_pool_inflight", model="m") == view["runtime_inflight"] == 2
        assert value(samples, "llm_pool_configured_capacity", model="m") == 4
        assert value(samples, "llm_pool_effective_capacity", model="m") == 2
        assert all(f.result().status_code == 200 for f in futures)
    pool.http.post("/v1/responses", json={"model": "nope", "input": "x"})
    samples = scrape(pool)
    assert value(samples, "llm_pool_requests_total", model="m", endpoint="responses", status="200") == 5
    assert value(samples, "llm_pool_requests_total", model="unknown", endpoint="responses", status="404") == 1
    assert value(samples, "llm_pool_generated_tokens_total", model="m") == 5 * 20
    # streams only (3 of the 5): a whole answer has no first token for its client (issue 58)
    assert value(samples, "llm_pool_time_to_first_token_seconds_count", model="m") == 3
    assert value(samples, "llm_pool_request_duration_seconds_count", model="m") == 5
    # every request took at least its 19 token intervals at 20/s
    assert value(samples, "llm_pool_request_duration_seconds_bucket", model="m", le="0.5") == 0
    for w in pool.workers():
        key = dict(model=w["model"], replica=str(w["replica"]))
        assert value(samples, "llm_pool_worker_up", **key) == 1
        assert value(samples, "llm_pool_worker_restarts_total", reason="crash", **key) == 0
        assert value(samples, "llm_pool_worker_restarts_total", reason="planned", **key) == 0
        rss = value(samples, "llm_pool_process_rss_bytes", process="worker", **key)
        assert 0.5 < rss / psutil.Process(w["pid"]).memory_info().rss < 2
    supervisor_rss = value(samples, "llm_pool_process_rss_bytes", model="", replica="", process="supervisor")
    assert 0.5 < supervisor_rss / psutil.Process(pool.proc.pid).memory_info().rss < 2


def test_inference_and_admin_keys_are_separate(make_pool):
    pool = make_pool([synthetic("k")], server={"api_key": "infer-key", "admin_key": "admin-key"})

    def call(method, path, key=None, **kw):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return pool.http.request(method, path, headers=headers, **kw)

    body = {"json": {"model": "k", "input": "x"}}
    for key, status in ((None, 401), ("wrong", 401), ("infer-key", 200), ("admin-key", 200)):
        r = call("POST", "/v1/responses", key, **body)
        assert r.status_code == status, (key, r.text)
        if status == 401:
            assert r.json()["error"]["code"] == "unauthorized"
    for key, status in ((None, 401), ("infer-key", 401), ("admin-key", 200)):
        assert call("GET", "/admin/models", key).status_code == status, key
        assert call("GET", "/admin/workers", key).status_code == status, key
    assert call("POST", "/admin/models/k/unload", "infer-key").status_code == 401
    assert call("GET", "/health").status_code == 200 and call("GET", "/ready").status_code == 200
    r = httpx.get(pool.url + "/v1/models", headers={"x-api-key": "infer-key"})
    assert r.status_code == 200


def test_request_body_is_capped(make_pool):
    pool = make_pool([synthetic("c")], server={"max_body_bytes": 4096})
    r = pool.http.post("/v1/responses", json={"model": "c", "input": "x" * 10_000})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunked():
        yield b'{"model": "c", "input": "'
        for _ in range(10):
            yield b"x" * 1000
        yield b'"}'
    r = pool.http.post("/v1/responses", content=chunked(), headers={"content-type": "application/json"})
    assert r.status_code == 413
    assert pool.http.post("/v1/responses", json={"model": "c", "input": "small"}).status_code == 200


def test_process_sampler_samples_off_the_loop_and_keeps_only_live_processes():
    """The sampler reads the supervisor's children (here: this process's) in its own
    thread, and keeps a psutil handle per child (for cpu_percent); the handles of
    exited ones must go, or the cache grows with every restart."""
    import asyncio
    import select
    import subprocess
    import sys
    import threading

    from supervisor.replicas.observe import ProcessSampler

    # each child says when its interpreter is up: a sample taken while one still starts sees
    # a fraction of the memory it settles at
    procs = [subprocess.Popen([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"],
                              stdout=subprocess.PIPE) for _ in range(3)]
    sampler = ProcessSampler(period_s=60)  # passes on demand only, in this test
    passes = []
    take = sampler._take
    sampler._take = lambda: passes.append(threading.current_thread()) or take()

    async def go():
        await sampler.fresh()
        assert {p.pid for p in procs} <= sampler.sample.views.keys() <= sampler._trees.procs.keys()
        view = sampler.view(procs[0].pid)
        assert 0.5 < view["rss_bytes"] / psutil.Process(procs[0].pid).memory_info().rss < 2
        assert 0.5 < sampler.sample.supervisor_rss / psutil.Process().memory_info().rss < 2
        for proc in procs[1:]:
            proc.kill()
            proc.wait()
        await asyncio.gather(sampler.fresh(), sampler.fresh())  # each: a pass begun after it asked
        assert procs[0].pid in sampler._trees.procs and procs[0].pid in sampler.sample.views
        assert not {p.pid for p in procs[1:]} & (sampler._trees.procs.keys() | sampler.sample.views.keys())
    try:
        for proc in procs:
            assert select.select([proc.stdout], [], [], 30)[0], "a child did not start within 30 s"
            assert proc.stdout.readline() == b"up\n"
        asyncio.run(go())
        assert passes and all(t is sampler._thread and t is not threading.main_thread() for t in passes)
    finally:
        sampler.stop()
        for proc in procs:
            proc.kill()
            proc.wait()
            proc.stdout.close()


def test_process_sampler_passes_on_its_period_and_outlives_a_failed_pass():
    from supervisor.replicas.observe import ProcessSampler

    sampler = ProcessSampler(period_s=0.05)
    take, calls = sampler._take, []

    def failing_once():
        calls.append(1)
        if len(calls) == 1:
            raise psutil.AccessDenied()
        return take()
    sampler._take = failing_once
    sampler.start()
    try:
        first = wait_for(lambda: sampler.sample.supervisor_rss and sampler.sample.taken_at, 5,
                         what="a pass after the failed one")
        wait_for(lambda: sampler.sample.taken_at > first, 5, what="a pass on the period alone")
    finally:
        sampler.stop()
    sampler._thread.join(5)
    assert not sampler._thread.is_alive()
