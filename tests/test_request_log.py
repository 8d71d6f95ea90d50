"""The request log (SQLite in the state dir) and the admin feeds the operator's
page reads: /admin/requests, the live samples and the live log tail over SSE,
`llm-pool requests`. Unit tests of the store, then real pools."""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import subprocess
import sys
import threading
import time
from contextlib import closing

import httpx
import pytest

from supervisor.telemetry.request_log import BODY_CHARS, REFUSED_ROWS_PER_S, RequestLog
from tests.conftest import synthetic
from tests.pool import ROOT, Pool, wait_for
from tests.test_cli import cli, table_rows

CHAT = "/v1/chat/completions"


def chat(pool: Pool, model: str, text: str = "hello there", **extra) -> httpx.Response:
    return pool.http.post(CHAT, json={"model": model, "messages": [{"role": "user", "content": text}], **extra})


def logged(pool: Pool, **params) -> list[dict]:
    r = pool.http.get("/admin/requests", params=params)
    assert r.status_code == 200, r.text
    return r.json()["requests"]


# -- the store -------------------------------------------------------------------------------------

def test_retention_keeps_the_newest_rows_and_no_old_ones(tmp_path):
    store = RequestLog(tmp_path / "r.sqlite3", max_rows=5, days=1, flush_s=0.01)
    store.start()
    now = time.time()
    for i in range(3):  # two days old: gone with the first batch written after them
        store.record(ts=now - 2 * 86400, model="old", endpoint="chat_completions", status=200)
    for i in range(12):
        store.record(ts=now, model=f"m{i}", endpoint="chat_completions", status=200, tokens_out=i)
    store.close()
    rows = store.query(limit=100)
    assert [r["model"] for r in rows] == ["m11", "m10", "m9", "m8", "m7"]
    assert store.written == 15


def test_writes_happen_off_the_caller_thread_in_batches(tmp_path):
    store = RequestLog(tmp_path / "r.sqlite3", max_rows=1000, days=1, flush_s=0.2)
    store.start()
    caller = threading.get_ident()
    writers = set()
    real_trim = store._trim
    store._trim = lambda db: (writers.add(threading.get_ident()), real_trim(db))
    started = time.monotonic()
    for i in range(200):
        store.record(ts=time.time(), model="m", endpoint="responses", status=200)
    assert time.monotonic() - started < 0.2  # record() never waits for the disk (the writer sleeps 0.2 s)
    store.close()
    assert writers and caller not in writers
    assert len(writers) == 1 and store.written == 200
    assert len(store.query(limit=1000)) == 200


def test_query_filters(tmp_path):
    store = RequestLog(tmp_path / "r.sqlite3", max_rows=100, days=1, flush_s=0.01)
    store.start()
    now = time.time()
    store.record(ts=now - 100, model="a", endpoint="responses", status=200, duration_ms=1000, ttft_ms=200,
                 tokens_out=40)
    store.record(ts=now, model="a", endpoint="responses", status=503, error_code="queue_timeout")
    store.record(ts=now, model="b", endpoint="chat_completions", status=200)
    store.close()
    assert [r["status"] for r in store.query(model="a")] == [503, 200]
    assert [r["model"] for r in store.query(status="error")] == ["a"]
    assert [r["model"] for r in store.query(status="ok")] == ["b", "a"]
    assert [r["model"] for r in store.query(status="200", since=now - 10)] == ["b"]
    first = store.query(model="a", status="ok")[0]
    assert first["tokens_per_s"] == 40.0  # 40 tokens in 1 s
    assert [r["model"] for r in store.query(after_id=2)] == ["b"]


# -- real pools --------------------------------------------------------------------------------------

def test_finished_requests_are_logged_with_their_timings(make_pool):
    pool = make_pool([synthetic("fast", tokens=7, ttft_ms=30), synthetic("slow", tokens=4, tps=40)])
    assert chat(pool, "fast").status_code == 200
    assert chat(pool, "missing").status_code == 404
    with pool.http.stream("POST", CHAT, json={"model": "slow", "stream": True,
                                              "messages": [{"role": "user", "content": "a b c"}]}) as r:
        assert r.status_code == 200
        r.read()
    rows = wait_for(lambda: (rows := logged(pool)) and len(rows) == 3 and rows, 5, what="three rows")
    slow, missing, fast = rows
    assert (fast["model"], fast["endpoint"], fast["status"], fast["error_code"]) == (
        "fast", "chat_completions", 200, None)
    assert fast["tokens_out"] == 7 and fast["tokens_in"] == 2
    assert 30 <= fast["ttft_ms"] <= fast["duration_ms"] < 5000 and 0 <= fast["queued_ms"] <= fast["ttft_ms"]
    assert (missing["status"], missing["error_code"]) == (404, "model_not_found")
    assert "missing" in missing["error_message"] and missing["duration_ms"] is None
    assert slow["tokens_out"] == 4 and slow["duration_ms"] >= 3 / 40 * 1000  # streamed: 4 tokens at 40/s
    assert fast["prompt"] is None and fast["output"] is None  # bodies are not kept by default
    assert [r["model"] for r in logged(pool, model="fast")] == ["fast"]
    assert [r["status"] for r in logged(pool, status="error")] == [404]
    assert pool.http.get("/admin/requests", params={"status": "bad"}).status_code == 400
    assert pool.http.get("/admin/requests", params={"since": "yesterday"}).status_code == 400


def test_log_bodies_keeps_prompts_and_outputs_truncated(make_pool):
    pool = make_pool([synthetic("debug", tokens=3, log_bodies=True)])
    long_prompt = "word " * 2000
    assert chat(pool, "debug", long_prompt).status_code == 200
    row = wait_for(lambda: logged(pool), 5, what="a row")[0]
    assert row["prompt"].startswith('[{"role": "user", "content": "word word')
    assert len(row["prompt"]) < BODY_CHARS + 100 and "more characters]" in row["prompt"]
    assert len(row["output"].split()) == 3


def test_request_log_survives_a_restart_and_keeps_its_bound(tmp_path):
    models = [synthetic("m", tokens=2)]
    server = {"request_log_max_rows": 3}
    first = Pool(tmp_path, models, server).start()
    try:
        for i in range(5):
            assert chat(first, "m", f"request {i}").status_code == 200
        before = wait_for(lambda: (rows := logged(first)) and [r["id"] for r in rows] == [5, 4, 3] and rows, 5,
                          what="the newest three of five rows")
    finally:
        first.stop()
    second = Pool(tmp_path, models, server).start()  # the same state dir
    try:
        assert logged(second) == before
        assert chat(second, "m").status_code == 200
        after = wait_for(lambda: (rows := logged(second)) and rows[0]["id"] > before[0]["id"] and rows, 5,
                         what="the new row")
        assert len(after) == 3 and after[1:] == before[:2]
    finally:
        second.stop()


def test_live_samples_over_sse(make_pool):
    pool = make_pool([synthetic("s", tokens=20, tps=100)])
    events = []
    with pool.http.stream("GET", "/admin/live") as stream:
        assert stream.headers["content-type"].startswith("text/event-stream")
        name = None
        for line in stream.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                events.append((name, json.loads(line[6:])))
                if name == "sample":
                    if len(events) == 2:  # the first sample: now make some tokens
                        assert chat(pool, "s").status_code == 200
                    if events[-1][1]["models"]["s"]["tokens"] >= 20:
                        break
    assert events[0][0] == "history"
    last = events[-1][1]["models"]["s"]
    assert last["state"] == "loaded" and last["queue"] == 0 and last["tps"] > 0
    times = [data["t"] for name, data in events[1:]]
    assert all(0.2 < b - a < 2.5 for a, b in zip(times, times[1:]))  # once a second (a busy machine may delay one)
    with pool.http.stream("GET", "/admin/live") as stream:  # a new watcher gets the history
        for line in stream.iter_lines():
            if line.startswith("data: "):
                assert len(json.loads(line[6:])) >= len(times)
                break


def test_live_samples_count_errors_by_status_class(make_pool):
    """Each sample carries the 4xx and the 5xx since start (the page's errors chart)."""
    model = synthetic("s")
    model["options"].update(chaos="lone_surrogate", chaos_prompt="boom")  # "boom": the worker fails it, 502
    pool = make_pool([model])
    assert chat(pool, "nope").status_code == 404
    assert chat(pool, "s", "boom").status_code == 502
    assert chat(pool, "s").status_code == 200
    seen = []
    with pool.http.stream("GET", "/admin/live", timeout=10) as stream:
        for line in stream.iter_lines():  # a sample a second: the counts within a few
            if line.startswith("data: {"):
                seen.append(json.loads(line[6:])["errors"])
                if seen[-1] == {"4xx": 1, "5xx": 1} or len(seen) > 10:
                    break
    assert seen[-1] == {"4xx": 1, "5xx": 1}, seen


def test_log_tail_over_sse_follows_new_lines(make_pool):
    pool = make_pool([synthetic("t")])
    path = pool.config_path.parent / "state" / "llm-pool" / "logs" / "t-0.log"
    with pool.http.stream("GET", "/admin/models/t/logs/live", params={"replica": 0, "lines": 5}) as stream:
        lines = stream.iter_lines()
        got = []
        for line in lines:
            if line.startswith("data: "):
                got = json.loads(line[6:])
                break
        assert 0 < len(got) <= 5 and got[-1] == path.read_text().splitlines()[-1]
        with open(path, "a") as f:
            f.write("a line written by the test\n")
        for line in lines:
            if line.startswith("data: "):
                assert json.loads(line[6:]) == ["a line written by the test"]
                break
    assert pool.http.get("/admin/models/t/logs/live", params={"replica": 3}).status_code == 400
    assert pool.http.get("/admin/models/nope/logs/live").status_code == 404


def test_cli_requests(make_pool):
    pool = make_pool([synthetic("c", tokens=5)])
    for _ in range(2):
        assert chat(pool, "c").status_code == 200
    wait_for(lambda: len(logged(pool, model="c")) >= 2, 5, what="two rows")
    done = cli("requests", "-o", "wide", "--model", "c", "--status", "ok", url=pool.url)
    assert done.returncode == 0, done.stderr
    rows = table_rows(done.stdout)
    assert len(rows) == 2 and all(r["MODEL"] == "c" and r["STATUS"] == "200" and r["OUT"] == "5" for r in rows)
    as_json = json.loads(cli("requests", "--json", "--since", "10m", "-n", "1", url=pool.url).stdout)
    assert len(as_json) == 1 and as_json[0]["id"] == logged(pool)[0]["id"]

    # --follow prints what finishes after it started
    env = {k: v for k, v in os.environ.items() if k != "LLM_POOL_ADMIN_KEY"}
    follower = subprocess.Popen([sys.executable, "-m", "supervisor.cli", "requests", "--follow", "--json",
                                 "--url", pool.url, "-n", "1"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                text=True)
    try:
        first = json.loads(follower.stdout.readline())
        assert chat(pool, "c", "after").status_code == 200
        fresh = json.loads(follower.stdout.readline())
        assert fresh["id"] > first["id"] and fresh["model"] == "c"
    finally:
        follower.terminate()
        follower.wait(10)


# a model name that, printed raw, sets the terminal's title, clears the screen and forges a line
HOSTILE = "\x1b]0;PWNED\x07\x1b[2J\x9b31m\r\nfake-line"
ESCAPED = "\\x1b]0;PWNED\\x07\\x1b[2J\\x9b31m\\x0d\\x0afake-line"
RAW_CONTROLS = (b"\x1b", b"\x07", b"\r", "\x9b".encode())


def assert_no_controls(output: bytes) -> None:
    assert not any(c in output for c in RAW_CONTROLS), output


def test_a_clients_control_characters_never_reach_the_operators_terminal(make_pool):
    pool = make_pool([synthetic("c", tokens=2)])
    assert chat(pool, HOSTILE).status_code == 404  # no key needed: anyone can send this name
    row = wait_for(lambda: logged(pool), 5, what="a row")[0]
    assert row["model"] == ESCAPED  # stored escaped
    # a row stored raw (by an older version): the CLI escapes it too
    path = pool.config_path.parent / "state" / "llm-pool" / "requests.sqlite3"
    with closing(sqlite3.connect(path, timeout=10)) as db, db:
        db.execute("INSERT INTO requests (ts, model, endpoint, status, error_code, tenant) VALUES (?, ?, ?, ?, ?, ?)",
                   (time.time(), HOSTILE, "chat_completions", 404, "\x1b[2J", "\x1b]0;x\x07"))
    wait_for(lambda: len(logged(pool)) == 2, 5, what="the raw row")

    done = cli("requests", "-o", "wide", url=pool.url, text=False)
    assert done.returncode == 0, done.stderr
    assert_no_controls(done.stdout)
    new, old = table_rows(done.stdout.decode())
    assert new["MODEL"].startswith(ESCAPED[:38]) and old["MODEL"].startswith(ESCAPED[:38])
    assert (old["ERROR"], old["TENANT"]) == ("\\x1b[2J", "\\x1b]0;x\\x07")

    # --follow: the rows it starts with and those that come after
    env = {k: v for k, v in os.environ.items() if k != "LLM_POOL_ADMIN_KEY"}
    follower = subprocess.Popen([sys.executable, "-m", "supervisor.cli", "requests", "--follow", "--url", pool.url,
                                 "-n", "1"], cwd=ROOT, env=env, stdout=subprocess.PIPE)
    try:
        header, first = follower.stdout.readline(), follower.stdout.readline()
        assert chat(pool, HOSTILE).status_code == 404
        fresh = follower.stdout.readline()
    finally:
        follower.terminate()
        follower.wait(10)
    for line in (header, first, fresh):
        assert_no_controls(line)
        assert line.endswith(b"\n") and b"\n" not in line[:-1]
    assert all(line.decode().split("  ")[1].startswith(ESCAPED[:20]) for line in (first, fresh)), (first, fresh)


def test_the_supervisors_log_lines_escape_a_clients_text():
    from supervisor.printable import LOG_FORMAT, PrintableFormatter
    record = logging.LogRecord("llm_pool.x", logging.WARNING, __file__, 1, "refused %s", (HOSTILE,), None)
    line = PrintableFormatter(LOG_FORMAT).format(record)
    assert line.endswith("refused " + ESCAPED) and "\n" not in line
    try:
        raise ValueError("boom")
    except ValueError:
        record.exc_info = sys.exc_info()
    record.exc_text = None
    assert "\nTraceback" in PrintableFormatter(LOG_FORMAT).format(record)  # a traceback keeps its lines


def test_a_flood_of_bad_keys_is_counted_but_cannot_push_the_history_out(make_pool):
    pool = make_pool([synthetic("c", tokens=2)],
                     server={"api_key": "infer", "admin_key": "admin", "request_log_max_rows": 1000})
    pool.http.headers["Authorization"] = "Bearer admin"  # the admin's reads; /v1/ takes the admin key too
    for _ in range(3):
        assert chat(pool, "c").status_code == 200
    earlier = wait_for(lambda: (rows := logged(pool)) and len(rows) == 3 and rows, 5, what="three rows")
    flood = {"model": "c", "messages": [{"role": "user", "content": "hi"}]}
    started = time.monotonic()
    for _ in range(2000):
        r = pool.http.post(CHAT, json=flood, headers={"Authorization": f"Bearer {os.urandom(8).hex()}"})
        assert r.status_code == 401
    took = time.monotonic() - started
    # the rows are written in order: once this one shows, every refused one logged before it has
    assert chat(pool, "missing").status_code == 404
    rows = wait_for(lambda: (rows := logged(pool, limit=10_000)) and rows[0]["status"] == 404 and rows, 10,
                    what="the last row")
    refused = [r for r in rows if r["status"] == 401]
    assert 1 <= len(refused) <= REFUSED_ROWS_PER_S * (1 + took) + 1, (len(refused), took)
    assert all(r["tenant"] == "(unknown key)" and r["model"] == "" for r in refused)
    assert any("more refused for their key" in r["error_message"] for r in refused)  # the rest, summed
    assert {r["id"] for r in earlier} <= {r["id"] for r in rows}  # the history is still there
    metrics = pool.http.get("/metrics").text
    assert 'llm_pool_refused_keys_total{reason="unknown_key"} 2000.0' in metrics
    assert 'llm_pool_refused_keys_total{reason="no_key"} 0.0' in metrics
    assert 'llm_pool_requests_total{endpoint="chat_completions",model="unknown",status="401"} 2000.0' in metrics


def test_log_tail_reads_appends_and_starts_over_when_the_file_is_replaced(tmp_path):
    from supervisor.edge.admin_feeds import _read_new
    path = tmp_path / "m-0.log"
    assert _read_new(path, None, 2) == (b"", None, False)  # no log yet
    path.write_text("one\ntwo\nthree\n")
    data, pos, restarted = _read_new(path, None, 2)
    assert data == b"two\nthree\n" and pos == path.stat().st_size and not restarted
    with open(path, "a") as f:
        f.write("four\n")
    assert _read_new(path, pos, 2)[0] == b"four\n"
    path.write_text("new\n")  # a new worker's log: shorter than where the tail was
    data, pos, restarted = _read_new(path, pos + 5, 2)
    assert (data, restarted) == (b"new\n", True)


def test_ui_is_served_from_the_package_with_a_strict_policy(make_pool):
    pool = make_pool([synthetic("u")])
    page = pool.http.get("/ui")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "default-src 'self'" in page.headers["content-security-policy"]
    assert page.headers["x-frame-options"] == "DENY"
    for name, kind in (("app.js", "text/javascript"), ("style.css", "text/css")):
        asset = pool.http.get(f"/ui/{name}")
        assert asset.status_code == 200 and asset.headers["content-type"].startswith(kind)
        assert f"/ui/{name}" in page.text
    assert "http" not in pool.http.get("/ui/app.js").text.replace("HTTP ", "")  # nothing fetched from elsewhere
    assert pool.http.get("/ui/pool.toml").status_code == 404
    assert pool.http.get("/ui/..%2Fconfig.py").status_code == 404


def test_a_client_that_leaves_is_counted_and_logged_as_499(make_pool):
    """Streaming or not, before its first token or during the stream: a client that
    leaves is one row with status 499 (and one count in requests_total), never none."""
    pool = make_pool([synthetic("slow", tokens=400, tps=40), synthetic("late", ttft_ms=5000, tokens=2)])
    body = {"model": "slow", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    with httpx.Client(base_url=pool.url, timeout=10) as client:
        with client.stream("POST", CHAT, json=body) as r:  # leaves mid-stream
            assert r.status_code == 200
            next(r.iter_lines())
    for stream in (True, False):  # leaves before the first token: nothing was sent back
        with httpx.Client(base_url=pool.url, timeout=0.3) as client:
            try:
                client.post(CHAT, json={"model": "late", "stream": stream,
                                        "messages": [{"role": "user", "content": "hi"}]})
            except httpx.ReadTimeout:
                pass
            else:
                raise AssertionError("the answer came before the client left")
    rows = wait_for(lambda: (rows := logged(pool)) and len(rows) == 3 and rows, 10, what="three rows")
    assert sorted((r["model"], r["status"]) for r in rows) == [("late", 499), ("late", 499), ("slow", 499)]
    slow = next(r for r in rows if r["model"] == "slow")
    assert slow["ttft_ms"] is not None and slow["duration_ms"] >= slow["ttft_ms"]
    metrics = pool.http.get("/metrics").text
    assert 'llm_pool_requests_total{endpoint="chat_completions",model="late",status="499"} 2.0' in metrics
    wait_for(lambda: pool.model("slow")["runtime_inflight"] == 0 == pool.model("late")["runtime_inflight"], 10,
             what="the slots freed")


def test_phase_speeds_split_prefill_from_decode():
    from supervisor.telemetry.request_log import phase_speeds

    # 100 prompt tokens in 0.5 s after hand-over; 11 output tokens, 10 after the first in 2 s
    row = {"queued_ms": 100.0, "ttft_ms": 600.0, "duration_ms": 2600.0, "tokens_in": 100, "tokens_out": 11}
    assert phase_speeds(row) == {"prefill_tokens_per_s": 200.0, "decode_tokens_per_s": 5.0}
    # an error before any token: neither phase
    assert phase_speeds({"queued_ms": 5.0, "ttft_ms": None, "duration_ms": 5.0, "tokens_in": None,
                         "tokens_out": None}) == {"prefill_tokens_per_s": None, "decode_tokens_per_s": None}


# -- bounds (issue 22) ----------------------------------------------------------------------------------

def _files_bytes(path) -> int:
    return sum(p.stat().st_size for p in path.parent.glob(path.name + "*"))


def test_the_log_is_bounded_in_bytes_and_gives_space_back(tmp_path):
    """With max_rows far away, rows of 8 KiB bodies and a 10 MiB message each
    keep the data near max_bytes (1 MiB); once, 50 rows made 333 MB."""
    path = tmp_path / "r.sqlite3"
    store = RequestLog(path, max_rows=100_000, days=1, flush_s=0.01, max_bytes=2**20)
    store.start()
    huge = "e" * 10 * 2**20
    for i in range(400):
        store.record(ts=time.time(), model="m" * 5000, endpoint="chat_completions", status=400,
                     error_code="invalid_request", error_message=huge, prompt="p" * 9000, output="o" * 9000)
        if i % 50 == 0:
            time.sleep(0.02)
    store.close()
    rows = store.query(limit=10_000)
    assert 0 < len(rows) < 400
    assert len(rows[0]["error_message"]) <= 1100 and len(rows[0]["model"]) <= 250
    assert len(rows[0]["prompt"]) < BODY_CHARS + 100 and len(rows[0]["output"]) < BODY_CHARS + 100
    # generous: 1 MiB of data, a WAL cut back to 4 MiB, and free pages under 1 MiB
    assert _files_bytes(path) < 8 * 2**20, _files_bytes(path)
    # a smaller bound later: the file shrinks (the rows go and their pages are given back)
    before = path.stat().st_size
    smaller = RequestLog(path, max_rows=100_000, days=1, flush_s=0.01, max_bytes=2**20 // 4 * 3)
    smaller.start()
    smaller.record(ts=time.time(), model="m", endpoint="chat_completions", status=200)
    smaller.close()
    assert path.stat().st_size < before


def test_an_old_file_is_switched_to_incremental_vacuum_once(tmp_path):
    import sqlite3
    path = tmp_path / "r.sqlite3"
    with sqlite3.connect(path) as db:  # as an earlier version made it: auto_vacuum NONE
        db.execute("CREATE TABLE requests (id INTEGER PRIMARY KEY AUTOINCREMENT, ts REAL NOT NULL, model TEXT NOT "
                   "NULL, endpoint TEXT NOT NULL, status INTEGER NOT NULL, error_code TEXT, error_message TEXT, "
                   "queued_ms REAL, ttft_ms REAL, duration_ms REAL, tokens_in INTEGER, tokens_out INTEGER, "
                   "prompt TEXT, output TEXT)")
        db.execute("INSERT INTO requests (ts, model, endpoint, status) VALUES (1, 'old', 'x', 200)")
    store = RequestLog(path, max_rows=10, days=100_000, flush_s=0.01)
    store.start()
    store.record(ts=time.time(), model="new", endpoint="x", status=200)
    store.close()
    with sqlite3.connect(path) as db:
        assert db.execute("PRAGMA auto_vacuum").fetchone()[0] == 2  # incremental
    assert [r["model"] for r in store.query()] == ["new", "old"]


def test_a_page_is_bounded_in_bytes_and_pages_on(tmp_path):
    store = RequestLog(tmp_path / "r.sqlite3", max_rows=1000, days=1, flush_s=0.01)
    store.start()
    for i in range(30):
        store.record(ts=time.time(), model=f"m{i}", endpoint="x", status=500, error_message="x" * 1000)
    store.close()
    rows, more = store.page(limit=100, max_bytes=10_000)
    assert 5 <= len(rows) <= 10 and more
    seen = [r["id"] for r in rows]
    while more:
        rows, more = store.page(limit=100, max_bytes=10_000, before_id=seen[-1])
        seen += [r["id"] for r in rows]
    assert seen == list(range(30, 0, -1))
    rows, more = store.page(after_id=10, limit=5)  # a follower catching up gets the oldest new rows first
    assert [r["id"] for r in rows] == [15, 14, 13, 12, 11] and more


def test_bad_query_values_get_400_not_500(make_pool):
    pool = make_pool([synthetic("m", tokens=2)])
    assert chat(pool, "m").status_code == 200
    for params in ({"after_id": "99999999999999999999999"}, {"before_id": "-1"}, {"status": "²"},
                   {"status": "٤٠٤"}, {"limit": "-5"}, {"limit": "0"}, {"model": "m" * 5000}):
        r = pool.http.get("/admin/requests", params=params)
        assert r.status_code == 400, (params, r.text[:300])
        assert r.json()["error"]["code"] == "invalid_request"
    assert chat(pool, "m").status_code == 200
    page = wait_for(lambda: len((r := pool.http.get("/admin/requests", params={"limit": 1, "model": "m"}).json())
                                ["requests"]) == 1 and r["more"] and r, 5, what="a page of one, and more")
    rest = pool.http.get("/admin/requests", params={"model": "m", "before_id": page["requests"][0]["id"]}).json()
    assert len(rest["requests"]) == 1 and rest["more"] is False


# -- cached tokens and the runtime's own speeds (issue 24) ---------------------------------------------

def test_runtime_timings_keep_only_known_finite_numbers():
    from protocol import runtime_timings

    raw = {"prompt_n": 12, "prompt_ms": 3.5, "prompt_per_second": 3428.6, "predicted_n": 5,
           "predicted_ms": 2.0, "predicted_per_second": 2500.0, "cache_n": 400, "predicted_per_token_ms": 0.4,
           "extra": "x" * 10_000}
    assert runtime_timings(raw) == {k: v for k, v in raw.items() if k not in ("predicted_per_token_ms", "extra")}
    bad = {"prompt_n": True, "prompt_ms": float("nan"), "prompt_per_second": float("inf"), "predicted_n": -1,
           "predicted_ms": "2", "predicted_per_second": 1e13, "cache_n": None}
    assert runtime_timings(bad) == {}
    assert runtime_timings("not a map") == {} and runtime_timings(None) == {}


def test_speeds_come_from_the_runtime_when_it_timed_them():
    from supervisor.telemetry.request_log import speeds

    derived = {"queued_ms": 100.0, "ttft_ms": 600.0, "duration_ms": 2600.0, "tokens_in": 100, "tokens_out": 11}
    assert speeds(derived) == {"prefill_tokens_per_s": 200.0, "decode_tokens_per_s": 5.0, "speeds_from": "pool"}
    timed = {**derived, "runtime_prefill_tps": 5000.0, "runtime_decode_tps": 80.5}
    assert speeds(timed) == {"prefill_tokens_per_s": 5000.0, "decode_tokens_per_s": 80.5, "speeds_from": "runtime"}
    assert speeds({"queued_ms": 5.0, "ttft_ms": None, "duration_ms": 5.0, "tokens_in": None, "tokens_out": None}) \
        == {"prefill_tokens_per_s": None, "decode_tokens_per_s": None, "speeds_from": None}


def test_an_older_file_gets_the_new_columns_in_place(tmp_path):
    import sqlite3
    path = tmp_path / "r.sqlite3"
    with sqlite3.connect(path) as db:  # as the version with the tenant column made it
        db.execute("CREATE TABLE requests (id INTEGER PRIMARY KEY AUTOINCREMENT, ts REAL NOT NULL, model TEXT NOT "
                   "NULL, endpoint TEXT NOT NULL, status INTEGER NOT NULL, error_code TEXT, error_message TEXT, "
                   "queued_ms REAL, ttft_ms REAL, duration_ms REAL, tokens_in INTEGER, tokens_out INTEGER, "
                   "prompt TEXT, output TEXT, tenant TEXT)")
        db.execute("INSERT INTO requests (ts, model, endpoint, status, tenant) VALUES (1, 'old', 'x', 200, 'a')")
    store = RequestLog(path, max_rows=10, days=100_000, flush_s=0.01)
    store.start()
    store.record(ts=time.time(), model="new", endpoint="x", status=200, tokens_in=10, cached_tokens=0,
                 runtime_prefill_tps=900.0, runtime_decode_tps=50.0)
    store.close()
    new, old = store.query()
    assert (old["model"], old["tenant"], old["cached_tokens"], old["speeds_from"]) == ("old", "a", None, None)
    assert (new["cached_tokens"], new["prefill_tokens_per_s"], new["decode_tokens_per_s"], new["speeds_from"]) == (
        0, 900.0, 50.0, "runtime")


@pytest.mark.llama
def test_llama_server_reports_cached_tokens_and_its_own_speeds(make_pool, tiny_gguf, llama_server_bin):
    """A prompt sent twice: llama-server serves the second from its prompt cache and says so;
    its own timings give the phase speeds. The client gets them as llama-server sends them
    (`timings` on a whole answer and on a stream's last chunk: README "API fidelity")."""
    from tests.conftest import llama

    pool = make_pool([llama("tiny", tiny_gguf, llama_server_bin, ctx=4096), synthetic("syn", tokens=3, tps=200)])
    prompt = "the pool remembers " * 40
    first = chat(pool, "tiny", prompt, max_tokens=4)
    assert first.status_code == 200, first.text
    assert first.json()["timings"]["predicted_n"] == 4
    with pool.http.stream("POST", CHAT, json={"model": "tiny", "stream": True, "max_tokens": 4,
                                              "stream_options": {"include_usage": True},
                                              "messages": [{"role": "user", "content": prompt}]}) as r:
        assert r.status_code == 200
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert chunks and [i for i, c in enumerate(chunks) if "timings" in c] == [len(chunks) - 1]
    assert chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # what the client sees, as before
    assert chat(pool, "syn").status_code == 200
    rows = wait_for(lambda: (rows := logged(pool)) and len(rows) == 3 and rows, 5, what="three rows")
    syn, second, first_row = rows
    assert first_row["cached_tokens"] == 0  # reported by llama-server: a real 0, not a blank
    assert 0 < second["cached_tokens"] < second["tokens_in"]
    for row in (first_row, second):
        assert row["speeds_from"] == "runtime", row
        assert row["prefill_tokens_per_s"] > 0 and row["decode_tokens_per_s"] > 0
        assert row["prefill_tokens_per_s"] == row["runtime_prefill_tps"]
    # the synthetic runtime reports neither: blank cached tokens, speeds from the pool's own times
    assert syn["cached_tokens"] is None and syn["runtime_prefill_tps"] is None
    assert syn["speeds_from"] == "pool" and syn["decode_tokens_per_s"] > 0
    # and `llm-pool requests` shows the same
    done = cli("requests", "-o", "wide", "--model", "tiny", url=pool.url)
    assert done.returncode == 0, done.stderr
    shown = table_rows(done.stdout)
    assert [r["CACHED"] for r in shown] == ["0", str(second["cached_tokens"])]
    assert [r["FROM"] for r in shown] == ["runtime", "runtime"]
    assert shown[1]["DECODE/S"] == str(second["decode_tokens_per_s"])
    blank = table_rows(cli("requests", "-o", "wide", "--model", "syn", url=pool.url).stdout)
    assert blank[0]["CACHED"] == "-" and blank[0]["FROM"] == "pool"


def test_the_shared_writer_bounds_its_queue_and_outlives_a_failed_batch(tmp_path, caplog):
    """One writer serves the request log and the timeline: past queue_max rows are dropped and
    counted (never a wait), a batch SQLite refuses is logged and the next one is written."""
    import sqlite3

    from supervisor.sqlite_writer import BatchWriter

    path = tmp_path / "w.sqlite3"
    with closing(sqlite3.connect(path)) as db:
        db.execute("CREATE TABLE t (v INTEGER NOT NULL)")

    def write(db, rows):
        db.executemany("INSERT INTO t (v) VALUES (?)", rows)

    writer = BatchWriter("test-writer", path, lambda: sqlite3.connect(path, check_same_thread=False), write,
                         queue_max=3, flush_s=0.01)
    for v in range(5):  # not started: the queue fills, the last two are dropped
        writer.put((v,))
    assert writer.dropped == 2
    writer.start()
    wait_for(lambda: writer.written == 3, 5, what="the queued rows written")
    with caplog.at_level(logging.ERROR, logger="llm_pool.sqlite_writer"):
        writer.put((None,))  # NOT NULL: SQLite refuses this batch
        wait_for(lambda: any("1 rows not written" in r.getMessage() for r in caplog.records), 5,
                 what="the failed batch logged")
    writer.put((7,))
    writer.close()
    assert writer.written == 4 and writer._thread is None
    with closing(sqlite3.connect(path)) as db:
        assert [v for (v,) in db.execute("SELECT v FROM t")] == [0, 1, 2, 7]


def test_responses_refused_while_mapped_are_logged_and_counted(make_pool):
    """A Responses body is mapped onto chat inside the request's path: each refusal gets its
    row and its count, as chat's and Messages' do (issue 45)."""
    pool = make_pool([synthetic("syn")])
    bodies = [({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
              ({"input": []}, "input"), ({"input": "x", "background": True}, "background"),
              ({"input": [{"type": "mystery"}]}, "input.0.type"),
              ({"input": "x", "tools": [{"type": "namespace", "tools": []}]}, "tools.0.name")]
    for body, param in bodies:
        r = pool.http.post("/v1/responses", json={"model": "syn", **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    rows = wait_for(lambda: (rows := logged(pool)) and len(rows) == len(bodies) and rows, 5, what="a row each")
    assert [(r["model"], r["endpoint"], r["status"]) for r in rows] == [("syn", "responses", 400)] * len(bodies)
    assert [r["error_message"] for r in rows[::-1]] == [
        pool.http.post("/v1/responses", json={"model": "syn", **body}).json()["error"]["message"] for body, _ in bodies]
    assert 'llm_pool_requests_total{endpoint="responses",model="syn",status="400"} 10.0' in pool.http.get(
        "/metrics").text


def test_skipped_tools_are_said_in_the_answer_and_its_row(make_pool):
    pool = make_pool([synthetic("syn", tokens=3)])
    body = {"model": "syn", "input": "x", "tools": [{"type": "web_search"}, {"type": "file_search",
                                                                             "vector_store_ids": ["vs_1"]}]}
    r = pool.http.post("/v1/responses", json=body)
    assert r.status_code == 200 and r.json()["status"] == "completed", r.text
    assert r.headers["x-llm-pool-skipped-tools"] == "web_search, file_search"
    with pool.http.stream("POST", "/v1/responses", json={**body, "stream": True}) as streamed:
        assert streamed.headers["x-llm-pool-skipped-tools"] == "web_search, file_search"
        assert b"response.completed" in streamed.read()
    refused = pool.http.post("/v1/responses", json={**body, "previous_response_id": "r"})  # refused first
    assert refused.status_code == 400 and "x-llm-pool-skipped-tools" not in refused.headers
    plain = chat(pool, "syn")  # the next request on the same connection says nothing of them
    assert plain.status_code == 200 and "x-llm-pool-skipped-tools" not in plain.headers
    rows = wait_for(lambda: (rows := logged(pool)) and len(rows) == 4 and rows, 5, what="four rows")
    assert [r["skipped_tools"] for r in rows] == [None, None, "web_search, file_search", "web_search, file_search"]


def test_a_crashed_streams_row_counts_the_tokens_it_streamed(make_pool):
    """A stream whose worker dies mid-answer has no Done: its row counts the output tokens that
    reached the client (what the pool metered as they streamed), not nothing."""
    import signal

    from tests.test_reliability import sse, stream_responses
    pool = make_pool([synthetic("c", tps=40, tokens=2000)])
    pid = pool.workers("c")[0]["pid"]
    deltas = 0
    with stream_responses(pool, "c") as s:
        for event in sse(s):
            if event["type"] == "response.output_text.delta":
                deltas += 1
                if deltas == 20:
                    os.kill(pid, signal.SIGKILL)
            if event["type"] in ("response.failed", "response.completed"):
                assert event["type"] == "response.failed"
                break
    row = wait_for(lambda: (rows := logged(pool, model="c")) and rows[0], 10, what="the crashed stream's row")
    assert row["status"] >= 500 and row["error_code"] == "runtime_crashed", row
    assert deltas <= row["tokens_out"] < 2000, (deltas, row)
