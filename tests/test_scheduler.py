"""Scheduler semantics end to end: capacity, replicas, unload, streaming, disconnects.

Durations here are lower bounds set by the synthetic generator's schedule
(a job of N tokens at R tokens/s cannot finish before N/R seconds), so the
assertions hold however slow or loaded the machine is."""

from __future__ import annotations

import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil

from runtime_worker.backends.synthetic import synthetic_tokens
from tests.conftest import synthetic
from tests.pool import wait_for


def post(pool, model: str, text: str = "x", timeout: float = 60, **body) -> tuple[httpx.Response, float]:
    started = time.monotonic()
    r = httpx.post(pool.url + "/v1/responses", json={"model": model, "input": text, **body}, timeout=timeout)
    return r, time.monotonic() - started


def test_target_inflight_1_runs_one_job_at_a_time(make_pool):
    job_s = 9 / 20  # 10 tokens at 20/s: the last one 9 intervals after the first
    pool = make_pool([synthetic("one", tps=20, tokens=10)])
    with ThreadPoolExecutor(3) as ex:
        results = list(ex.map(lambda i: post(pool, "one", f"q{i}"), range(3)))
    assert all(r.status_code == 200 for r, _ in results)
    latencies = sorted(t for _, t in results)
    # serial: the k-th finisher waited for k-1 whole jobs before its own
    for k, t in enumerate(latencies):
        assert t >= (k + 1) * job_s * 0.95, latencies


def test_configured_4_against_runtime_capacity_2(make_pool):
    pool = make_pool([synthetic("m", target_inflight=4, capacity=2, tps=20, tokens=20)])
    view = pool.model("m")
    assert (view["configured_target_inflight"], view["effective_target_inflight"]) == (4, 2)
    peak = {"inflight": 0, "queued": 0}
    with ThreadPoolExecutor(5) as ex:
        futures = [ex.submit(post, pool, "m", f"q{i}") for i in range(5)]

        def sample():
            v = pool.model("m")
            peak["inflight"] = max(peak["inflight"], v["runtime_inflight"])
            peak["queued"] = max(peak["queued"], v["queue_depth"])
            return all(f.done() for f in futures)
        wait_for(sample, 30, what="all requests")
    results = [f.result() for f in futures]
    assert all(r.status_code == 200 for r, _ in results)
    assert peak["inflight"] == 2 and peak["queued"] >= 1, peak
    latencies = sorted(t for _, t in results)
    assert latencies[2] >= 2 * (19 / 20) * 0.95, latencies  # the third job waited for a whole job


def test_two_replicas_share_load_and_admin_aggregates(make_pool):
    pool = make_pool([synthetic("r2", replicas=2, tps=10, tokens=20)])
    with ThreadPoolExecutor(4) as ex:
        futures = [ex.submit(post, pool, "r2", f"q{i}") for i in range(4)]
        wait_for(lambda: [w["inflight"] for w in pool.workers("r2")] == [1, 1], 10,
                 what="one job on each replica")
        view = wait_for(lambda: (v := pool.model("r2"))["queue_depth"] == 2 and v, 10, what="2 queued")
        assert view["runtime_inflight"] == 2 and view["effective_target_inflight"] == 2
        assert all(f.result()[0].status_code == 200 for f in futures)
    pids = {w["pid"] for w in pool.workers("r2")}
    assert len(pids) == 2 and all(psutil.pid_exists(p) for p in pids)


def test_unload_drains_submitted_and_rejects_queued_and_new(make_pool):
    pool = make_pool([synthetic("u", tps=20, tokens=40)])  # one job: 2 s
    worker_pid = pool.workers("u")[0]["pid"]
    with ThreadPoolExecutor(4) as ex:
        running = ex.submit(post, pool, "u", "first")
        wait_for(lambda: pool.model("u")["runtime_inflight"] == 1, 10, what="job submitted")
        queued = [ex.submit(post, pool, "u", f"q{i}") for i in range(2)]
        wait_for(lambda: pool.model("u")["queue_depth"] == 2, 10, what="2 queued")
        unload = ex.submit(pool.http.post, "/admin/models/u/unload")
        wait_for(lambda: pool.model("u")["state"] == "unloading", 10, what="unloading")
        late, _ = post(pool, "u", "late")
        assert late.status_code == 503 and late.json()["error"]["code"] == "model_unloading"
        for f in queued:
            r, _ = f.result()
            assert r.status_code == 503 and r.json()["error"]["code"] == "model_unloading"
        r, _ = running.result()
        assert r.status_code == 200 and r.json()["usage"]["output_tokens"] == 40  # not cut short
        assert unload.result().status_code == 200
    view = pool.model("u")
    assert view["state"] == "unloaded" and view["runtime_inflight"] == 0 and view["queue_depth"] == 0
    wait_for(lambda: not psutil.pid_exists(worker_pid), 10, what="worker exit")
    assert pool.workers("u") == []
    after, _ = post(pool, "u")  # load on demand brings it back
    assert after.status_code == 200 and pool.model("u")["state"] == "loaded"


def sse_events(response: httpx.Response):
    for line in response.iter_lines():
        if line.startswith("data: "):
            yield json.loads(line[6:])


def test_streaming_is_token_by_token(make_pool):
    pool = make_pool([synthetic("s", tps=10, tokens=20)])  # 2 s of generation
    with httpx.stream("POST", pool.url + "/v1/responses", timeout=30,
                      json={"model": "s", "input": "x", "stream": True}) as r:
        started = time.monotonic()
        arrivals = [(time.monotonic() - started, e["type"]) for e in sse_events(r)]
    deltas = [t for t, kind in arrivals if kind == "response.output_text.delta"]
    assert len(deltas) == 20 and arrivals[-1][1] == "response.completed"
    # the first token reached us while the generator still had 19 tokens (>= 1.9 s) to go
    assert deltas[-1] - deltas[0] >= 1.9 * 0.95


def test_quiet_stream_gets_pings_between_tokens(make_pool):
    pool = make_pool([synthetic("s", tps=2, tokens=3)], server={"sse_ping_s": 0.1})  # 0.5 s between tokens
    with httpx.stream("POST", pool.url + "/v1/chat/completions", timeout=30,
                      json={"model": "s", "stream": True, "messages": [{"role": "user", "content": "x"}]}) as r:
        lines = [line for line in r.iter_lines() if line]
    kinds = ["ping" if line == ": ping" else "done" if line == "data: [DONE]" else "data" for line in lines]
    assert kinds[-1] == "done" and kinds.count("ping") >= 2
    # pings only between events, never inside one: every other line is a whole JSON chunk
    text = "".join(json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                   for line in lines if line.startswith("data: {"))
    assert text == "".join(synthetic_tokens("x", 3))


def test_disconnect_removes_queued_and_cancels_submitted(make_pool):
    pool = make_pool([synthetic("d", tps=10, tokens=100)])  # one job: 10 s
    # a submitted streaming job: read one delta, then hang up
    with httpx.stream("POST", pool.url + "/v1/responses", timeout=30,
                      json={"model": "d", "input": "a", "stream": True}) as r:
        events = sse_events(r)  # not closed until we leave the block
        while next(events)["type"] != "response.output_text.delta":
            pass
        assert pool.model("d")["runtime_inflight"] == 1
        # a queued non-streaming job whose client hangs up while it waits
        body = json.dumps({"model": "d", "input": "b"}).encode()
        with socket.create_connection(("127.0.0.1", pool.port)) as queued:
            queued.sendall(b"POST /v1/responses HTTP/1.1\r\nHost: pool\r\nContent-Type: application/json\r\n"
                           b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            wait_for(lambda: pool.model("d")["queue_depth"] == 1, 5, what="the second job queued")
        # it leaves the queue while the first job still holds the only slot
        wait_for(lambda: pool.model("d")["queue_depth"] == 0, 5, what="the abandoned job removed")
        assert pool.model("d")["runtime_inflight"] == 1
    # the worker stopped the submitted one long before its 10 s
    wait_for(lambda: pool.model("d")["runtime_inflight"] == 0, 5, what="slot free")
    assert pool.model("d")["queue_depth"] == 0
    r, _ = post(pool, "d", "c", max_output_tokens=2)
    assert r.status_code == 200 and r.json()["usage"]["output_tokens"] == 2


def test_disconnect_of_non_streaming_submitted_job_frees_slot(make_pool):
    pool = make_pool([synthetic("n", tps=10, tokens=100)])
    try:
        httpx.post(pool.url + "/v1/chat/completions", timeout=1.0,
                   json={"model": "n", "messages": [{"role": "user", "content": "x"}]})
    except httpx.ReadTimeout:
        pass
    wait_for(lambda: pool.model("n")["runtime_inflight"] == 0, 5, what="slot freed")


def test_bad_requests_get_envelopes_and_server_keeps_serving(make_pool):
    pool = make_pool([synthetic("ok"), synthetic("idle", load_on_start=False, load_on_demand=False)])
    cases = [
        ({"input": "x"}, 400, "invalid_request", "model"),
        ({"model": "ok"}, 400, "invalid_request", "input"),
        ({"model": 5, "input": "x"}, 400, "invalid_request", "model"),
        ({"model": "ok", "input": "x", "stream": "yes"}, 400, "invalid_request", "stream"),
        ({"model": "ok", "input": "x", "max_output_tokens": -1}, 400, "invalid_request", "max_output_tokens"),
        ({"model": "ok", "input": [{"role": "wizard", "content": "x"}]}, 400, "invalid_request", None),
        ({"model": "nope", "input": "x"}, 404, "model_not_found", "model"),
        ({"model": "idle", "input": "x"}, 409, "model_not_loaded", "model"),
    ]
    for body, status, code, param in cases:
        r = pool.http.post("/v1/responses", json=body)
        assert r.status_code == status, (body, r.text)
        err = r.json()["error"]
        assert err["code"] == code and err["message"], (body, err)
        if param:
            assert err["param"].startswith(param), (body, err)
    for raw in (b"{not json", b"[]", b""):
        r = pool.http.post("/v1/responses", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request", raw
    r = pool.http.post("/v1/chat/completions", json={"model": "ok", "messages": []})
    assert r.status_code == 400
    assert pool.http.get("/no/such/path").status_code == 404
    r, _ = post(pool, "ok", "still serving")
    assert r.status_code == 200 and r.json()["status"] == "completed"
