"""The operator at 3 a.m.: a degraded model is visible everywhere (admin, /health,
/metrics, the CLI), every failure says why, an operator restart drains, and the
event timeline (GET /admin/events, `llm-pool events`) tells what happened and
who asked. Real pools, real workers, the real CLI as a subprocess."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading

import httpx
import pytest

from tests.conftest import synthetic
from tests.pool import ROOT, wait_for
from tests.test_cli import cli, table_rows, with_options
from tests.test_ops import scrape, value


def break_spawns(pool) -> tuple:
    """Make every new worker spawn fail (its log directory is a file now): a crash
    restart then goes fatal at once, with a reason."""
    logs = pool.config_path.parent / "state" / "llm-pool" / "logs"
    saved = logs.with_name("logs.saved")
    shutil.move(logs, saved)
    logs.write_text("not a directory")
    return logs, saved


def mend_spawns(logs, saved) -> None:
    logs.unlink()
    shutil.move(saved, logs)


def events(pool, **params) -> list[dict]:
    return pool.http.get("/admin/events", params=params).json()["events"]


def test_a_degraded_model_is_visible_everywhere_and_check_fails(make_pool):
    pool = make_pool([synthetic("syn", replicas=2), synthetic("ok")])
    broken = break_spawns(pool)
    victim = pool.workers("syn")[1]["pid"]
    os.kill(victim, signal.SIGKILL)
    wait_for(lambda: pool.workers("syn")[1]["state"] == "fatal", 20, what="syn/1 fatal")

    view = pool.model("syn")
    assert (view["state"], view["ready"], view["configured"]) == ("degraded", 1, 2)
    [bad] = view["replica_errors"]
    assert bad["replica"] == 1 and bad["state"] == "fatal" and "cannot spawn the worker" in bad["reason"]
    assert "syn/1 fatal" in view["error"] and "cannot spawn" in view["error"]
    assert pool.model("ok")["state"] == "loaded" and pool.model("ok")["error"] is None
    worker = pool.workers("syn")[1]
    assert worker["last_exit"] == "SIGKILL" and worker["last_exit_code"] == -signal.SIGKILL

    # it still serves: /ready stays 200; /health and /metrics tell the truth
    assert pool.http.get("/ready").status_code == 200
    health = pool.http.get("/health").json()
    assert health["status"] == "degraded" and health["unhealthy"] == ["syn"] and health["ready"] is True
    assert health["models"]["syn"]["state"] == "degraded" and "cannot spawn" in health["models"]["syn"]["reason"]
    samples = scrape(pool)
    assert value(samples, "llm_pool_model_state", model="syn", state="degraded") == 1
    assert value(samples, "llm_pool_model_state", model="syn", state="loaded") == 0
    assert value(samples, "llm_pool_model_state", model="ok", state="loaded") == 1
    assert value(samples, "llm_pool_model_replicas_ready", model="syn") == 1

    # the CLI: check exits 2 and says why; models and ps show the state and the reason
    done = cli("check", url=pool.url)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert done.stdout.startswith("syn degraded (1/2 ready): ") and "cannot spawn" in done.stdout
    assert "degraded or failed" in done.stderr
    models = {r["NAME"]: r for r in table_rows(cli("models", "-o", "wide", url=pool.url).stdout)}
    assert models["syn"]["STATE"] == "degraded" and "cannot spawn" in models["syn"]["ERROR"]
    ps = {(r["MODEL"], r["REPLICA"]): r for r in table_rows(cli("ps", "-o", "wide", url=pool.url).stdout)}
    assert ps[("syn", "1")]["STATE"] == "fatal" and ps[("syn", "1")]["LAST EXIT"] == "SIGKILL"
    assert "cannot spawn" in ps[("syn", "1")]["ERROR"]

    # the timeline: crash, fatal, degraded; the supervisor log says the same
    wait_for(lambda: any(e["kind"] == "state" for e in events(pool)), 5, what="the degraded event")
    kinds = [(e["kind"], e["model"], e["replica"]) for e in events(pool, model="syn")]
    assert ("crashed", "syn", 1) in kinds and ("fatal", "syn", 1) in kinds and ("state", "syn", None) in kinds
    assert kinds.index(("crashed", "syn", 1)) < kinds.index(("fatal", "syn", 1))
    crash = next(e for e in events(pool) if e["kind"] == "crashed")
    assert "SIGKILL" in crash["message"]
    assert "replica syn/1 is fatal" in pool.log() and "model syn is degraded" in pool.log()

    # an operator restart (by the CLI) brings it back; check is happy again
    mend_spawns(*broken)
    done = cli("restart", "syn/1", url=pool.url)
    assert done.returncode == 0, done.stderr
    assert pool.model("syn")["state"] == "loaded"
    assert cli("check", url=pool.url).returncode == 0
    restart = [e for e in events(pool) if e["kind"] == "restarting"]
    assert restart and restart[-1]["by"] == "cli" and restart[-1]["replica"] == 1
    assert "asked by cli" in pool.log()

    # paging: after_id gives what came after, oldest first
    first = events(pool, limit=2)
    later = events(pool, after_id=first[0]["id"], limit=1)
    assert [e["id"] for e in later] == [first[1]["id"]]
    out = cli("events", "--model", "syn", url=pool.url)
    assert out.returncode == 0 and "fatal" in out.stdout and "asked by cli" in out.stdout


def test_check_exit_codes(make_pool):
    pool = make_pool([synthetic("a")])
    assert cli("check", url=pool.url).returncode == 0
    # a model whose load failed beside one that serves: the pool is ready (the start-up loads
    # settled, one model serves), and check exits 2 naming the failed one with why
    pool2 = make_pool([synthetic("quick"), with_options(synthetic("stuck", load_timeout_s=1), load_ms=60_000)],
                      wait_ready=False)
    wait_for(lambda: pool2.model("stuck")["state"] == "failed", 30, what="stuck failed")
    # quick may still be loading on a busy machine (/ready says "starting" until it settles)
    wait_for(lambda: pool2.http.get("/ready").status_code == 200, 30, what="the pool ready with quick serving")
    done = cli("check", url=pool2.url)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert done.stdout.startswith("stuck failed (0/1 ready): ") and "load_timeout_s" in done.stdout
    assert "waiting for" not in done.stdout + done.stderr


def test_unloading_a_failed_model_keeps_its_failure_exported(make_pool):
    """Issue 58: after `unload` of a model whose load failed, /health still says failed, and so does
    /metrics (llm_pool_model_last_load_failed, which LlmPoolModelFailed reads): the alert holds."""
    pool = make_pool([synthetic("quick"), with_options(synthetic("stuck", load_timeout_s=1), load_ms=60_000)],
                     wait_ready=False)
    wait_for(lambda: pool.model("stuck")["state"] == "failed", 30, what="stuck failed")
    assert pool.http.post("/admin/models/stuck/unload").status_code == 200
    wait_for(lambda: pool.model("stuck")["state"] == "unloaded", 30, what="stuck unloaded")
    metrics = pool.http.get("/metrics").text
    assert 'llm_pool_model_last_load_failed{model="stuck"} 1.0' in metrics
    assert 'llm_pool_model_last_load_failed{model="quick"} 0.0' in metrics
    assert pool.http.get("/health").json()["status"] == "failed"


def test_a_failed_loads_replicas_stay_listed_with_their_reason_and_log(make_pool):
    pool = make_pool([synthetic("quick"), with_options(synthetic("stuck", load_timeout_s=1), load_ms=60_000)],
                     wait_ready=False)
    wait_for(lambda: pool.model("stuck")["state"] == "failed", 30, what="stuck failed")
    [worker] = pool.workers("stuck")
    assert worker["state"] == "stopped" and "load_timeout_s" in worker["last_error"] and worker["pid"] is None
    assert "load_timeout_s" in pool.model("stuck")["error"]
    r = pool.http.get("/admin/models/stuck/logs", params={"replica": 0})
    assert r.status_code == 200 and r.json()["path"].endswith("stuck-0.log")  # selectable (empty: it never loaded)
    rows = {(r["MODEL"], r["REPLICA"]): r for r in table_rows(cli("ps", "-o", "wide", url=pool.url).stdout)}
    assert "load_timeout_s" in rows[("stuck", "0")]["ERROR"]
    failed = [e for e in events(pool) if e["kind"] == "load_failed"]
    assert failed and failed[0]["model"] == "stuck" and failed[0]["level"] == "error"


def chat(pool, model: str, **extra) -> httpx.Response:
    return httpx.post(pool.url + "/v1/chat/completions", timeout=60,
                      json={"model": model, "messages": [{"role": "user", "content": "hi"}], **extra})


def test_restart_drains_then_now_cuts_with_runtime_restarted(make_pool):
    pool = make_pool([synthetic("syn", tps=20, tokens=400)])  # 20 s a request; 2 s with max_tokens=40
    before = pool.workers("syn")[0]
    result = {}
    runner = threading.Thread(target=lambda: result.setdefault("r", chat(pool, "syn", max_tokens=40)))
    runner.start()
    wait_for(lambda: pool.model("syn")["runtime_inflight"] == 1, 5, what="the request in flight")
    done = cli("restart", "syn", url=pool.url)
    runner.join(30)
    assert done.returncode == 0, done.stderr
    r = result["r"]
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 40  # it finished whole
    after = pool.workers("syn")[0]
    assert after["pid"] != before["pid"] and after["restarts"] == before["restarts"] + 1

    # --now (the API's now=true): the running request (20 s) is cut, with a plain code and message
    result.clear()
    runner = threading.Thread(target=lambda: result.setdefault("r", chat(pool, "syn")))
    runner.start()
    wait_for(lambda: pool.model("syn")["runtime_inflight"] == 1, 5, what="the request in flight")
    assert cli("restart", "syn", "--now", url=pool.url).returncode == 0
    runner.join(30)
    assert result["r"].status_code == 503, result["r"].text
    error = result["r"].json()["error"]
    assert error["code"] == "runtime_restarted" and "restarted by the operator" in error["message"]


def test_a_drain_that_runs_out_cuts_with_runtime_restarted(make_pool):
    pool = make_pool([synthetic("syn", tps=10, tokens=100, drain_timeout_s=0.5)])  # 10 s a request
    result = {}
    runner = threading.Thread(target=lambda: result.setdefault("r", chat(pool, "syn")))
    runner.start()
    wait_for(lambda: pool.model("syn")["runtime_inflight"] == 1, 5, what="the request in flight")
    r = pool.http.post("/admin/models/syn/restart", headers={"X-LLM-Pool-Client": "page"})
    runner.join(30)
    assert r.status_code == 200
    error = result["r"].json()["error"]
    assert result["r"].status_code == 503 and error["code"] == "runtime_restarted"
    assert "drain_timeout_s (0.5s)" in error["message"]
    assert [e["by"] for e in events(pool) if e["kind"] == "restarting"] == ["page"]


def test_validation_errors_are_logged_with_model_code_and_message(make_pool):
    pool = make_pool([synthetic("syn")])
    r = httpx.post(pool.url + "/v1/chat/completions", json={"model": "syn", "messages": "not a list"})
    assert r.status_code == 400
    row = wait_for(lambda: (rows := pool.http.get("/admin/requests", params={"limit": 1}).json()["requests"])
                   and rows[0], 5, what="the row")
    assert row["model"] == "syn" and row["status"] == 400 and row["error_code"] == "invalid_request"
    assert row["error_message"] == r.json()["error"]["message"]
    classes = pool.http.get("/admin/requests", params={"status": "4xx"}).json()["requests"]
    assert [c["id"] for c in classes] == [row["id"]]
    assert pool.http.get("/admin/requests", params={"status": "5xx"}).json()["requests"] == []
    summary = pool.http.get("/admin/requests/summary").json()
    assert summary["errors"] == 1 and summary["error_rate"] == 1.0 and summary["in_flight"] == []


def test_the_error_rate_splits_client_from_server_errors_and_a_bad_request_names_its_tenant(make_pool):
    """400s are the client's, 5xx the pool's: the summary counts them apart, and a bad body
    sent with a tenant's key is logged with that tenant (who sends garbage?)."""
    model = synthetic("syn")
    model["options"].update(chaos="lone_surrogate", chaos_prompt="boom")  # "boom": the worker fails it, 502
    admin = {"Authorization": "Bearer sk-admin"}
    pool = make_pool([model], server={"admin_key": "sk-admin"}, tenants=[{"name": "team-a", "keys": ["sk-a"]}])
    team = {"Authorization": "Bearer sk-a"}
    ask = lambda body: httpx.post(pool.url + "/v1/chat/completions", headers=team, json=body, timeout=30)  # noqa: E731
    assert ask({"model": "syn", "messages": [{"role": "user", "content": "hi"}]}).status_code == 200
    assert ask({"model": "syn", "messages": "not a list"}).status_code == 400
    r = httpx.post(pool.url + "/v1/embeddings", headers=team, json={"model": "syn", "input": "x", "stream": True})
    assert r.status_code == 400
    assert ask({"model": "syn", "messages": [{"role": "user", "content": "boom"}]}).status_code == 502
    rows = wait_for(lambda: (got := pool.http.get("/admin/requests", headers=admin).json()["requests"])
                    and len(got) == 4 and got, 5, what="four rows")
    refused = [row for row in rows if row["status"] == 400]
    assert [(row["tenant"], row["error_code"]) for row in refused] == [("team-a", "invalid_request")] * 2
    summary = pool.http.get("/admin/requests/summary", headers=admin).json()
    assert (summary["requests"], summary["client_errors"], summary["server_errors"]) == (4, 2, 1)
    assert (summary["client_error_rate"], summary["server_error_rate"]) == (0.5, 0.25)
    assert summary["error_tenants"] == [{"tenant": "team-a", "4xx": 2, "5xx": 1}]


def follow(*args: str, url: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("LLM_POOL_URL", "LLM_POOL_ADMIN_KEY")}
    return subprocess.Popen([sys.executable, "-m", "supervisor.cli", *args, "--url", url], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def read_until(proc: subprocess.Popen, text: str, timeout: float = 15) -> list[str]:
    """Lines of a following CLI until one holds `text` (a reader thread: never blocks past the deadline)."""
    seen: list[str] = []
    found = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            seen.append(line)
            if text in line:
                found.set()
                return

    threading.Thread(target=read, daemon=True).start()
    assert found.wait(timeout), f"{text!r} not printed: {seen}"
    return seen


def stop(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGINT)
    try:
        return proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_logs_follow_and_events_follow(make_pool):
    pool = make_pool([synthetic("syn", aliases=["gpt-x"])])
    log_path = pool.config_path.parent / "state" / "llm-pool" / "logs" / "syn-0.log"
    tail = follow("logs", "syn", "-f", "-n", "5", url=pool.url)
    try:
        read_until(tail, "runtime ready")  # the last lines first
        with open(log_path, "a") as f:
            f.write("written by the test after the follow began\n")
        read_until(tail, "written by the test after the follow began")
    finally:
        assert stop(tail) == 0

    sup = follow("logs", "supervisor", "-f", url=pool.url)
    watch = follow("events", "-f", url=pool.url)
    finished = follow("requests", "-f", "--json", url=pool.url)
    try:
        read_until(sup, "loaded in")
        read_until(watch, "syn loaded in")
        assert pool.http.post("/v1/chat/completions", json={
            "model": "gpt-x", "messages": [{"role": "user", "content": "followed"}]}).status_code == 200
        row = json.loads(read_until(finished, '"model"')[-1])  # the request, once it finished
        assert row["model"] == "syn" and row["status"] == 200
        assert pool.http.post("/admin/models/gpt-x/unload").status_code == 200  # by its alias
        read_until(watch, "model syn unloaded")  # named by the model's name, not the alias
        read_until(sup, "model syn unloaded")
        assert "gpt-x unloaded" not in pool.log()
    finally:
        assert stop(sup) == 0 and stop(watch) == 0 and stop(finished) == 0
    done = cli("logs", "supervisor", "-n", "3", url=pool.url)
    assert done.returncode == 0 and len(done.stdout.splitlines()) == 3


@pytest.mark.llama
def test_a_killed_llama_server_is_named_by_its_signal_and_its_client_gets_plain_words(
        make_pool, tiny_gguf, llama_server_bin):
    from tests.conftest import IGNORE_EOS, llama

    pool = make_pool([llama("tiny", tiny_gguf, llama_server_bin, extra_args=IGNORE_EOS)])
    [child] = pool.workers("tiny")[0]["children"]
    lines: list[str] = []

    def long_stream() -> None:
        with pool.http.stream("POST", "/v1/chat/completions", json={
                "model": "tiny", "stream": True, "max_tokens": 100_000,
                "messages": [{"role": "user", "content": "go on"}]}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    lines.append(line[6:])

    runner = threading.Thread(target=long_stream)
    runner.start()
    wait_for(lambda: len(lines) >= 3, 30, what="tokens streaming")  # cut mid-stream, as in the field
    os.kill(child["pid"], signal.SIGKILL)
    runner.join(60)
    errors = [json.loads(line)["error"] for line in lines if '"error"' in line]
    assert errors and errors[-1]["code"] == "runtime_crashed", lines[-3:]
    assert "Error(" not in errors[-1]["message"] and "aiohttp" not in errors[-1]["message"], errors
    crash = wait_for(lambda: [e for e in events(pool) if e["kind"] == "crashed"], 10, what="the crash event")
    assert "llama-server was killed by SIGKILL" in crash[0]["message"], crash
    assert "llama-server was killed by SIGKILL" in pool.log()
    # the reason is the signal, not followed by the runtime's start-up lines (they are in its log)
    assert "\n" not in crash[0]["message"] and "listening on" not in crash[0]["message"], crash
    worker = wait_for(lambda: next((w for w in pool.workers("tiny") if w["state"] == "ready"
                                    and w["restarts"] == 1), None), 60, what="restarted")
    # its last exit is the runtime's (SIGKILL), not its worker's own code 1
    assert worker["last_exit"] == "SIGKILL" and worker["last_exit_code"] == -signal.SIGKILL
    assert worker["worker_exit_code"] == 1
    log = pool.http.get("/admin/models/tiny/logs", params={"lines": 10_000}).json()["lines"]
    assert any("listening on" in line for line in log)  # the runtime's output stays in the replica's log

