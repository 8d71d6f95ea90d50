"""A request leaves no reference cycle behind in the supervisor. Garbage in a cycle is freed only
by Python's cycle collector, which then runs more often and walks more each time: a cycle per
request (a job's record held its fallback chain, which held the job; the send that adds the
request id was a closure holding itself, and through it uvicorn's request cycle) cost about
10 µs of a request's 190 at c = 16, and no other test saw it. A refused request too (the frame
that raised its error held the error, whose traceback held the frame). The real supervisor (its own
`server.run`, uvicorn and the edge's connection as in production) runs with a probe that,
between two marks, keeps what the collector finds (gc.DEBUG_SAVEALL) and then counts it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import httpx

from tests.conftest import synthetic
from tests.pool import Pool, wait_for

GC_PROBE = """
import collections, gc, json, pathlib, sys, threading, time
from supervisor.config import load_config
from supervisor.server import run

probe = pathlib.Path(sys.argv[2])

def watch():
    while not (probe / "start").exists():
        time.sleep(0.02)
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)  # from here on, what the collector finds is kept, to be counted
    (probe / "started").touch()
    while not (probe / "stop").exists():
        time.sleep(0.02)
    gc.collect()
    kinds = collections.Counter(type(o).__qualname__ for o in gc.garbage)
    (probe / "garbage.json").write_text(json.dumps(kinds))

threading.Thread(target=watch, daemon=True).start()
run(load_config(sys.argv[1]), "warning")
"""

REQUESTS = 40  # of each kind


def test_requests_leave_no_reference_cycle_in_the_supervisor(tmp_path):
    probe = tmp_path / "probe"
    probe.mkdir()
    pool = Pool(tmp_path, [synthetic("syn", tokens=4, capacity=4, target_inflight=4)])
    pool.command = [sys.executable, "-c", GC_PROBE, str(pool.config_path), str(probe)]
    pool.start()
    try:
        chat = {"model": "syn", "messages": [{"role": "user", "content": "hi"}]}
        # one keep-alive connection: a connection's own objects (uvicorn's protocol and its parser
        # hold each other) go to the collector when it closes, once a connection, not a request
        with httpx.Client(base_url=pool.url, timeout=30) as http:
            def requests() -> None:
                assert http.post("/v1/chat/completions", json=chat).status_code == 200
                with http.stream("POST", "/v1/chat/completions", json={**chat, "stream": True}) as r:
                    assert r.status_code == 200 and b"[DONE]" in r.read()
                assert http.post("/v1/responses", json={"model": "syn", "input": "hi"}).status_code == 200
                r = http.post("/v1/messages", json={**chat, "max_tokens": 4})
                assert r.status_code == 200, r.text
                # refused: by admission (no such model), and by the body's check
                assert http.post("/v1/chat/completions", json={**chat, "model": "nope"}).status_code == 404
                assert http.post("/v1/chat/completions", json={**chat, "n": "x"}).status_code == 400

            requests()  # what the first requests make for good (caches, the model's figures) is not garbage
            (probe / "start").touch()
            wait_for(lambda: (probe / "started").exists(), 10, what="the probe to start")
            for _ in range(REQUESTS):
                requests()
        (probe / "stop").touch()
        wait_for(lambda: (probe / "garbage.json").exists(), 10, what="the probe's count")
        garbage = json.loads((probe / "garbage.json").read_text())
    finally:
        pool.stop()
    # a cycle per request would leave at least REQUESTS objects of each of its kinds
    per_request = {kind: n for kind, n in garbage.items() if n >= REQUESTS}
    assert not per_request, json.dumps(garbage)
    assert not {"Job", "Chain", "Counted", "SendWithId"} & garbage.keys(), garbage
