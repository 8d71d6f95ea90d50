"""Models come and go on their own (issue 14), with real workers: load on
demand, waiting during a load, a failed load, idle unload, the memory budget
with LRU eviction, aliases, and a config reload next to a running stream."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from tests.conftest import IGNORE_EOS, llama, synthetic
from tests.pool import wait_for
from tests.test_lifecycle import admin, post, with_options, worker_procs
from tests.test_reliability import first_delta, sse, stream_responses


def lazy(name: str, load_ms: float = 0, memory_mb: float | None = None, **extra) -> dict:
    model = with_options(synthetic(name, load_on_start=False, **extra), load_ms=load_ms)
    if memory_mb is not None:
        model["memory_mb"] = memory_mb
    return model


def text_of(r: httpx.Response) -> str:
    return r.json()["output"][0]["content"][0]["text"]


def test_a_request_loads_an_unloaded_model_and_waiters_share_the_load(make_pool):
    pool = make_pool([lazy("a", load_ms=1500)])
    assert pool.model("a")["state"] == "unloaded"
    with ThreadPoolExecutor(3) as ex:
        first = ex.submit(post, pool, "a")
        wait_for(lambda: pool.model("a")["state"] == "loading", 10, what="loading on demand")
        assert pool.model("a")["queue_depth"] == 1
        more = [ex.submit(post, pool, "a") for _ in range(2)]  # arrive during the load: they wait
        wait_for(lambda: pool.model("a")["queue_depth"] == 3, 10, what="three waiting")
        assert all(f.result().status_code == 200 for f in [first, *more])
    view = pool.model("a")
    assert view["state"] == "loaded" and view["last_used_at"] is not None
    assert len(worker_procs(pool)) == 1  # one load for all three
    metrics = pool.http.get("/metrics").text
    assert 'llm_pool_model_loads_total{reason="on_demand"} 1.0' in metrics
    assert "llm_pool_model_load_duration_seconds_count 1.0" in metrics


def test_load_on_demand_off_keeps_409(make_pool):
    # its one model neither loaded nor loaded on demand: the pool serves nothing, so it is not ready
    pool = make_pool([lazy("off", load_on_demand=False)], wait_ready=False)
    ready = pool.http.get("/ready")
    assert ready.status_code == 503 and ready.json()["status"] == "no_model_serves"
    r = post(pool, "off")
    assert r.status_code == 409 and r.json()["error"]["code"] == "model_not_loaded"
    assert pool.model("off")["state"] == "unloaded"


def test_a_failing_load_fails_every_waiter_with_the_reason_and_the_next_request_tries_again(make_pool):
    bad = {"name": "bad", "backend": "llama_server", "load_on_start": False,
           "options": {"model": "/nonexistent/model.gguf", "binary": "/nonexistent/llama-server"}}
    pool = make_pool([bad])
    with ThreadPoolExecutor(3) as ex:
        results = [f.result() for f in [ex.submit(post, pool, "bad") for _ in range(3)]]
    for r in results:
        assert r.status_code == 503 and r.json()["error"]["code"] == "load_failed", r.text
        assert "failed to load" in r.json()["error"]["message"]
    assert pool.model("bad")["state"] == "failed"
    r = post(pool, "bad")  # tries again (and fails again, with its reason)
    assert r.status_code == 503 and r.json()["error"]["code"] == "load_failed"
    assert worker_procs(pool) == []


def test_idle_unload_waits_for_a_stream_and_skips_a_pinned_model(make_pool):
    pool = make_pool([lazy("i", idle_unload_s=1.5, tps=20, tokens=60),
                      lazy("p", idle_unload_s=1.5, pinned=True)], server={"heartbeat_s": 0.2, "liveness_s": 5})
    assert post(pool, "p").status_code == 200
    with stream_responses(pool, "i") as s:  # ~3 s of stream, twice idle_unload_s
        events = sse(s)
        first_delta(events)
        started = time.monotonic()
        last = list(events)[-1]
        assert time.monotonic() - started > 2
    assert last["type"] == "response.completed" and last["response"]["usage"]["output_tokens"] == 60
    assert pool.model("i")["state"] == "loaded"  # not cut while it streamed
    assert pool.model("i")["idle_unload_in_s"] <= 1.5
    wait_for(lambda: pool.model("i")["state"] == "unloaded", 5, what="idle unload")
    assert pool.model("p")["state"] == "loaded" and pool.model("p")["idle_unload_in_s"] is None
    assert "model i: unloading (idle for 1.5s)" in pool.log()


def test_a_budget_for_two_of_three_evicts_the_lru_idle_model_not_the_busy_or_pinned_one(make_pool):
    pool = make_pool([lazy("old", memory_mb=100), lazy("busy", memory_mb=100, ttft_ms=200, tps=10, tokens=1000),
                      lazy("pin", memory_mb=100, pinned=True), lazy("new", memory_mb=100)],
                     server={"memory_budget_mb": 300})
    assert post(pool, "old").status_code == 200
    assert post(pool, "pin").status_code == 200
    with stream_responses(pool, "busy") as s:
        events = sse(s)
        first_delta(events)  # busy now holds work; old is the least recently used idle one
        assert post(pool, "new").status_code == 200
        states = {m: pool.model(m)["state"] for m in ("old", "busy", "pin", "new")}
        assert states == {"old": "unloaded", "busy": "loaded", "pin": "loaded", "new": "loaded"}, states
    assert pool.model("new")["memory_mb"] == 100 and pool.model("new")["memory_source"] == "declared"
    metrics = pool.http.get("/metrics").text
    assert "llm_pool_model_evictions_total 1.0" in metrics and "llm_pool_model_swaps_total 1.0" in metrics
    assert "model old: unloading (evicted to make room for new" in pool.log()
    # the timeline names who the room was made for: the request's tenant (the default one: no keys)
    evicted = [e for e in pool.http.get("/admin/events", params={"model": "old"}).json()["events"]
               if e["kind"] == "evicted"]
    assert [e["by"] for e in evicted] == ["memory budget, for tenant default"], evicted


def test_nothing_evictable_waits_then_503_insufficient_memory(make_pool):
    pool = make_pool([lazy("pin", memory_mb=150, pinned=True), lazy("big", memory_mb=100, queue_timeout_s=1.5)],
                     server={"memory_budget_mb": 200})
    assert post(pool, "pin").status_code == 200
    started = time.monotonic()
    r = post(pool, "big")
    waited = time.monotonic() - started
    assert r.status_code == 503 and r.json()["error"]["code"] == "insufficient_memory", r.text
    message = r.json()["error"]["message"]
    assert "needs 100 MB" in message and "pin (150 MB)" in message
    assert 1.0 < waited < 10
    wait_for(lambda: pool.model("big")["state"] == "unloaded", 5, what="the load given up")
    assert pool.model("pin")["state"] == "loaded" and "needs 100 MB" in pool.model("big")["error"]


def test_aliases_route_and_are_listed(make_pool):
    pool = make_pool([lazy("real", aliases=["gpt-4o-mini", "small"])])
    r = httpx.post(pool.url + "/v1/chat/completions", timeout=30,
                   json={"model": "small", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 200, r.text
    listed = {m["id"]: m for m in pool.http.get("/v1/models").json()["data"]}
    assert set(listed) == {"real", "gpt-4o-mini", "small"}
    assert listed["gpt-4o-mini"]["state"] == "loaded" and listed["gpt-4o-mini"]["alias_of"] == "real"
    assert pool.model("real")["aliases"] == ["gpt-4o-mini", "small"]
    # an alias is its model everywhere: its errors count under the model, its log is the model's
    r = httpx.post(pool.url + "/v1/chat/completions", timeout=30,
                   json={"model": "small", "messages": [{"role": "user", "content": "x"}], "n": 2})
    assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_parameter"
    metrics = pool.http.get("/metrics").text
    assert 'llm_pool_requests_total{endpoint="chat_completions",model="real",status="400"} 1.0' in metrics
    assert 'model="unknown"' not in metrics
    assert pool.http.get("/admin/models/small/logs").json()["lines"] == \
        pool.http.get("/admin/models/real/logs").json()["lines"]


def test_reload_adds_removes_changes_while_an_unchanged_model_streams(make_pool):
    keep = synthetic("keep", tps=40, tokens=80)
    gone_model = synthetic("gone")
    change = synthetic("change")
    pool = make_pool([keep, gone_model, change])
    keep_pid = pool.workers("keep")[0]["pid"]
    change_pid = pool.workers("change")[0]["pid"]
    with stream_responses(pool, "keep") as s:
        events = sse(s)
        first_delta(events)
        pool.rewrite_config([keep, with_options(synthetic("change"), output_tokens=5), synthetic("added")])
        r = pool.http.post("/admin/reload")
        assert r.status_code == 200, r.text
        assert r.json() == {"added": ["added"], "removed": ["gone"], "reloaded": ["change"], "kept": ["keep"]}
        got = list(events)
    assert got[-1]["type"] == "response.completed" and got[-1]["response"]["usage"]["output_tokens"] == 80
    streamed = got[-1]["response"]["output"][0]["content"][0]["text"]
    assert streamed == text_of(post(pool, "keep"))  # the full text, uninterrupted
    assert pool.workers("keep")[0]["pid"] == keep_pid
    wait_for(lambda: pool.model("change")["state"] == "loaded" and pool.workers("change")[0]["pid"] != change_pid,
             15, what="change reloaded")
    wait_for(lambda: pool.model("added")["state"] == "loaded", 15, what="added loaded")
    wait_for(lambda: "gone" not in pool.models(), 15, what="gone removed")
    assert post(pool, "gone").status_code == 404
    assert pool.http.post("/v1/responses", json={"model": "change", "input": "x"}).json()[
        "usage"]["output_tokens"] == 5
    metrics = pool.http.get("/metrics").text
    assert 'llm_pool_model_loads_total{reason="reload"} 2.0' in metrics

    # a bad config is refused whole, with serve's message, and nothing changes
    pool.rewrite_config([keep, synthetic("x", aliases=["keep"])])
    before = pool.models()
    r = pool.http.post("/admin/reload")
    assert r.status_code == 400 and "'keep' is already the name or an alias" in r.json()["error"]["message"]
    assert pool.models().keys() == before.keys() and pool.workers("keep")[0]["pid"] == keep_pid
    # so is a change of a [server] key bound at start (an operator rotating a key must not be told it worked)
    pool.rewrite_config([keep], server={"admin_key": "rotated"})
    r = pool.http.post("/admin/reload")
    assert r.status_code == 400 and "admin_key take effect only when the pool restarts" in r.json()["error"]["message"]
    assert pool.models().keys() == before.keys()
    pool.config_path.write_text(pool.config_path.read_text().replace('admin_key = "rotated"\n', ""))

    # SIGHUP reloads too
    pool.rewrite_config([keep])
    os.kill(pool.proc.pid, signal.SIGHUP)
    wait_for(lambda: set(pool.models()) == {"keep"}, 15, what="SIGHUP reload")
    assert pool.workers("keep")[0]["pid"] == keep_pid


def test_cold_start_ttft_through_load_on_demand_against_warm(make_pool):
    """A figure for the note: time to first token, cold (load on demand) and warm."""
    pool = make_pool([lazy("c", load_ms=500)])

    def ttft() -> float:
        started = time.monotonic()
        with stream_responses(pool, "c") as s:
            first_delta(sse(s))
            took = time.monotonic() - started
        return took
    cold = ttft()
    warm = min(ttft() for _ in range(5))
    print(f"synthetic, load_ms=500: cold TTFT {cold * 1000:.0f} ms, warm {warm * 1000:.0f} ms")
    assert cold > 0.5 > warm


def test_a_measured_footprint_replaces_the_estimate(make_pool, tiny_gguf, llama_server_bin):
    # ignore_eos: random weights may end an answer before its first token
    pool = make_pool([llama("tiny", tiny_gguf, llama_server_bin, ctx=512, extra_args=IGNORE_EOS,
                            load_on_start=False)])
    before = pool.model("tiny")
    assert before["memory_source"] == "estimated"
    file_mb = os.path.getsize(tiny_gguf) / 2**20
    # the file, its context, and the host prompt cache the pool sets (cache_ram_mb, 1024 by default)
    assert before["memory_mb"] == round(file_mb + 512 * 0.125 + 1024, 1)
    def ttft() -> float:
        started = time.monotonic()
        with httpx.stream("POST", pool.url + "/v1/chat/completions", timeout=60, json={
                "model": "tiny", "max_tokens": 40, "stream": True, "temperature": 0,
                "messages": [{"role": "user", "content": "hi"}]}) as s:
            assert s.status_code == 200
            first_delta(sse(s))
            return time.monotonic() - started
    cold = ttft()  # through load on demand
    warm = min(ttft() for _ in range(3))
    print(f"tiny gguf on llama-server: cold TTFT {cold * 1000:.0f} ms, warm {warm * 1000:.0f} ms")
    assert cold > warm
    after = pool.model("tiny")
    assert after["memory_source"] == "measured" and after["memory_mb"] > 0
    print(f"tiny gguf: estimated {before['memory_mb']} MB, measured {after['memory_mb']} MB (worker + llama-server RSS)")


def test_unload_during_an_on_demand_load_fails_its_waiters_with_model_unloading(make_pool):
    pool = make_pool([lazy("u", load_ms=1500)])
    with ThreadPoolExecutor(2) as ex:
        waiting = ex.submit(post, pool, "u")
        wait_for(lambda: pool.model("u")["state"] == "loading", 10, what="loading")
        unload = ex.submit(admin, pool, "u", "unload")
        r = waiting.result()
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_unloading", r.text
        assert unload.result().json()["state"] == "unloaded"
    assert worker_procs(pool) == []


def test_the_cli_shows_lifecycle_columns_and_reloads(make_pool):
    from tests.test_cli import assert_one_line_error, cli, table_rows
    model = lazy("m", memory_mb=100, pinned=True, aliases=["mini"], idle_unload_s=600)
    pool = make_pool([model])
    row = table_rows(cli("models", "-o", "wide", url=pool.url).stdout)[0]
    assert (row["MEMORY"], row["PINNED"], row["ALIASES"], row["LAST USED"]) == ("100 MB (declared)", "yes", "mini", "-")
    pool.rewrite_config([model, lazy("n")])
    done = cli("reload", url=pool.url)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["added: n", "removed: -", "reloaded: -", "kept: m"]
    pool.rewrite_config([model, lazy("n", target_inflight=0)])
    assert_one_line_error(cli("reload", url=pool.url), "model 'n': key 'target_inflight'")
    assert set(pool.models()) == {"m", "n"}


def test_alternating_requests_under_a_budget_of_one_model_all_succeed(make_pool):
    """Budget for one of A and B: requests for both from several clients swap the
    models in and out; a request that comes while its model is being evicted
    waits for its next load instead of failing; every request gets 200."""
    pool = make_pool([lazy(n, load_ms=200, memory_mb=100, tps=200, tokens=20) for n in ("A", "B")],
                     server={"memory_budget_mb": 150, "heartbeat_s": 0.1, "liveness_s": 5})
    latencies: dict[str, list[float]] = {"A": [], "B": []}

    def client(i: int) -> list[int]:
        codes = []
        for k in range(4):
            model = "AB"[(i + k) % 2]
            started = time.monotonic()
            codes.append(post(pool, model).status_code)
            latencies[model].append(time.monotonic() - started)
        return codes
    with ThreadPoolExecutor(4) as ex:
        codes = [c for f in [ex.submit(client, i) for i in range(4)] for c in f.result()]
    assert codes == [200] * 16, codes
    metrics = pool.http.get("/metrics").text
    swaps = next(float(line.split()[-1]) for line in metrics.splitlines()
                 if line.startswith("llm_pool_model_swaps_total"))
    every = sorted(latencies["A"] + latencies["B"])
    print(f"alternating A/B, 4 clients x 4 requests, budget of one: {swaps:.0f} swaps, "
          f"p50 {every[len(every) // 2] * 1000:.0f} ms, max {every[-1] * 1000:.0f} ms")
    assert swaps >= 1


def _contend(make_pool, max_swap_wait_s: float) -> tuple[int, list[float]]:
    """Two clients on A and two on B, 6 requests each, under a budget of one model."""
    pool = make_pool([lazy(n, load_ms=200, memory_mb=100, tps=200, tokens=20) for n in ("A", "B")],
                     server={"memory_budget_mb": 150, "heartbeat_s": 0.1, "liveness_s": 5,
                             "max_swap_wait_s": max_swap_wait_s})
    latencies: list[float] = []

    def client(model: str) -> list[int]:
        codes = []
        for _ in range(6):
            started = time.monotonic()
            codes.append(post(pool, model).status_code)
            latencies.append(time.monotonic() - started)
        return codes
    with ThreadPoolExecutor(4) as ex:
        codes = [c for f in [ex.submit(client, m) for m in "AABB"] for c in f.result()]
    assert codes == [200] * 24, codes
    metrics = pool.http.get("/metrics").text
    swaps = next(int(float(line.split()[-1])) for line in metrics.splitlines()
                 if line.startswith("llm_pool_model_swaps_total"))
    print(pool.log().count("waited through its unload"), "reloads for requests that came during an unload")
    pool.stop()
    return swaps, sorted(latencies)


def test_swap_aware_dispatch_swaps_less_than_swapping_at_once(make_pool):
    """max_swap_wait_s = 0 swaps as soon as the other model waits (FIFO order);
    1 s lets the loaded model serve its queue first. Both finish everything."""
    results = {wait: _contend(make_pool, wait) for wait in (0.0, 1.0)}
    for wait, (swaps, lat) in results.items():
        print(f"max_swap_wait_s={wait:g}: {swaps} swaps, p50 {lat[len(lat) // 2] * 1000:.0f} ms, "
              f"p99 {lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1000:.0f} ms")
    assert results[1.0][0] < results[0.0][0]


def test_a_gpu_budget_per_device_evicts_only_on_that_device(make_pool):
    """gpu_memory_budget_mb is per device: A and B share GPU 0 (60 MB each, budget 100),
    C is on GPU 1. Loading B evicts A, not C; no host budget is involved."""
    def on(name: str, device: str) -> dict:
        return {**lazy(name), "gpu_memory_mb": 60, "replica_devices": [device]}
    pool = make_pool([on("A", "0"), on("B", "0"), on("C", "1")], server={"gpu_memory_budget_mb": 100})
    assert post(pool, "A").status_code == 200 and post(pool, "C").status_code == 200
    assert post(pool, "B").status_code == 200
    states = {m: v["state"] for m, v in pool.models().items()}
    assert states == {"A": "unloaded", "B": "loaded", "C": "loaded"}, states
    assert "model A: unloading (evicted to make room for B in it needs 60 MB of gpu_memory_budget_mb (GPU 0)" \
        in pool.log()


def test_a_reload_keeps_serves_port_and_host_from_the_command_line(tmp_path):
    """Issue 59: `serve --port/--host` over the file's [server] keys; a reload (CLI and SIGHUP)
    applies the file's model change and keeps the command line's port and host (it was refused:
    "port take effect only when the pool restarts")."""
    from tests.pool import Pool, free_port
    from tests.test_cli import cli
    file_port = free_port()  # what the file says: never bound
    pool = Pool(tmp_path, [synthetic("a", tokens=2)], server={"port": file_port, "host": "localhost"})
    pool.command += ["--port", str(pool.port), "--host", "127.0.0.1"]
    pool.start()
    try:
        pool.rewrite_config([synthetic("a", tokens=2), synthetic("b", tokens=2)])
        done = cli("reload", url=pool.url)
        assert done.returncode == 0, done.stdout + done.stderr
        assert done.stdout.splitlines()[0] == "added: b"
        assert post(pool, "b").status_code == 200
        pool.rewrite_config([synthetic("a", tokens=2)])
        os.kill(pool.proc.pid, signal.SIGHUP)
        wait_for(lambda: "b" not in pool.models(), 30, what="b removed by the SIGHUP reload")
    finally:
        pool.stop()
