"""The operator, round two: readiness that means "can serve" (a broken model beside
serving ones), planned restarts that raise no alert, a crash's reason without the
runtime's start-up chatter, request ids shared by client and operator, and a timeline
that folds a crash loop and marks the supervisor's start and stop. Real pools, real
workers, the real CLI as a subprocess."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing

import httpx
import psutil
import pytest

from tests.conftest import llama, synthetic
from tests.pool import ROOT, wait_for
from tests.procs import frozen, stop_tree
from tests.test_cli import cli
from tests.test_lifecycle import with_options
from tests.test_operator import break_spawns, chat, events, mend_spawns


def test_the_last_error_line_of_a_runtime_is_its_reason():
    from runtime_worker.native_server import last_error_line
    chatter = ["0.00.121.944 I srv  llama_server: listening on http://127.0.0.1:49093",
               "0.00.100.000 I main: loading model", "build: 1 (abc) with cc"]
    assert last_error_line(chatter) is None
    assert last_error_line([*chatter[:1], "0.00.200.000 E llama_model_load: bad magic", *chatter[1:]]) == \
        "0.00.200.000 E llama_model_load: bad magic"
    assert last_error_line(["gguf_init_from_file: failed to open GGUF file 'x'", "main: exiting"]) == \
        "gguf_init_from_file: failed to open GGUF file 'x'"
    assert last_error_line(["E load_model: failed to load model, 'x'", "E llama_server: exiting due to model "
                            "loading error"]) == "E load_model: failed to load model, 'x'"  # the cause, not the exit
    assert last_error_line(["E llama_server: exiting due to an error"]) == "E llama_server: exiting due to an error"
    assert last_error_line(["CUDA error: out of memory " + "x" * 1000]).endswith("...")
    assert len(last_error_line(["fatal " + "x" * 1000])) == 303


@pytest.mark.llama
def test_ready_means_a_model_can_serve_and_check_names_each_broken_model(make_pool, llama_server_bin, tmp_path):
    """A model with a missing file beside models that serve: the pool is ready (the start-up
    settled, models serve); /health and check name the failed model and a degraded one, with why."""
    # not loaded on demand: unloaded, they no longer serve (a load_on_demand model would: a request loads it)
    pool = make_pool([synthetic("ok", load_on_demand=False), synthetic("syn", replicas=2, load_on_demand=False),
                      llama("ghost", str(tmp_path / "missing.gguf"), llama_server_bin)], wait_ready=False)
    wait_for(lambda: pool.http.get("/ready").status_code == 200, 30, what="/ready 200")
    ready = pool.http.get("/ready").json()
    assert ready["status"] == "ready" and ready["serving"] == ["ok", "syn"] and ready["not_serving"] == ["ghost"]
    assert pool.model("ghost")["state"] == "failed"

    broken = break_spawns(pool)
    os.kill(pool.workers("syn")[1]["pid"], signal.SIGKILL)
    wait_for(lambda: pool.workers("syn")[1]["state"] == "fatal", 20, what="syn/1 fatal")
    assert pool.http.get("/ready").status_code == 200  # syn still serves on its other replica
    health = pool.http.get("/health").json()
    assert health["unhealthy"] == ["ghost", "syn"] and health["status"] == "failed"
    assert "model file not found" in health["models"]["ghost"]["reason"]
    assert "cannot spawn" in health["models"]["syn"]["reason"]
    done = cli("check", url=pool.url)
    assert done.returncode == 2, (done.stdout, done.stderr)
    lines = done.stdout.splitlines()
    assert lines[0].startswith("ghost failed (0/1 ready): ") and "model file not found" in lines[0]
    assert lines[1].startswith("syn degraded (1/2 ready): ") and "cannot spawn" in lines[1]
    assert "ready, but 2 model(s) degraded or failed" in done.stderr
    mend_spawns(*broken)

    # nothing serves any more: 503, and check still names the broken one
    for name in ("ok", "syn"):
        assert pool.http.post(f"/admin/models/{name}/unload").status_code == 200
    r = pool.http.get("/ready")
    assert r.status_code == 503 and r.json()["status"] == "no_model_serves"
    done = cli("check", url=pool.url)
    assert done.returncode == 2 and done.stdout.startswith("ghost failed") and "no model can serve" in done.stderr


def test_a_planned_restart_is_not_an_alert(make_pool):
    """An operator's restart drains without turning the model degraded: no warning event,
    check exits 0 (and says a restart is under way), /ready stays 200. A crash still alerts.
    The worker is held (SIGSTOP) while the drain is looked at: its request still runs then on
    any machine."""
    pool = make_pool([synthetic("syn", tps=10, tokens=30, drain_timeout_s=60)],  # 3 s a request, once let go
                     server={"liveness_s": 60})  # a held worker is not taken for a dead one
    result = {}
    runner = threading.Thread(target=lambda: result.setdefault("r", chat(pool, "syn")))
    runner.start()
    wait_for(lambda: pool.model("syn")["runtime_inflight"] == 1, 5, what="the request in flight")
    with frozen(psutil.Process(pool.workers("syn")[0]["pid"])):  # let go after: the request ends, then the restart
        restarter = threading.Thread(target=lambda: result.setdefault("restart", pool.http.post(
            "/admin/models/syn/restart", headers={"X-LLM-Pool-Client": "cli"})))
        restarter.start()
        wait_for(lambda: pool.workers("syn")[0]["state"] == "restarting", 5, what="the drain")
        view = pool.model("syn")
        assert view["state"] == "loaded" and view["error"] is None
        [planned] = view["restarting"]
        assert planned["name"] == "syn/0" and 0 < planned["drain_left_s"] <= 60
        assert 0 < pool.workers("syn")[0]["restart_drain_left_s"] <= 60
        health = pool.http.get("/health").json()
        assert health["status"] == "ok" and health["unhealthy"] == [] and health["models"]["syn"]["restarting"] == ["syn/0"]
        assert pool.http.get("/ready").status_code == 200
        done = cli("check", url=pool.url)
        assert done.returncode == 0 and "syn/0 restarting" in done.stdout, (done.stdout, done.stderr)
    runner.join(30)
    restarter.join(30)
    assert result["r"].status_code == 200 and result["restart"].status_code == 200
    assert pool.model("syn")["state"] == "loaded" and pool.model("syn")["restarting"] == []
    time.sleep(1.5)  # a sample of the model's state (one a second) would have seen a degraded model
    seen = events(pool)
    assert not [e for e in seen if e["level"] != "info" or e["kind"] == "state"], seen

    # a crash is no planned work: it alerts
    os.kill(pool.workers("syn")[0]["pid"], signal.SIGKILL)
    crash = wait_for(lambda: [e for e in events(pool) if e["kind"] == "crashed"], 10, what="the crash event")
    assert crash[0]["level"] == "error"


def test_an_unload_and_a_reload_are_planned_work_too(make_pool):
    """An operator's unload and a reload that changes a model drain what runs: each model shows
    `unloading` with why, what still runs and when the drain stops waiting, in /health,
    /admin/models and `check` (which exits 0), and no warning event is raised. Both workers are
    held (SIGSTOP) while this is looked at, so both requests still run on any machine."""
    slow = {"tps": 10, "tokens": 20}  # 2 s a request, once let go
    pool = make_pool([synthetic("a", **slow), synthetic("b", **slow), synthetic("c")],  # c serves on
                     server={"liveness_s": 60})  # a held worker is not taken for a dead one
    with ThreadPoolExecutor(4) as ex, contextlib.ExitStack() as held:
        running = [ex.submit(chat, pool, name) for name in ("a", "b")]
        wait_for(lambda: all(pool.model(n)["runtime_inflight"] == 1 for n in ("a", "b")), 10, what="both in flight")
        held.enter_context(frozen(*(psutil.Process(pool.workers(n)[0]["pid"]) for n in ("a", "b"))))
        unload = ex.submit(pool.http.post, "/admin/models/a/unload", headers={"X-LLM-Pool-Client": "cli"})
        pool.rewrite_config([synthetic("a", **slow), with_options(synthetic("b", **slow), output_tokens=5),
                        synthetic("c")])
        assert pool.http.post("/admin/reload").json()["reloaded"] == ["b"]
        wait_for(lambda: all(pool.model(n)["state"] == "unloading" for n in ("a", "b")), 10, what="both unloading")
        a, b = pool.model("a")["unloading"], pool.model("b")["unloading"]
        assert a["why"] == "asked by cli" and b["why"] == "its config changed"
        assert a["draining"] == b["draining"] == 1 and 0 < a["drain_left_s"] <= 600 and 0 < b["drain_left_s"]
        health = pool.http.get("/health").json()
        assert health["status"] == "ok" and health["unhealthy"] == [] and health["models"]["a"]["unloading"] == {
            **a, "drain_left_s": health["models"]["a"]["unloading"]["drain_left_s"]}
        done = cli("check", url=pool.url)
        assert done.returncode == 0, (done.stdout, done.stderr)
        assert "a unloading (asked by cli; 1 request draining, at most" in done.stdout
        assert "b unloading (its config changed; 1 request draining" in done.stdout
        held.close()  # let go: both run to their end, then stop
        assert [r.result().status_code for r in running] == [200, 200]
        assert unload.result().json()["state"] == "unloaded"
    wait_for(lambda: pool.model("b")["state"] == "loaded", 15, what="b loaded again")
    assert pool.model("a")["unloading"] is None and pool.model("b")["unloading"] is None
    seen = events(pool)
    assert not [e for e in seen if e["level"] != "info"], seen


def test_every_answer_carries_a_request_id_and_its_row_finds_it(make_pool):
    """x-request-id on every answer (request-id too on the Messages routes), the client's own
    when it is safe; the request log row holds it with the replica that served the request."""
    pool = make_pool([synthetic("syn", replicas=2)])
    fresh = re.compile(r"req_[0-9a-f]{32}")
    r = chat(pool, "syn")
    assert r.status_code == 200 and fresh.fullmatch(r.headers["x-request-id"])
    mine = httpx.post(pool.url + "/v1/chat/completions", headers={"x-request-id": "client-abc-123"},
                      json={"model": "syn", "messages": [{"role": "user", "content": "hi"}]})
    assert mine.status_code == 200 and mine.headers["x-request-id"] == "client-abc-123"
    for unsafe in ("has a space", "x" * 129):  # replaced, never echoed
        got = chat_with_id(pool, unsafe)
        assert fresh.fullmatch(got.headers["x-request-id"]), got.headers
    bad = httpx.post(pool.url + "/v1/chat/completions", headers={"x-request-id": "bad-1"},
                     json={"model": "syn", "messages": "not a list"})
    assert bad.status_code == 400 and bad.headers["x-request-id"] == "bad-1"
    for answer in (pool.http.get("/v1/models"), pool.http.get("/nowhere"), pool.http.get("/admin/models"),
                   pool.http.get("/health")):
        assert fresh.fullmatch(answer.headers["x-request-id"]), answer
    message = httpx.post(pool.url + "/v1/messages", headers={"anthropic-version": "2023-06-01"},
                         json={"model": "syn", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]})
    assert message.status_code == 200 and fresh.fullmatch(message.headers["request-id"])
    assert message.headers["x-request-id"] == message.headers["request-id"]

    with httpx.stream("POST", pool.url + "/v1/chat/completions", headers={"x-request-id": "stream-1"}, json={
            "model": "syn", "stream": True, "messages": [{"role": "user", "content": "hi"}]}) as streamed:
        assert streamed.headers["x-request-id"] == "stream-1" and "[DONE]" in streamed.read().decode()
    [row] = wait_for(lambda: pool.http.get("/admin/requests", params={"id": "stream-1"}).json()["requests"], 5,
                     what="the stream's row")
    assert row["status"] == 200 and row["replica"] in ("syn/0", "syn/1")

    row = wait_for(lambda: (rows := pool.http.get("/admin/requests", params={"id": "client-abc-123"}).json()[
        "requests"]) and rows, 5, what="the row")
    [row] = row
    assert row["request_id"] == "client-abc-123" and row["replica"] in ("syn/0", "syn/1") and row["status"] == 200
    [refused] = wait_for(lambda: pool.http.get("/admin/requests", params={"id": "bad-1"}).json()["requests"], 5,
                         what="the 400's row")
    assert refused["status"] == 400 and refused["replica"] is None
    assert pool.http.get("/admin/requests", params={"id": "nobody"}).json()["requests"] == []
    done = cli("requests", "--id", "client-abc-123", url=pool.url)  # --id prints the request's story
    assert done.returncode == 0 and f"request client-abc-123 (row {row['id']})" in done.stdout, done.stdout
    assert f"replica {row['replica']}," in done.stdout and "end: HTTP 200" in done.stdout, done.stdout


def chat_with_id(pool, rid: str) -> httpx.Response:
    return httpx.post(pool.url + "/v1/chat/completions", headers={"x-request-id": rid},
                      json={"model": "syn", "messages": [{"role": "user", "content": "hi"}]})


def test_fold_folds_repeats_within_the_window_whatever_came_between():
    from supervisor.events import fold

    def ev(i: int, ts: float, kind: str = "crashed", message: str = "replica m/0 exited unexpectedly with SIGKILL"):
        return {"id": i, "ts": ts, "kind": kind, "level": "error", "model": "m", "replica": 0, "by": None,
                "message": message}

    rows = [ev(1, 0), ev(2, 1, "state", "model m is degraded"), ev(3, 3), ev(4, 6), ev(5, 7, "loaded", "m loaded"),
            ev(6, 500)]  # the last one comes after a quiet window: a row of its own
    folded = fold(rows, window_s=120)
    assert [(f["id"], f["kind"], f["count"]) for f in folded] == [(2, "state", 1), (4, "crashed", 3),
                                                                  (5, "loaded", 1), (6, "crashed", 1)]
    assert folded[1]["first_ts"] == 0 and folded[1]["ts"] == 6
    assert fold([]) == []


def test_a_crash_loop_is_one_line_and_the_supervisors_start_and_stop_are_events(make_pool):
    """Five crashes in a row: one folded row (`events`, the API), and `events -f`, which was
    following them, prints the first at once and then the count at most every 10 s, not a
    line per crash."""
    pool = make_pool([synthetic("syn")])
    env = {k: v for k, v in os.environ.items() if k not in ("LLM_POOL_URL", "LLM_POOL_ADMIN_KEY")}
    follower = subprocess.Popen([sys.executable, "-m", "supervisor.cli", "events", "-f", "--url", pool.url],
                                cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    followed: list[tuple[float, str]] = []  # (when read, line)
    reader = threading.Thread(target=lambda: followed.extend((time.monotonic(), line) for line in follower.stdout),
                              daemon=True)
    reader.start()
    try:
        wait_for(lambda: any("ready" in line for _, line in followed), 30, what="events -f printing")
        for crash in range(5):
            os.kill(pool.workers("syn")[0]["pid"], signal.SIGKILL)
            wait_for(lambda: (w := pool.workers("syn")[0])["state"] == "ready" and w["restarts"] == crash + 1, 30,
                     what=f"restart {crash + 1}")
        wait_for(lambda: any("crashed ×5" in line for _, line in followed), 30, what="events -f: crashed ×5")
    finally:
        stop_tree(follower, set(), 10)
    crashes = [(at, line) for at, line in followed if "crashed" in line]
    assert "×" not in crashes[0][1] and "(×5 over " in crashes[-1][1], followed  # the first alone, then counts
    # a count at most every 10 s after the first line, and the last one: not a line per crash
    # (however long the loop took on this machine)
    assert len(crashes) <= 2 + (crashes[-1][0] - crashes[0][0]) // 10, crashes
    assert len(crashes) < 5 or crashes[-1][0] - crashes[0][0] >= 20, crashes
    wait_for(lambda: len([e for e in events(pool) if e["kind"] == "crashed"]) == 5, 5, what="five crash events")
    folded = pool.http.get("/admin/events", params={"fold": "true"}).json()["events"]
    [loop] = [e for e in folded if e["kind"] == "crashed"]
    assert loop["count"] == 5 and loop["first_ts"] < loop["ts"]
    out = cli("events", url=pool.url)
    [line] = [line for line in out.stdout.splitlines() if "crashed" in line]
    assert "crashed ×5" in line and "(×5 over " in line, out.stdout
    assert len([line for line in cli("events", "--each", url=pool.url).stdout.splitlines() if "crashed" in line]) == 5

    kinds = [e["kind"] for e in events(pool)]
    assert kinds[:1] == ["started"] and "ready" in kinds
    ready = next(e for e in events(pool) if e["kind"] == "ready")
    assert ready["message"] == "supervisor ready: 1 of 1 models can serve" and ready["model"] is None
    path = pool.config_path.parent / "state" / "llm-pool" / "events.sqlite3"
    pool.stop()
    with closing(sqlite3.connect(path)) as db:
        rows = [tuple(r) for r in db.execute("SELECT kind, by FROM events ORDER BY id")]
    assert rows[-1] == ("stopped", None) and ("stopping", "SIGTERM") in rows, rows  # the model's unload between


def test_a_crash_restart_backing_off_shows_its_countdown(make_pool):
    pool = make_pool([synthetic("syn", replicas=2)])
    for crash in range(4):  # crashes in a row back off longer each time: 0, 0.5, 1, then 2 s (base_s 0.5)
        # /ready needs one replica of two: replica 0 may still be starting at first
        pid = wait_for(lambda: (w := pool.workers("syn")[0])["state"] == "ready" and w["pid"], 30,
                       what="replica 0 ready")
        os.kill(pid, signal.SIGKILL)
        if crash < 3:
            wait_for(lambda: (w := pool.workers("syn")[0])["state"] == "ready" and w["pid"] != pid, 30,
                     what=f"restart {crash + 1}")
    worker = wait_for(lambda: (w := pool.workers("syn")[0])["state"] == "backoff" and w, 10, what="backing off")
    assert worker["restart_in_s"] is not None and worker["restart_in_s"] >= 0
    [why] = pool.model("syn")["replica_errors"]
    assert why["state"] == "backoff" and "; restarting in " in why["reason"], why
