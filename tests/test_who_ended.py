"""Who ended a worker, and why, on every surface (issue 47, item 2): a worker the pool
killed (malformed frames, no heartbeat) is reported as killed by the pool with its reason,
not as a mysterious SIGKILL; an outside SIGKILL says it came from outside the pool; an
operator's restart is the operator's. The events, /admin/workers (`last_exit_by`,
`last_exit_why`, `crashes` apart from `restarts`), `llm-pool ps`, /health, /metrics and the
request story. Real pools, real workers, the real CLI."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import psutil

from supervisor.replicas import exits
from tests.conftest import synthetic
from tests.pool import wait_for
from tests.test_cli import cli, table_rows
from tests.test_ops import scrape, value


def events(pool, kind: str, count: int = 1) -> list[dict]:
    """The events of that kind, once there are `count` (they are written off the loop)."""
    def found() -> list[dict] | None:
        got = [e for e in pool.http.get("/admin/events").json()["events"] if e["kind"] == kind]
        return got if len(got) >= count else None
    return wait_for(found, 10, what=f"{count} {kind} event(s)")


def chat(pool, model: str, rid: str | None = None):
    headers = {"x-request-id": rid} if rid else {}
    return pool.http.post("/v1/chat/completions", headers=headers, json={
        "model": model, "messages": [{"role": "user", "content": "hi"}]})


def ps_row(pool, model: str) -> dict:
    """`llm-pool ps -o wide`'s row of the model's replica 0 (every column, a row a line)."""
    done = cli("ps", "-o", "wide", url=pool.url)
    assert done.returncode == 0, done.stderr
    return next(r for r in table_rows(done.stdout) if r["MODEL"] == model and r["REPLICA"] == "0")


def test_a_worker_killed_for_malformed_frames_is_the_pools_everywhere(make_pool):
    pool = make_pool([_garbage("bad"), synthetic("ok")])
    answer = chat(pool, "bad", rid="rid-garbage")
    assert answer.status_code == 502 and answer.json()["error"]["code"] == "protocol_error", answer.text

    worker = wait_for(lambda: next((w for w in pool.workers("bad") if w["crashes"] == 1), None), 20,
                      what="the crash counted")
    assert worker["last_exit_by"] == "pool", worker
    assert worker["last_exit_why"].startswith("killed by the pool: malformed frames from its worker"), worker
    assert worker["last_exit"] == "SIGKILL"  # the signal stays what it was; who sent it is said beside it
    [crash] = events(pool, "crashed")
    assert "replica bad/0 killed by the pool: malformed frames" in crash["message"], crash
    assert "unexpectedly" not in crash["message"]

    # the request's story tells it too (the events around it)
    def told() -> list[str]:
        stories = pool.http.get("/admin/requests/story", params={"id": "rid-garbage"}).json()["stories"]
        return [e["message"] for s in stories for e in s["story"]["events"]]
    wait_for(lambda: any("killed by the pool: malformed frames" in m for m in told()), 10,
             what="the story's crash event")

    # crashes apart from restarts: on /admin/workers and in /metrics
    wait_for(lambda: pool.workers("bad")[0]["state"] == "ready", 20, what="restarted after the kill")
    worker = pool.workers("bad")[0]
    assert (worker["restarts"], worker["crashes"], worker["crashes_by"]) == (1, 1, {"pool": 1}), worker
    samples = scrape(pool)
    assert value(samples, "llm_pool_worker_crashes_total", model="bad", replica="0", by="pool") == 1
    assert value(samples, "llm_pool_worker_crashes_total", model="bad", replica="0", by="outside") == 0
    assert value(samples, "llm_pool_worker_restarts_total", model="bad", replica="0", reason="crash") == 1

    # `llm-pool ps`: CRASHES beside RESTARTS, and the last exit says who and why
    row = ps_row(pool, "bad")
    assert (row["RESTARTS"], row["CRASHES"]) == ("1", "1"), row
    assert row["LAST EXIT"] == "SIGKILL" and row["WHO ENDED IT"].startswith("killed by the pool: malformed frames"), row

    # until it gives up: fatal, and the fatal message names the pool's kill, not a bare SIGKILL
    def fatal() -> bool:
        if pool.workers("bad")[0]["state"] == "fatal":
            return True
        chat(pool, "bad")
        return False
    wait_for(fatal, 60, interval=0.2, what="bad/0 fatal")
    worker = pool.workers("bad")[0]
    assert worker["last_error"].startswith("too many crashes (last: killed by the pool: malformed frames"), worker
    [gave_up] = events(pool, "fatal")
    assert "too many crashes (last: killed by the pool: malformed frames" in gave_up["message"], gave_up
    health = pool.http.get("/health").json()
    assert "killed by the pool: malformed frames" in health["models"]["bad"]["reason"], health
    assert "SIGKILL" not in health["models"]["bad"]["reason"].split("(last: ")[1].split(":")[0]
    check = cli("check", url=pool.url)
    assert check.returncode != 0 and "killed by the pool: malformed frames" in check.stdout + check.stderr, check


def _garbage(name: str) -> dict:
    model = synthetic(name)
    model["options"]["chaos"] = "garbage"  # every job's first frame is not msgpack
    return model


def test_a_stopped_worker_is_killed_by_the_pool_for_its_silence(make_pool):
    pool = make_pool([synthetic("syn")], server={"heartbeat_s": 0.5, "liveness_s": 2.0,
                                                 "supervisor_patience_s": 60})
    pid = pool.workers("syn")[0]["pid"]
    psutil.Process(pid).suspend()  # SIGSTOP: its heartbeats stop; the pool's SIGKILL still ends it
    worker = wait_for(lambda: next((w for w in pool.workers("syn") if w["crashes"] == 1), None), 20,
                      what="the silent worker killed")
    assert worker["last_exit_by"] == "pool", worker
    assert worker["last_exit_why"].startswith("killed by the pool: no heartbeat for "), worker
    assert "liveness_s=2" in worker["last_exit_why"]
    [crash] = events(pool, "crashed")
    assert "replica syn/0 killed by the pool: no heartbeat" in crash["message"], crash
    wait_for(lambda: pool.workers("syn")[0]["state"] == "ready", 20, what="restarted")
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_an_outside_sigkill_says_it_came_from_outside_the_pool(make_pool):
    pool = make_pool([synthetic("syn")])
    os.kill(pool.workers("syn")[0]["pid"], signal.SIGKILL)
    worker = wait_for(lambda: next((w for w in pool.workers("syn") if w["crashes"] == 1), None), 20,
                      what="the crash counted")
    assert worker["last_exit_by"] == "outside", worker
    # this machine's kernel log is not readable without privileges: the pool says what it may be
    assert worker["last_exit_why"] in (
        "killed by SIGKILL from outside the pool (the OOM killer, or another process)",), worker
    [crash] = events(pool, "crashed")
    assert "replica syn/0 killed by SIGKILL from outside the pool" in crash["message"], crash
    row = ps_row(pool, "syn")
    assert row["WHO ENDED IT"].startswith("killed by SIGKILL from outside the pool"), row
    assert row["CRASHES"] == "1", row
    assert value(scrape(pool), "llm_pool_worker_crashes_total", model="syn", replica="0", by="outside") == 1


def test_an_operators_restart_and_unload_are_the_operators_and_no_crash(make_pool):
    pool = make_pool([synthetic("syn")])
    assert pool.http.post("/admin/models/syn/restart").status_code == 200
    worker = wait_for(lambda: next((w for w in pool.workers("syn") if w["state"] == "ready"
                                    and w["restarts"] == 1), None), 20, what="restarted")
    assert (worker["last_exit_by"], worker["last_exit_why"]) == ("operator", "stopped (restarted by the operator)")
    assert worker["crashes"] == 0 and worker["planned_restarts"] == 1
    assert not [e for e in pool.http.get("/admin/events").json()["events"] if e["kind"] == "crashed"]
    assert value(scrape(pool), "llm_pool_worker_crashes_total", model="syn", replica="0", by="pool") == 0


# -- the words, for what a test cannot make happen here (an OOM kill, a runtime that exits) ----------

def facts(**kw) -> exits.ExitFacts:
    base = dict(worker_code=1, planned=False, stop_by=exits.BY_PLANNED, stop_why=None, kill_why=None,
                runtime_code=None, runtime_killed_by_worker=False, message=None)
    return exits.ExitFacts(**{**base, **kw})


def test_the_words_of_each_kind_of_exit():
    assert exits.describe_exit(facts(worker_code=-9, kill_why="no heartbeat for 6s")) == (
        "pool", "killed by the pool: no heartbeat for 6s")
    assert exits.describe_exit(facts(runtime_code=-9, message="llama-server was killed by SIGKILL")) == (
        "outside", "crashed: llama-server was killed by SIGKILL, from outside the pool (the OOM killer, "
                   "or another process)")
    assert exits.describe_exit(facts(runtime_code=-9, runtime_killed_by_worker=True,
                                     message="llama-server was killed by SIGKILL (by its worker: still busy)")) == (
        "pool", "killed by the pool: llama-server was killed by SIGKILL (by its worker: still busy)")
    assert exits.describe_exit(facts(runtime_code=2, message="llama-server exited with code 2")) == (
        "self", "crashed: llama-server exited with code 2")
    assert exits.describe_exit(facts(worker_code=1), last_line="ValueError: bad token") == (
        "self", "exited with code 1: ValueError: bad token")
    assert exits.describe_exit(facts(worker_code=0, planned=True, stop_by="operator",
                                     stop_why="unload: asked by admin")) == (
        "operator", "stopped (unload: asked by admin)")
    assert exits.describe_exit(facts(worker_code=3, load_failed=True, message="no such file: m.gguf")) == (
        "self", "its load failed: no such file: m.gguf (then exited with code 3)")
    oom = "the kernel's OOM killer killed process 4242 (python3): out of memory"
    assert exits.describe_exit(facts(worker_code=-9), kernel_note=oom) == (
        "outside", f"killed by SIGKILL from outside the pool ({oom})")


def test_the_oom_killer_is_named_from_the_kernels_log():
    records = ["6,1001,5000000,-;Out of memory: Killed process 4242 (python3) total-vm:1kB, anon-rss:1kB",
               "6,1002,9000000,-;Memory cgroup out of memory: Killed process 77 (llama-server) total-vm:1kB"]
    assert "process 4242 (python3)" in exits.oom_note(records, 4242, now=100.0)
    assert exits.oom_note(records, 4243, now=100.0) is None  # another process's kill is not this one's
    # a runtime's pid the supervisor never knew: the OOM kill of the last minute
    assert "process 77 (llama-server)" in exits.oom_note(records, None, now=30.0)
    assert exits.oom_note(records, None, now=500.0) is None
    assert exits.oom_note([], 4242, now=1.0) is None


def test_the_last_meaningful_line_of_a_log(tmp_path: Path):
    log = tmp_path / "w.log"
    log.write_text("starting\nTraceback (most recent call last):\n  File \"x.py\", line 1\n"
                   "ValueError: the model file is truncated\n\n")
    assert exits.last_log_line(log) == "ValueError: the model file is truncated"
    assert exits.last_log_line(tmp_path / "none.log") is None


def test_a_load_the_pool_gave_up_on_says_its_cause(make_pool):
    slow = synthetic("slow", load_timeout_s=1.0, load_on_start=False)
    slow["options"]["load_ms"] = 60_000  # never ready within load_timeout_s
    pool = make_pool([slow])
    answer = pool.http.post("/admin/models/slow/load")
    assert answer.status_code == 503 and "runtime not ready within load_timeout_s=1" in answer.text, answer.text
    [worker] = pool.workers("slow")
    assert worker["last_exit_by"] == "pool", worker
    assert worker["last_exit_why"] == "killed by the pool: its load failed: runtime not ready within load_timeout_s=1.0"
    assert worker["crashes"] == 0  # a failed load is told by load_failed, not counted as a crash
