"""Load, unload, restart and shutdown under faults and races, with real
workers and real signals: a worker killed while its model drains, operator
actions racing each other, a hung worker with jobs queued, a grandchild that
must die, a spawn that fails, and a shutdown with a job that never ends."""

from __future__ import annotations

import os
import shutil
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest

from tests.conftest import llama, synthetic
from tests.pool import wait_for
from tests.test_reliability import first_delta, gone, sse, stream_responses


def worker_procs(pool) -> list[psutil.Process]:
    """The pool's live worker processes (its children running runtime_worker)."""
    procs = []
    for proc in pool.descendants():
        try:
            if proc.status() != psutil.STATUS_ZOMBIE and "runtime_worker" in proc.cmdline():
                procs.append(proc)
        except psutil.Error:
            pass
    return procs


def with_options(model: dict, **options) -> dict:
    model["options"].update(options)
    return model


def post(pool, model: str, **body) -> httpx.Response:
    return httpx.post(pool.url + "/v1/responses", timeout=60, json={"model": model, "input": "x", **body})


def admin(pool, model: str, action: str) -> httpx.Response:
    return httpx.post(f"{pool.url}/admin/models/{model}/{action}", timeout=60)


def test_sigkill_during_an_unload_drain(make_pool):
    """Item 1: the unload completes at once; the started job gets 502, the one
    the crash would requeue and the queued one get 503; no restart."""
    pool = make_pool([synthetic("u", target_inflight=2, capacity=2, ttft_ms=4000, tps=5, tokens=1000)])
    pid = pool.workers("u")[0]["pid"]
    with ThreadPoolExecutor(3) as ex, stream_responses(pool, "u") as a:
        events = sse(a)
        first_delta(events)  # A has output; B, submitted now, has none for 4 s
        unstarted = ex.submit(post, pool, "u")
        wait_for(lambda: pool.model("u")["runtime_inflight"] == 2, 10, what="B submitted")
        queued = ex.submit(post, pool, "u")
        wait_for(lambda: pool.model("u")["queue_depth"] == 1, 10, what="C queued")
        unload = ex.submit(admin, pool, "u", "unload")
        wait_for(lambda: pool.model("u")["state"] == "unloading", 10, what="unloading")
        r = queued.result()
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_unloading"
        killed_at = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        last = list(events)[-1]
        assert last["type"] == "response.failed" and last["response"]["error"]["code"] == "runtime_crashed"
        r = unstarted.result()
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_unloading", r.text
        r = unload.result()
        took = time.monotonic() - killed_at
    assert r.status_code == 200 and r.json()["state"] == "unloaded", r.text
    assert took < 10, f"the unload returned {took:.1f}s after the kill"
    assert pool.workers("u") == [] and worker_procs(pool) == []
    print(f"SIGKILL during the drain -> unload done in {took * 1000:.0f} ms")


def test_restart_during_an_unload_is_refused_and_cuts_nothing(make_pool):
    """Item 2: the draining job completes; no worker is left for the unloaded model."""
    pool = make_pool([synthetic("d", tps=10, tokens=30)])
    with ThreadPoolExecutor(1) as ex, stream_responses(pool, "d") as a:
        events = sse(a)
        first_delta(events)
        unload = ex.submit(admin, pool, "d", "unload")
        wait_for(lambda: pool.model("d")["state"] == "unloading", 10, what="unloading")
        r = admin(pool, "d", "restart")
        assert r.status_code == 409 and r.json()["error"]["code"] == "model_busy"
        assert "unloading" in r.json()["error"]["message"]
        last = list(events)[-1]
        assert last["type"] == "response.completed" and last["response"]["usage"]["output_tokens"] == 30
        assert unload.result().json()["state"] == "unloaded"
    assert pool.workers("d") == [] and worker_procs(pool) == []


def test_a_request_and_a_restart_during_a_load(make_pool):
    """Items 2 and 3: a request waits in the queue for the load (issue 14), then
    runs; a restart gets 409; the load ends with exactly its replicas."""
    pool = make_pool([with_options(synthetic("l", replicas=2, load_on_start=False), load_ms=3000)])
    with ThreadPoolExecutor(2) as ex:
        load = ex.submit(admin, pool, "l", "load")
        wait_for(lambda: pool.model("l")["state"] == "loading", 10, what="loading")
        waiting = ex.submit(post, pool, "l")
        wait_for(lambda: pool.model("l")["queue_depth"] == 1, 10, what="the request waits")
        r = admin(pool, "l", "restart")
        assert r.status_code == 409 and "loading" in r.json()["error"]["message"]
        assert load.result().json()["state"] == "loaded"
        assert waiting.result().status_code == 200
    workers = pool.workers("l")
    assert [w["state"] for w in workers] == ["ready", "ready"]
    assert sorted(p.pid for p in worker_procs(pool)) == sorted(w["pid"] for w in workers)
    assert post(pool, "l").status_code == 200


def test_an_unload_during_a_load_wins_and_leaves_no_worker(make_pool):
    """The unload asked while the workers load wins: they are stopped before they are ready
    (a vLLM load is minutes nobody wants), the load answers 503 model_unloading, and the
    model ends unloaded with no error of its own."""
    pool = make_pool([with_options(synthetic("w", replicas=2, load_on_start=False), load_ms=2000)])
    with ThreadPoolExecutor(2) as ex:
        load = ex.submit(admin, pool, "w", "load")
        wait_for(lambda: pool.model("w")["state"] == "loading", 10, what="loading")
        unload = ex.submit(admin, pool, "w", "unload")
        loaded = load.result()
        assert loaded.status_code == 503 and loaded.json()["error"]["code"] == "model_unloading", loaded.text
        assert unload.result().json()["state"] == "unloaded"
        assert pool.model("w").get("error") is None
    assert pool.workers("w") == [] and worker_procs(pool) == []


def test_concurrent_restarts_keep_one_worker_per_replica(make_pool):
    """Item 4: two, then ten restarts at once: one runs, the others get 409;
    never more workers than replicas plus those being stopped; all listed."""
    pool = make_pool([with_options(synthetic("r", replicas=2), load_ms=300)])
    for n in (2, 10):
        most = 0
        with ThreadPoolExecutor(n) as ex:
            calls = [ex.submit(admin, pool, "r", "restart") for _ in range(n)]
            while not all(c.done() for c in calls):
                most = max(most, len(worker_procs(pool)))
                time.sleep(0.02)
            codes = sorted(c.result().status_code for c in calls)
        assert set(codes) <= {200, 409} and 200 in codes, codes
        assert all(c.result().json()["error"]["code"] == "model_busy" for c in calls
                   if c.result().status_code == 409)
        assert most <= 4, f"{most} worker processes for a 2-replica model"
        workers = wait_for(lambda: (w := pool.workers("r")) and all(x["state"] == "ready" for x in w) and w,
                           10, what="ready")
        listed = sorted(w["pid"] for w in workers)
        wait_for(lambda: sorted(p.pid for p in worker_procs(pool)) == listed, 10, what="only the listed workers")
        assert pool.model("r")["state"] == "loaded" and pool.http.get("/ready").status_code == 200
        assert post(pool, "r").status_code == 200
        print(f"{n} restarts at once: codes {codes}, at most {most} worker processes")


@pytest.mark.llama
def test_concurrent_restarts_of_a_llama_server_model(make_pool, tiny_gguf, llama_server_bin):
    """Ten restarts at once used to run ten workers and ten llama-servers."""
    pool = make_pool([llama("tiny", tiny_gguf, llama_server_bin)])

    def servers() -> list[int]:
        return [p.pid for p in pool.descendants() if _name(p) == "llama-server"]

    most = 0
    with ThreadPoolExecutor(10) as ex:
        calls = [ex.submit(admin, pool, "tiny", "restart") for _ in range(10)]
        while not all(c.done() for c in calls):
            most = max(most, len(worker_procs(pool)) + len(servers()))
            time.sleep(0.02)
    codes = sorted(c.result().status_code for c in calls)
    assert set(codes) <= {200, 409} and 200 in codes, codes
    assert most <= 4, f"{most} workers and llama-servers for one replica"
    worker = pool.workers("tiny")[0]
    wait_for(lambda: servers() == [c["pid"] for c in worker["children"]], 10, what="one llama-server")
    assert [p.pid for p in worker_procs(pool)] == [worker["pid"]]
    r = post(pool, "tiny", max_output_tokens=2)
    assert r.status_code == 200, r.text
    print(f"10 llama_server restarts at once: codes {codes}, at most {most} workers + llama-servers")


def _name(proc: psutil.Process) -> str | None:
    try:
        return proc.name() if proc.status() != psutil.STATUS_ZOMBIE else None
    except psutil.Error:
        return None


def test_sigstop_then_a_liveness_kill_with_jobs_queued(make_pool):
    """The hung worker leaves rotation before it is killed: the queued jobs run
    on its successor."""
    pool = make_pool([synthetic("h", tps=10, tokens=200)], server={"heartbeat_s": 0.25, "liveness_s": 1.5})
    pid = pool.workers("h")[0]["pid"]
    try:
        with ThreadPoolExecutor(2) as ex, stream_responses(pool, "h") as a:
            events = sse(a)
            first_delta(events)
            queued = [ex.submit(post, pool, "h", max_output_tokens=3) for _ in range(2)]
            wait_for(lambda: pool.model("h")["queue_depth"] == 2, 10, what="two queued")
            os.kill(pid, signal.SIGSTOP)
            last = list(events)[-1]
            assert last["type"] == "response.failed" and last["response"]["error"]["code"] == "runtime_timeout"
            for f in queued:
                r = f.result()
                assert r.status_code == 200 and r.json()["usage"]["output_tokens"] == 3, r.text
        assert gone(pid)
        w = pool.workers("h")[0]
        assert w["state"] == "ready" and w["pid"] != pid and w["restarts"] == 1
    finally:
        if not gone(pid):
            os.kill(pid, signal.SIGKILL)


def test_a_grandchild_dies_with_its_worker(make_pool):
    """Item 9: a process in its own session under the worker (like vLLM's engine)
    is killed on the crash path (worker SIGKILLed) and the liveness path (SIGSTOP)."""
    pool = make_pool([with_options(synthetic("g"), grandchild=True)], server={"heartbeat_s": 0.25, "liveness_s": 1.5})

    def grandchild(worker: dict) -> int:
        return worker["runtime_info"]["child_pid"]

    worker = pool.workers("g")[0]
    child = grandchild(worker)
    assert child in [c["pid"] for c in worker["children"]]
    os.kill(worker["pid"], signal.SIGKILL)
    wait_for(lambda: gone(child), 10, what="grandchild killed after its worker crashed")
    worker = wait_for(lambda: (w := pool.workers("g")[0])["state"] == "ready" and w["restarts"] == 1 and w,
                      20, what="restarted")
    child = grandchild(worker)
    os.kill(worker["pid"], signal.SIGSTOP)
    try:
        wait_for(lambda: gone(worker["pid"]) and gone(child), 15, what="hung worker and grandchild killed")
    finally:
        if not gone(worker["pid"]):
            os.kill(worker["pid"], signal.SIGKILL)
    wait_for(lambda: pool.workers("g")[0]["state"] == "ready", 20, what="restarted again")


def test_a_spawn_error_makes_the_replica_fatal(make_pool, tmp_path):
    """Item 10: the crash restart cannot spawn (its log directory is gone, a file
    in its place): fatal with the reason, the model shown failed, /ready 503;
    an operator restart recovers once the cause is fixed."""
    state = tmp_path / "state"
    pool = make_pool([synthetic("s")], server={"state_dir": str(state)})
    logs = state / "llm-pool" / "logs"  # the pool makes its own directory in state_dir
    shutil.rmtree(logs)
    logs.write_text("not a directory")
    os.kill(pool.workers("s")[0]["pid"], signal.SIGKILL)
    worker = wait_for(lambda: (w := pool.workers("s")[0])["state"] == "fatal" and w, 15, what="fatal")
    assert "cannot spawn the worker" in worker["last_error"]
    model = pool.model("s")
    assert model["state"] == "failed" and "cannot spawn" in model["error"]
    assert pool.http.get("/ready").status_code == 503
    r = post(pool, "s")
    assert r.status_code == 503 and r.json()["error"]["code"] == "no_healthy_replica"
    logs.unlink()
    assert admin(pool, "s", "restart").status_code == 200
    assert pool.model("s")["state"] == "loaded" and post(pool, "s").status_code == 200


def _stop_timed(pool, signals: int, grace_s: float) -> tuple[float, dict]:
    """Start a job that never ends, send `signals` SIGTERMs (the second once the
    drain is under way); return the seconds from the first signal to exit, and
    the job's last event."""
    with stream_responses(pool, "n") as a:
        events = sse(a)
        first_delta(events)
        started = time.monotonic()
        pool.proc.send_signal(signal.SIGTERM)
        if signals == 2:
            wait_for(lambda: pool.http.get("/ready").status_code == 503, 10, what="draining")
            time.sleep(0.2)
            started = time.monotonic()
            pool.proc.send_signal(signal.SIGTERM)
        pool.proc.wait(grace_s + 60)
        took = time.monotonic() - started
        last = list(events)[-1]
    return took, last


def test_shutdown_with_a_job_that_never_ends(make_pool):
    """Item 5: the grace is spent once: grace plus the stop timeout at most."""
    grace, stop = 4.0, 1.0
    pool = make_pool([synthetic("n", tps=2, tokens=1_000_000, stop_timeout_s=stop)],
                     server={"shutdown_grace_s": grace})
    pids = [w["pid"] for w in pool.workers()]
    took, last = _stop_timed(pool, 1, grace)
    assert last["type"] == "response.failed"  # told, never a silent close
    assert last["response"]["error"]["code"] == "model_unloading"
    assert grace - 0.5 < took < grace + stop + 3, f"shutdown took {took:.1f}s (grace {grace}s)"
    assert all(gone(pid) for pid in pids)
    print(f"shutdown with a never-ending job: {took:.1f}s (grace {grace}s, stop timeout {stop}s)")


def test_a_second_signal_stops_at_once(make_pool):
    grace, stop = 60.0, 1.0
    pool = make_pool([synthetic("n", tps=2, tokens=1_000_000, stop_timeout_s=stop)],
                     server={"shutdown_grace_s": grace})
    pids = [w["pid"] for w in pool.workers()]
    took, last = _stop_timed(pool, 2, grace)
    assert last["type"] == "response.failed"
    assert took < stop + 3, f"exit {took:.1f}s after the second signal"
    assert all(gone(pid) for pid in pids)
    print(f"second signal -> exit: {took:.1f}s")


def test_a_restart_an_unload_overtakes_answers_model_unloading(make_pool):
    """An operator's restart draining a replica, then an unload: the unload wins, nothing starts,
    and the restart's answer says the model is unloading (503 model_unloading), not a failed load."""
    pool = make_pool([synthetic("r", tps=10, tokens=400, drain_timeout_s=60)])
    with ThreadPoolExecutor(2) as ex, stream_responses(pool, "r") as s:
        events = sse(s)  # held: a generator dropped unfinished closes the stream, and the job goes with it
        first_delta(events)
        restart = ex.submit(admin, pool, "r", "restart")
        # the restart answering first (a refusal) ends the wait with its answer, not a bare timeout
        wait_for(lambda: restart.done() or pool.workers("r")[0]["state"] == "restarting", 30,
                 what="the restart draining")
        assert not restart.done(), f"the restart answered before the unload: {restart.result().text}"
        unload = ex.submit(admin, pool, "r", "unload")
        answer = restart.result(timeout=30)
    assert answer.status_code == 503, answer.text
    assert answer.json()["error"]["code"] == "model_unloading", answer.text
    assert unload.result(timeout=30).status_code == 200
    wait_for(lambda: pool.model("r")["state"] == "unloaded", 30, what="unloaded")
    assert worker_procs(pool) == []
