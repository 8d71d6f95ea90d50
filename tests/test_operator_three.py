"""The operator, round three: in-flight rows an operator can follow up (request ids and
tenants), readiness that stays true after a broken model is unloaded. Real pools, real
workers, the real CLI as a subprocess."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx

from tests.conftest import synthetic
from tests.pool import wait_for
from tests.test_cli import cli


def chat_as(pool, rid: str, model: str, **extra) -> httpx.Response:
    return httpx.post(pool.url + "/v1/chat/completions", headers={"x-request-id": rid}, timeout=60,
                      json={"model": model, "messages": [{"role": "user", "content": "hi"}], **extra})


def test_in_flight_rows_show_request_ids_and_tenants_that_the_cli_finds(make_pool):
    """The page's in-flight rows (GET /admin/requests/summary) carry each request's own id and
    its tenant, running or queued; `llm-pool requests --id <that id>` then finds the request."""
    pool = make_pool([synthetic("slow", tps=20, tokens=400)])  # one slot: the second request queues
    with ThreadPoolExecutor(2) as ex:
        running = ex.submit(chat_as, pool, "run-1", "slow", max_tokens=40)  # 2 s
        wait_for(lambda: pool.model("slow")["runtime_inflight"] == 1, 10, what="run-1 running")
        queued = ex.submit(chat_as, pool, "queued-1", "slow", max_tokens=2)
        wait_for(lambda: pool.model("slow")["queue_depth"] == 1, 10, what="queued-1 queued")
        rows = pool.http.get("/admin/requests/summary").json()["in_flight"]
        assert [(r["request_id"], r["tenant"], r["state"]) for r in rows] == [
            ("run-1", "default", "running"), ("queued-1", "default", "queued")], rows
        assert running.result().status_code == 200 and queued.result().status_code == 200
    for rid in ("run-1", "queued-1"):
        wait_for(lambda: pool.http.get("/admin/requests", params={"id": rid}).json()["requests"], 5,
                 what=f"{rid}'s row")
        done = cli("requests", "--id", rid, url=pool.url)
        assert done.returncode == 0 and f"request {rid} (row " in done.stdout, (done.stdout, done.stderr)
        assert "tenant default" in done.stdout


def test_an_unloaded_broken_model_is_not_serving_and_check_says_so(make_pool):
    """A load_on_demand model whose load failed, then unloaded by the operator: unloading mends
    nothing, so /ready does not list it as serving and check exits 2 naming it, until a load
    succeeds."""
    from tests.test_operator import break_spawns, mend_spawns
    pool = make_pool([synthetic("ok", load_on_demand=False), synthetic("lazy", load_on_start=False)])
    assert pool.http.get("/ready").json()["serving"] == ["ok", "lazy"]  # a request would load it
    broken = break_spawns(pool)
    try:
        assert pool.http.post("/admin/models/lazy/load").status_code >= 500
        assert pool.model("lazy")["state"] == "failed"
        assert pool.http.post("/admin/models/lazy/unload").status_code == 200
        assert pool.model("lazy")["state"] == "unloaded"
        ready = pool.http.get("/ready").json()
        assert ready["serving"] == ["ok"] and ready["not_serving"] == ["lazy"], ready
        health = pool.http.get("/health").json()
        assert health["unhealthy"] == ["lazy"] and health["status"] == "failed"
        assert health["models"]["lazy"]["last_load_failed"] is True
        done = cli("check", url=pool.url)
        assert done.returncode == 2, (done.stdout, done.stderr)
        assert done.stdout.startswith("lazy unloaded (0/1 ready): its last load failed: "), done.stdout
    finally:
        mend_spawns(*broken)
    assert chat_as(pool, "mended", "lazy").status_code == 200  # a load that succeeds clears it
    assert pool.http.get("/ready").json()["serving"] == ["ok", "lazy"]
    assert cli("check", url=pool.url).returncode == 0


def test_an_operators_restart_is_planned_in_the_restart_counter_a_crash_is_not(make_pool):
    """llm_pool_worker_restarts_total{reason}: an operator's restart counts as planned, a crash
    restart as crash (the CrashLoop alert reads crash only); /admin/workers says which too."""
    import os
    import signal

    from tests.test_ops import scrape, value
    pool = make_pool([synthetic("syn", replicas=2)])
    assert pool.http.post("/admin/models/syn/restart", params={"replica": 1}).status_code == 200
    os.kill(pool.workers("syn")[0]["pid"], signal.SIGKILL)
    wait_for(lambda: [(w["state"], w["restarts"]) for w in pool.workers("syn")] == [("ready", 1), ("ready", 1)],
             30, what="both replicas ready again, once restarted each")
    samples = scrape(pool)
    counts = {(replica, reason): value(samples, "llm_pool_worker_restarts_total", model="syn", replica=replica,
                                       reason=reason) for replica in ("0", "1") for reason in ("crash", "planned")}
    assert counts == {("0", "crash"): 1, ("0", "planned"): 0, ("1", "crash"): 0, ("1", "planned"): 1}, counts
    assert [w["planned_restarts"] for w in pool.workers("syn")] == [0, 1]


def test_an_operators_unload_drains_with_503s_counted_as_planned(make_pool):
    """A request refused while an operator's unload drains is a 503 model_unloading in
    llm_pool_requests_total and in llm_pool_requests_planned_total too (the 5xx alert and the
    dashboard leave planned work out of the pool's faults); its 200s are not."""
    from tests.test_ops import scrape, value
    pool = make_pool([synthetic("slow", tps=20, tokens=400)])
    with ThreadPoolExecutor(2) as ex:
        running = ex.submit(chat_as, pool, "draining-1", "slow", max_tokens=60)  # 3 s
        wait_for(lambda: pool.model("slow")["runtime_inflight"] == 1, 10, what="a request running")
        unload = ex.submit(pool.http.post, "/admin/models/slow/unload", timeout=60)
        wait_for(lambda: pool.model("slow")["state"] == "unloading", 10, what="unloading")
        refused = chat_as(pool, "refused-1", "slow")
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "model_unloading", refused.text
        assert running.result().status_code == 200 and unload.result().status_code == 200
    samples = scrape(pool)
    key = dict(model="slow", endpoint="chat_completions", status="503")
    assert value(samples, "llm_pool_requests_total", **key) == 1
    assert value(samples, "llm_pool_requests_planned_total", **key) == 1
    assert ("llm_pool_requests_planned_total", tuple(sorted(dict(key, status="200").items()))) not in samples
