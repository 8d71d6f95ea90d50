"""One request's whole story (GET /admin/requests/story, `llm-pool requests --id`): a real
llama-server killed under a request, and the 502 row's story holds the crash event and the
replica's log lines from its time. Latency over time per model: the live samples' TTFT,
duration and queue wait p50/p95, against the request log's own rows."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from datetime import datetime

import httpx

from supervisor.telemetry.latency_window import percentile
from supervisor.telemetry.request_story import line_times
from tests.conftest import IGNORE_EOS, llama, synthetic
from tests.pool import wait_for
from tests.test_cli import cli


def test_log_line_times_come_from_the_worker_stamp_and_llama_servers_clock():
    start = datetime(2026, 12, 5, 10, 0, 0).timestamp()
    lines = [b"[llama-server] 0.00.001.000 I before any stamp",
             b"2026-12-05 10:00:00,250 m/0#1 INFO starting llama-server: /bin/llama-server -m x",
             b"[llama-server] 0.00.500.000 I srv load_model: loading",
             b"a line of its own with no stamp",
             b"[llama-server] 1.02.000.000 I srv slot launch",
             b"2026-12-05 10:00:01,000 m/0#1 INFO HTTP Request: GET /health"]
    times = line_times(lines)
    assert times[0] is None  # before the first stamped line: no time, never a guessed one
    assert abs(times[1] - (start + 0.25)) < 1e-6 and abs(times[2] - (start + 0.75)) < 1e-6
    assert times[3] == times[2]  # carried from the stamped line before it
    assert abs(times[4] - (start + 0.25 + 62)) < 1e-6 and abs(times[5] - (start + 1.0)) < 1e-6


def test_a_crashed_requests_story_holds_the_crash_event_and_the_log_lines(make_pool, tiny_gguf, llama_server_bin):
    pool = make_pool([llama("tiny", tiny_gguf, llama_server_bin, extra_args=IGNORE_EOS)])
    [runtime] = pool.workers("tiny")[0]["children"]
    result: dict = {}

    def ask() -> None:
        result["r"] = httpx.post(pool.url + "/v1/chat/completions", headers={"x-request-id": "doomed-1"},
                                 timeout=120, json={"model": "tiny", "max_tokens": 100_000, "stream": True,
                                                    "messages": [{"role": "user", "content": "hi"}]})

    asker = threading.Thread(target=ask)
    asker.start()
    wait_for(lambda: pool.model("tiny")["runtime_inflight"] == 1, 60, what="the request reached llama-server")
    time.sleep(0.5)  # it is generating
    os.kill(runtime["pid"], signal.SIGKILL)
    asker.join(60)
    assert result["r"].headers["x-request-id"] == "doomed-1"

    def told_crash() -> list | None:  # the crash event follows the row by the worker's exit (milliseconds)
        stories = pool.http.get("/admin/requests/story", params={"id": "doomed-1"}).json()["stories"]
        return stories if stories and any(e["kind"] == "crashed" for e in stories[0]["story"]["events"]) else None

    [entry] = wait_for(told_crash, 15, what="the row's story with the crash")
    row, story = entry["row"], entry["story"]
    assert row["status"] == 502 and row["error_code"] == "runtime_crashed", row
    assert story["replica"] == "tiny/0" and story["admission"]["tenant"] == row["tenant"]
    assert story["ttft_ms"] is not None and story["ttft_ms"] <= story["duration_ms"]
    assert story["started"] < story["ended"] <= row["ts"]
    crashes = [e for e in story["events"] if e["kind"] == "crashed" and e["model"] == "tiny"]
    assert crashes and all(story["started"] - 5 <= e["ts"] <= story["ended"] + 5 for e in story["events"])
    lines = story["log"]["lines"]
    assert any("runtime died: llama-server was killed by SIGKILL" in line for line in lines), story["log"]
    assert any("launch_slot" in line for line in lines), story["log"]  # llama-server's own, on its clock
    assert len(lines) <= 200

    done = cli("requests", "--id", "doomed-1", url=pool.url)
    assert done.returncode == 0, done.stderr
    assert "request doomed-1" in done.stdout and "replica tiny/0" in done.stdout
    assert "crashed tiny/0" in done.stdout and "log of tiny/0" in done.stdout, done.stdout
    missing = cli("requests", "--id", "nobody-here", url=pool.url)
    assert missing.returncode == 1 and "no request with id" in missing.stderr
    assert pool.http.get("/admin/requests/story").status_code == 400


def test_a_refused_requests_story_names_its_tenant_and_the_limit_it_hit(make_pool):
    pool = make_pool([synthetic("syn")], server={"api_key": "sk-default", "admin_key": "admin-secret"},
                     tenants=[{"name": "team", "keys": ["sk-team"], "rpm": 1}])
    for rid, status in (("rl-1", 200), ("rl-2", 429)):
        r = httpx.post(pool.url + "/v1/chat/completions", timeout=30,
                       headers={"x-request-id": rid, "authorization": "Bearer sk-team"},
                       json={"model": "syn", "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == status, r.text
    pool.http.headers["authorization"] = "Bearer admin-secret"  # the admin routes want the admin key
    [entry] = wait_for(lambda: pool.http.get("/admin/requests/story", params={"id": "rl-2"}).json()["stories"], 10,
                       what="the 429's row")
    story = entry["story"]
    assert story["admission"] == {"tenant": "team", "limits": {"rpm": 1}, "refused_by": "rate_limit_exceeded"}
    assert story["replica"] is None and story["log"]["lines"] == [] and story["end"]["status"] == 429
    [served] = pool.http.get("/admin/requests", params={"id": "rl-1"}).json()["requests"]
    [again] = pool.http.get("/admin/requests/story", params={"row": served["id"]}).json()["stories"]
    assert again["row"]["request_id"] == "rl-1" and again["story"]["admission"]["refused_by"] is None
    assert again["story"]["replica"] == "syn/0" and again["story"]["end"]["status"] == 200


def test_the_live_samples_carry_each_models_latency_percentiles(make_pool):
    pool = make_pool([synthetic("fast", tps=200, ttft_ms=30, tokens=8),
                      synthetic("slow", tps=100, ttft_ms=200, tokens=20)])
    ids = []
    for i in range(6):
        for model in ("fast", "slow"):
            r = httpx.post(pool.url + "/v1/chat/completions", timeout=30,
                           headers={"x-request-id": f"lat-{model}-{i}"},
                           json={"model": model, "messages": [{"role": "user", "content": f"hi {i}"}]})
            assert r.status_code == 200
            ids.append(r.headers["x-request-id"])

    def sample_with_all() -> dict | None:
        with httpx.stream("GET", pool.url + "/admin/live", timeout=10) as live:
            for line in live.iter_lines():
                if line.startswith("data: "):
                    history = json.loads(line[6:])
                    break
        for sample in reversed(history):
            figures = [(sample["models"].get(m) or {}).get("latency") for m in ("fast", "slow")]
            if all(f and f["n"] == 6 for f in figures):
                return sample
        return None

    sample = wait_for(sample_with_all, 15, what="a sample whose window holds all 12 requests")
    rows = pool.http.get("/admin/requests", params={"limit": 100}).json()["requests"]
    for model in ("fast", "slow"):
        mine = [r for r in rows if r["model"] == model]
        assert len(mine) == 6
        figures = sample["models"][model]["latency"]
        for stem, column in (("ttft", "ttft_ms"), ("duration", "duration_ms"), ("queued", "queued_ms")):
            values = [r[column] for r in mine]
            assert figures[f"{stem}_p50_ms"] == percentile(values, 50)
            assert figures[f"{stem}_p95_ms"] == percentile(values, 95) == max(values)
    fast, slow = sample["models"]["fast"]["latency"], sample["models"]["slow"]["latency"]
    assert 30 <= fast["ttft_p50_ms"] < slow["ttft_p50_ms"] and slow["ttft_p50_ms"] >= 200
    assert slow["duration_p95_ms"] > fast["duration_p95_ms"]
