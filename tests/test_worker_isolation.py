"""What a worker keeps from others, and what it survives: its model's options
(secrets among them) never in argv, no key of the pool or of another model in
its environment or its runtime's, no URL credentials in a view or a log; and a
supervisor that stops for a while (SIGSTOP) is waited for, not given up on."""

from __future__ import annotations

import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil

from tests.conftest import synthetic
from tests.pool import wait_for
from tests.scripted_openai import ScriptedHandler, serve, sse_chunks

CHAT = "/v1/chat/completions"


class Echo(ScriptedHandler):
    bodies: list[dict] = []

    def answer(self, body: dict) -> tuple[int, str, str]:
        return 200, "text/event-stream", sse_chunks(
            [{"index": 0, "delta": {"content": "ok"}}, {"index": 0, "delta": {}, "finish_reason": "stop"}])


def remote(name: str, base_url: str, **options) -> dict:
    return {"name": name, "backend": "openai_remote", "options": {"base_url": base_url, "model": "m", **options}}


def test_secrets_stay_out_of_argv_other_workers_and_views(make_pool):
    with serve(Echo) as upstream:
        host = upstream.url.removeprefix("http://")
        pool = make_pool(
            [remote("a", upstream.url + "/v1", api_key_env="KEY_A"),
             remote("b", upstream.url + "/v1", api_key_env="KEY_B", extra_body={"token": "xb-token-secret"}),
             remote("c", f"http://someone:url-secret@{host}/v1"),
             {**(s := synthetic("s")), "options": {**s["options"], "grandchild": True}}],
            env={"KEY_A": "ka-secret", "KEY_B": "kb-secret", "LLM_POOL_API_KEY": "pool-api-secret",
                 "LLM_POOL_ADMIN_KEY": "pool-admin-secret"})
        pool.http.headers["Authorization"] = "Bearer pool-admin-secret"
        for name in ("a", "b", "c"):  # each still works: its options and its own key reached it
            r = pool.http.post(CHAT, json={"model": name, "messages": [{"role": "user", "content": "x"}]})
            assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "ok", r.text
        assert any(b.get("token") == "xb-token-secret" for b in upstream.bodies)  # extra_body arrived

        secrets = ["ka-secret", "kb-secret", "xb-token-secret", "url-secret", "pool-api-secret", "pool-admin-secret"]
        workers = {w["model"]: w for w in pool.workers()}
        for model, w in workers.items():
            proc = psutil.Process(w["pid"])
            cmdline = " ".join(proc.cmdline())
            assert not [s for s in secrets if s in cmdline], (model, cmdline)
            env = proc.environ()
            assert "LLM_POOL_API_KEY" not in env and "LLM_POOL_ADMIN_KEY" not in env, model
            assert ("KEY_A" in env) == (model == "a") and ("KEY_B" in env) == (model == "b"), model
            for child in proc.children(recursive=True) + [psutil.Process(c["pid"]) for c in w["children"]]:
                child_env = child.environ()
                assert not {"LLM_POOL_API_KEY", "LLM_POOL_ADMIN_KEY", "KEY_A", "KEY_B"} & child_env.keys()
        assert workers["s"]["children"], "the synthetic grandchild was not seen"

        views = json.dumps(pool.http.get("/admin/workers").json()) + json.dumps(pool.http.get("/admin/models").json())
        assert "url-secret" not in views and "***@" in views
        logs = pool.log_path.read_text(errors="replace") + "".join(
            p.read_text(errors="replace") for p in (pool.config_path.parent / "state").rglob("*.log"))
        assert not [s for s in secrets if s in logs]


def test_a_stopped_supervisor_is_waited_for_and_its_streams_resume(make_pool):
    """SIGSTOP of the supervisor for 15 s (3x liveness_s) while two streams run:
    no worker exits (it lives, so it is only slow), none is killed after SIGCONT,
    and both streams end whole."""
    pool = make_pool([synthetic("x", tps=20, tokens=500), synthetic("y", tps=20, tokens=500)])
    pids = {w["model"]: w["pid"] for w in pool.workers()}
    seen = {"x": 0, "y": 0}

    def stream(model: str) -> tuple[int, str | None]:
        """(completion tokens in the final usage, finish_reason); tokens delayed by the stall arrive merged."""
        tokens, reason = 0, None
        with httpx.stream("POST", pool.url + CHAT, timeout=120, json={
                "model": model, "stream": True, "stream_options": {"include_usage": True},
                "messages": [{"role": "user", "content": "go"}]}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    event = json.loads(line[6:])
                    for choice in event["choices"]:
                        seen[model] += bool(choice["delta"].get("content"))
                        reason = choice.get("finish_reason") or reason
                    if event.get("usage"):
                        tokens = event["usage"]["completion_tokens"]
        return tokens, reason

    with ThreadPoolExecutor(2) as ex:
        streams = [ex.submit(stream, m) for m in ("x", "y")]
        wait_for(lambda: min(seen.values()) >= 5, 30, what="both streams under way")
        os.kill(pool.proc.pid, signal.SIGSTOP)
        try:
            time.sleep(15)  # the stall under test (not a wait for a condition)
            assert all(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE for pid in pids.values())
            assert all(psutil.pid_exists(pid) for pid in pids.values()), "a worker gave up on a stopped supervisor"
        finally:
            os.kill(pool.proc.pid, signal.SIGCONT)
        results = [s.result(timeout=120) for s in streams]
    assert results == [(500, "stop"), (500, "stop")], results
    assert {w["model"]: w["pid"] for w in pool.workers()} == pids
    assert all(w["restarts"] == 0 for w in pool.workers())
    # dead is not slow: a killed supervisor's workers go at once, not after supervisor_patience_s (120 s)
    pool.proc.kill()
    pool.proc.wait(10)
    wait_for(lambda: not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
                             for pid in pids.values()), 10, what="workers gone with their supervisor")
