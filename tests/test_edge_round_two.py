"""The edge, round two (issue 44): findings 3, 4, 7, 9 and 10, and "every error an
envelope", against one real supervisor with tenants (keys), synthetic workers and hung ones."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import psutil
import pytest

from tests.conftest import synthetic
from tests.pool import ROOT, Pool, wait_for

CHAT = "/v1/chat/completions"
TIMEOUT_S = 2.0  # request_timeout_s of each hung model
PARTS = 50  # max_content_parts of "syn"
KEY_A, KEY_B, ADMIN = "key-a", "key-b", "admin-key"
SLOW_S = 8.0
MAX_CONNECTIONS, PER_CLIENT = 40, 10
RSS_SLACK = 64 * 2**20


def hung(name: str, *fallbacks: str) -> dict:
    """A model whose first token never comes: each request ends at its request_timeout_s."""
    return synthetic(name, ttft_ms=600_000, request_timeout_s=TIMEOUT_S, fallbacks=list(fallbacks))


def garbage(name: str, *fallbacks: str) -> dict:
    """A model whose every job's first frame is garbage: a protocol_error (502), at once."""
    model = synthetic(name, fallbacks=list(fallbacks))
    model["options"]["chaos"] = "garbage"
    return model


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    pool = Pool(tmp_path_factory.mktemp("round2"),
                [synthetic("syn", capacity=4, target_inflight=4, tokens=4, max_content_parts=PARTS),
                 hung("hung", "hung2", "hung3"), hung("hung2"), hung("hung3"),
                 garbage("bad1", "bad2"), garbage("bad2"),
                 # a fast, long stream, which a client that stops reading leaves behind
                 synthetic("firehose", tokens=3_000_000, tps=100_000),
                 # a request that takes SLOW_S: what a pipelined request waits behind
                 synthetic("slow", tokens=int(SLOW_S * 10), tps=10)],
                server={"admin_key": ADMIN, "max_unsent_output_bytes": 64 * 1024, "body_timeout_s": 30,
                        "max_connections": MAX_CONNECTIONS, "max_connections_per_client": PER_CLIENT},
                tenants=[{"name": "a", "keys": [KEY_A]}, {"name": "b", "keys": [KEY_B]}])
    pool.http.headers["authorization"] = f"Bearer {ADMIN}"  # the admin surface; /v1 as its own tenant
    pool.start()
    try:
        yield pool
    finally:
        pool.stop()


def as_tenant(key: str, rid: str | None = None) -> dict:
    return {"authorization": f"Bearer {key}", **({"x-request-id": rid} if rid else {})}


def row_of(pool, rid: str) -> dict:
    """The request-log row of the request with this x-request-id, once written."""
    def found():
        rows = pool.http.get("/admin/requests", params={"id": rid}).json()["requests"]
        return rows[0] if rows else None
    return wait_for(found, 10, what=f"the request log row of {rid}")


def nested(depth: int, leaf="x"):
    value = leaf
    for _ in range(depth):
        value = [value]
    return value


def with_nesting(body: dict, depth: int, leaf: str = '"x"') -> str:
    """The body as JSON, its "NEST" a list `depth` deep (built as text: json.dumps recurses)."""
    return json.dumps(body).replace('"NEST"', "[" * depth + leaf + "]" * depth)


# -- finding 3: deep nesting is a 400, before anything recurses ---------------------------------------------
@pytest.mark.parametrize("path,body", [
    (CHAT, with_nesting({"model": "syn", "messages": [{"role": "user", "content": "NEST"}]}, 900)),
    ("/v1/completions", with_nesting({"model": "syn", "prompt": "NEST"}, 900)),
    ("/v1/completions", with_nesting({"model": "syn", "prompt": ["NEST"]}, 600, "1")),  # token ids
    ("/tokenize", with_nesting({"model": "syn", "tokens": "NEST"}, 980, "1")),
    ("/v1/embeddings", with_nesting({"model": "syn", "input": "NEST"}, 700)),
    ("/v1/responses", with_nesting({"model": "syn", "input": "NEST"}, 800)),
])
def test_deeply_nested_prompts_are_refused_with_400_and_a_row(pool, path, body):
    rid = f"deep-{path.strip('/').replace('/', '-')}-{time.monotonic_ns()}"
    r = pool.http.post(path, content=body, headers={"content-type": "application/json", **as_tenant(KEY_A, rid)})
    assert r.status_code == 400, (r.status_code, r.text[:300])
    error = r.json()["error"]
    assert error["code"] == "invalid_request" and error["param"] == "body" and "nested" in error["message"]
    row = row_of(pool, rid)
    assert row["status"] == 400 and row["error_code"] == "invalid_request" and row["tenant"] == "a"


def test_deep_nesting_on_messages_gets_anthropics_envelope(pool):
    body = with_nesting({"model": "syn", "max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": "NEST"}]}]}, 900)
    r = pool.http.post("/v1/messages", content=body, headers={"content-type": "application/json",
                                                              **as_tenant(KEY_A)})
    assert r.status_code == 400, r.text[:300]
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"
    # as deep as a JSON Schema in a tool's parameters goes: past the edge (the synthetic runtime
    # takes no tools: its model says so)
    deep_enough = {"model": "syn", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                   "tools": [{"type": "function", "function": {"name": "f", "parameters": {
                       "type": "object", "properties": {"p": nested(40, {"type": "string"})}}}}]}
    r = pool.http.post(CHAT, json=deep_enough, headers=as_tenant(KEY_A))
    assert r.json()["error"]["code"] == "unsupported_parameter" and r.json()["error"]["param"] == "tools", r.text


# -- every error an envelope: an exception in any handler ---------------------------------------------------------
def test_a_handler_that_raises_answers_the_contracts_500_with_a_row_and_one_log_line(pool):
    """The event log's file is made unreadable under the running supervisor (a directory where
    the file was): /admin/events raises. Each call gets the 500 in the error envelope and a
    request-log row; the traceback is logged once for the burst."""
    events = pool.config_path.parent / "state" / "llm-pool" / "events.sqlite3"
    aside = events.with_name("events.sqlite3.aside")
    events.rename(aside)
    events.mkdir()
    try:
        answers = [pool.http.get("/admin/events") for _ in range(5)]
    finally:
        events.rmdir()
        aside.rename(events)
    for r in answers:
        assert r.status_code == 500 and r.headers["content-type"] == "application/json", r.text[:300]
        error = r.json()["error"]
        assert error["code"] == "internal_error" and error["type"] == "server_error"
        assert r.headers["x-request-id"] in error["message"]
    for r in answers:
        row = row_of(pool, r.headers["x-request-id"])
        assert row["status"] == 500 and row["error_code"] == "internal_error"
    assert pool.http.get("/admin/events").status_code == 200
    logged = pool.log_path.read_text(errors="replace")
    assert logged.count("a request's handler failed") == 1, logged[-3000:]
    assert "OperationalError" in logged


# -- finding 4: one deadline for the whole fallback chain --------------------------------------------------------
def test_fallbacks_share_the_first_models_deadline(pool):
    started = time.monotonic()
    r = pool.http.post(CHAT, json={"model": "hung", "messages": [{"role": "user", "content": "hi"}]},
                       headers=as_tenant(KEY_A, "hung-chain-1"))
    took = time.monotonic() - started
    assert r.status_code == 504 and r.json()["error"]["code"] == "runtime_timeout", r.text
    assert TIMEOUT_S - 0.1 <= took < TIMEOUT_S * 1.75, took  # not one request_timeout_s per model tried
    row = row_of(pool, "hung-chain-1")
    assert row["status"] == 504 and row["duration_ms"] < TIMEOUT_S * 1750
    wait_for(lambda: all(pool.model(m)["runtime_inflight"] == 0 for m in ("hung", "hung2", "hung3")), 10,
             what="the hung models' slots free")


def test_a_chain_where_every_model_fails_is_in_the_row(pool):
    r = pool.http.post(CHAT, json={"model": "bad1", "messages": [{"role": "user", "content": "hi"}]},
                       headers=as_tenant(KEY_A, "bad-chain-1"))
    assert r.status_code == 502 and r.json()["error"]["code"] == "protocol_error", r.text
    assert "tried: bad1 (protocol_error) -> bad2 (protocol_error)" in r.json()["error"]["message"]
    row = row_of(pool, "bad-chain-1")
    assert row["fallback_chain"] == "bad1 (protocol_error) -> bad2 (protocol_error)", row


# -- finding 7: a stream cut at max_unsent_output_bytes is logged as the contract says ---------------------------
def test_a_stream_cut_for_not_reading_is_logged_504(pool):
    body = json.dumps({"model": "firehose", "stream": True, "messages": [{"role": "user", "content": "go"}]})
    client = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 * 1024)
    client.settimeout(30)
    try:
        client.connect(("127.0.0.1", pool.port))
        client.sendall(f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       f"Authorization: Bearer {KEY_A}\r\nx-request-id: unread-1\r\n"
                       f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
        assert client.recv(12) == b"HTTP/1.1 200"
        # the client reads no more: the job ends at the bound and its slot frees
        wait_for(lambda: pool.workers("firehose")[0]["inflight"] == 0, 30, what="the unread stream's job ended")
    finally:
        client.close()  # gone without reading the error
    row = row_of(pool, "unread-1")
    assert row["status"] == 504 and row["error_code"] == "runtime_timeout", row
    assert "max_unsent_output_bytes" in row["error_message"]


# -- finding 9: a tenant's request id is its own -------------------------------------------------------------------
def test_another_tenant_cannot_push_a_row_out_of_an_ids_story(pool):
    chat = {"model": "syn", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert pool.http.post(CHAT, json=chat, headers=as_tenant(KEY_A, "shared-id")).status_code == 200
    row_of(pool, "shared-id")
    for _ in range(7):
        r = pool.http.post(CHAT, json=chat, headers=as_tenant(KEY_B, "shared-id"))
        assert r.status_code == 200 and r.headers["x-request-id"] == "shared-id"  # each gets its own id back

    def told():
        stories = pool.http.get("/admin/requests/story", params={"id": "shared-id"}).json()["stories"]
        return stories if sum(s["row"]["tenant"] == "b" for s in stories) == 5 else None
    stories = wait_for(told, 10, what="tenant b's rows in the story")
    assert [s["row"]["tenant"] for s in stories] == ["b"] * 5 + ["a"]  # newest first; a's row kept


# -- finding 10: every part of a body counts against max_content_parts ---------------------------------------------
def test_system_tools_and_joined_blocks_count_as_content_parts(pool):
    text = {"type": "text", "text": "p"}
    tool = {"name": "t", "input_schema": {"type": "object"}}
    user = [{"role": "user", "content": "hi"}]
    over = PARTS + 1
    for body in ({"model": "syn", "max_tokens": 2, "system": [text] * over, "messages": user},
                 {"model": "syn", "max_tokens": 2, "tools": [tool] * over, "messages": user},
                 {"model": "syn", "max_tokens": 2, "messages": [{"role": "user", "content": [text] * over}]},
                 {"model": "syn", "max_tokens": 2, "messages": [{"role": "user", "content": [
                     {"type": "tool_result", "tool_use_id": "t", "content": [text] * PARTS}]}]}):
        r = pool.http.post("/v1/messages", json=body, headers=as_tenant(KEY_A))
        assert r.status_code == 400, (r.status_code, r.text[:300])
        assert f"{over} content parts" in r.json()["error"]["message"], r.text[:300]
    chat_tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}] * over
    r = pool.http.post(CHAT, json={"model": "syn", "messages": user, "tools": chat_tools}, headers=as_tenant(KEY_A))
    assert r.status_code == 400 and "content parts" in r.json()["error"]["message"], r.text[:300]
    r = pool.http.post("/v1/messages", json={"model": "syn", "max_tokens": 2, "system": [text] * (PARTS - 2),
                                             "messages": user}, headers=as_tenant(KEY_A))
    assert r.status_code == 200, r.text[:300]


# -- the connection passed explicitly: in the request's scope, whatever context the task runs in ----------------
SERVE_WITH_FRESH_CONTEXTS = """
import sys
import uvicorn
from supervisor.api import create_app
from supervisor.config import load_config
from supervisor.edge.listener import bounded_protocol

cfg = load_config(sys.argv[1])
app = create_app(cfg)
app.connection_required = True
# h11: the protocol whose reset_contextvars runs each request in a fresh context
uvicorn.Server(uvicorn.Config(app, host=cfg.server.host, port=cfg.server.port, log_level="warning", ws="none",
                              http=bounded_protocol(cfg.server, "h11"), reset_contextvars=True)).run()
"""


def read_answer(s: socket.socket, when: str) -> bytes:
    """One whole answer with a Content-Length, head and body."""
    data = b""
    while b"\r\n\r\n" not in data:
        piece = s.recv(65536)
        assert piece, f"closed {when}"
        data += piece
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
    while len(body) < length:
        piece = s.recv(65536)
        assert piece, f"closed {when}"
        body += piece
    assert len(body) == length, "an answer more than asked for"
    return head + b"\r\n\r\n" + body


def test_the_connection_reaches_the_guard_in_fresh_contexts_too(tmp_path):
    """Under uvicorn's reset_contextvars (each request in a fresh context), keep-alive requests
    on one connection are answered past max_pipelined_requests: each request's end reaches
    its connection (a ContextVar did not arrive: the connection wedged after 2)."""
    pool = Pool(tmp_path, [synthetic("syn", tokens=2)], server={"max_pipelined_requests": 2})
    pool._log = open(pool.log_path, "ab")
    pool.proc = subprocess.Popen([sys.executable, "-c", SERVE_WITH_FRESH_CONTEXTS, str(pool.config_path)],
                                 cwd=ROOT, stdout=pool._log, stderr=subprocess.STDOUT)
    try:
        wait_for(pool._healthy, 60, what="the server's /health")
        with socket.create_connection(("127.0.0.1", pool.port), timeout=5) as s:
            for i in range(8):
                s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                assert read_answer(s, f"after {i} answers").startswith(b"HTTP/1.1 200")
        r = pool.http.post(CHAT, json={"model": "syn", "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200, r.text
    finally:
        pool.stop()


# -- findings 1 and 2: what a connection may hold ------------------------------------------------------------------
def connect(pool, source: str = "127.0.0.1", timeout: float = 5.0) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.settimeout(timeout)
    s.bind((source, 0))
    s.connect(("127.0.0.1", pool.port))
    return s


def health_within_a_second(pool, source: str) -> None:
    started = time.monotonic()
    with connect(pool, source, timeout=1.0) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        answer = s.recv(65536)
    assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
    assert time.monotonic() - started < 1.0


def test_a_body_pipelined_behind_a_long_request_is_not_read(pool):
    """A slow request, then on the same connection a POST declaring 100 GB, and bytes as fast
    as loopback takes them: the pool reads nothing of it while the first is answered (the
    sender blocks once the kernel's buffers fill), and its RSS stays put."""
    supervisor = psutil.Process(pool.proc.pid)
    rss_before = supervisor.memory_info().rss
    body = json.dumps({"model": "slow", "messages": [{"role": "user", "content": "hi"}]})
    s = connect(pool, "127.0.0.21", timeout=0.5)
    sent = 0
    try:
        s.sendall(f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  f"Authorization: Bearer {KEY_A}\r\nContent-Length: {len(body)}\r\n\r\n{body}"
                  f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  f"Authorization: Bearer {KEY_A}\r\nContent-Length: 100000000000\r\n\r\n".encode())
        wait_for(lambda: pool.model("slow")["runtime_inflight"] == 1, 10, what="the slow request running")
        chunk = b"x" * 2**20
        until = time.monotonic() + 4
        while time.monotonic() < until and sent < 256 * 2**20:  # far past any buffer, at most 256 MiB
            try:
                sent += s.send(chunk)
            except TimeoutError:
                continue  # the pool reads nothing: the kernel's buffers stay full
        health_within_a_second(pool, "127.0.0.22")
        grown = supervisor.memory_info().rss - rss_before
    finally:
        s.close()
    assert sent < 64 * 2**20, f"the pool read {sent >> 20} MiB of a pipelined body"
    assert grown < RSS_SLACK, f"supervisor RSS grew {grown >> 20} MiB"
    wait_for(lambda: pool.model("slow")["runtime_inflight"] == 0, 10, what="the slow request cancelled")


def test_a_body_on_a_route_that_takes_none_is_not_waited_for(pool):
    """GET /health (and /ready, /metrics, /ui) declaring a body it never sends: answered at
    once, and the connection closed (nothing of the body is read)."""
    for path in ("/health", "/ready", "/metrics", "/ui"):
        with connect(pool, "127.0.0.23", timeout=1.0) as s:
            s.sendall(f"GET {path} HTTP/1.1\r\nHost: localhost:{pool.port}\r\nAuthorization: Bearer {ADMIN}\r\n"
                      f"Content-Length: 100\r\n\r\n".encode())
            answer = b""
            while piece := s.recv(65536):  # to the close
                answer += piece
        assert answer.split(b"\r\n")[0].split(b" ")[1] in (b"200", b"307"), (path, answer[:300])
        assert b"connection: close" in answer.lower()


def test_connections_waiting_for_bodies_lock_nobody_out(pool):
    """Five addresses, each at its per-client cap, every connection a keyed chat head waiting
    for a body it never sends (busy, not idle): the pool fills, then a newcomer's /health is
    answered within a second: the client that holds the most gives way, whatever its phase."""
    head = (f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {KEY_B}\r\nContent-Length: 100\r\n\r\n").encode()
    sockets = []
    try:
        for i in range(5 * PER_CLIENT):
            s = connect(pool, f"127.0.2.{i % 5 + 1}")
            sockets.append(s)
            try:
                s.sendall(head)
            except (ConnectionResetError, BrokenPipeError):
                pass  # refused: its address holds as many as any other
        for i in range(5):
            health_within_a_second(pool, f"127.0.3.{i + 1}")
    finally:
        for s in sockets:
            s.close()


def test_what_admitted_requests_hold_is_bounded_and_given_back(make_pool):
    """Finding 5: requests waiting in a queue hold their prompts; all of them together are bounded
    by max_held_request_bytes (429 queue_full, Retry-After, naming it), and what a request held
    is given back when it ends, however: the next request after they end is served."""
    prompt = "x" * 200_000  # a frame of about 200 KB
    pool = make_pool([synthetic("slow", ttft_ms=600_000, request_timeout_s=30, max_queue=100)],
                     server={"max_body_bytes": 512 * 1024, "max_held_request_bytes": 1_000_000})
    streams = []
    try:
        for _ in range(4):  # ~800 KB held: the slot's and three queued
            s = pool.http.stream("POST", CHAT, json={"model": "slow", "stream": True,
                                                     "messages": [{"role": "user", "content": prompt}]})
            streams.append((s, s.__enter__()))
        wait_for(lambda: pool.model("slow")["queue_depth"] + pool.model("slow")["runtime_inflight"] == 4, 10,
                 what="four requests held")
        refused = pool.http.post(CHAT, json={"model": "slow", "messages": [{"role": "user", "content": prompt}]})
        assert refused.status_code == 429, refused.text
        assert refused.json()["error"]["code"] == "queue_full" and refused.headers["retry-after"] == "1"
        assert "max_held_request_bytes" in refused.json()["error"]["message"]
    finally:
        for s, _ in streams:
            s.__exit__(None, None, None)  # the clients leave: their jobs end, cancelled
    wait_for(lambda: pool.model("slow")["queue_depth"] + pool.model("slow")["runtime_inflight"] == 0, 10,
             what="the held requests gone")
    with pool.http.stream("POST", CHAT, timeout=10, json={"model": "slow", "stream": True,
                                                          "messages": [{"role": "user", "content": prompt}]}) as s:
        assert s.status_code == 200  # its head, after stream_head_hold_s: admitted


def test_upgrade_requests_cost_the_log_two_lines_not_two_each(pool):
    """Finding 8: uvicorn logs two warnings for every Upgrade request (the guard answers them);
    a client sending a hundred costs the log each warning once in 10 s, not two hundred lines."""
    websocket = (b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
                 b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n")
    before = pool.log_path.stat().st_size
    for _ in range(100):
        with socket.create_connection(("127.0.0.1", pool.port), timeout=5) as s:
            s.sendall(websocket)
            assert s.recv(65536).startswith(b"HTTP/1.1 426"), "the guard's answer"
    assert pool.http.get("/health").status_code == 200  # after the last: its lines are written
    added = pool.log_path.read_bytes()[before:].decode(errors="replace")
    upgrade_lines = [line for line in added.splitlines() if "upgrade request" in line or "WebSocket library" in line]
    assert len(upgrade_lines) <= 2, upgrade_lines[:5]


def test_a_queued_request_holds_its_prompt_about_twice_not_four_times(make_pool):
    """Finding 5: a queued request's prompt is held as the decoded request and its frame to the
    worker; the body's bytes are dropped once decoded (the guard and the handler kept them for
    the request's life: about four copies in all, by RSS). 40 queued 1.9 MB prompts."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx
    n, size = 40, 1_900_000
    pool = make_pool([synthetic("q", ttft_ms=600_000, request_timeout_s=120, max_queue=100)])
    proc = psutil.Process(pool.proc.pid)
    base = proc.memory_info().rss

    def send(i: int) -> None:
        try:
            httpx.post(pool.url + CHAT, timeout=20, json={
                "model": "q", "messages": [{"role": "user", "content": chr(97 + i % 26) * size}]})
        except httpx.HTTPError:
            pass  # cut when the test ends
    with ThreadPoolExecutor(n) as ex:
        for i in range(n):
            ex.submit(send, i)
        wait_for(lambda: pool.model("q")["queue_depth"] + pool.model("q")["runtime_inflight"] == n, 60,
                 what="every request held")
        copies = (proc.memory_info().rss - base) / (n * size)
        print(f"{n} queued prompts of {size / 1e6:.1f} MB: {copies:.2f} copies each by RSS")
        assert copies < 3.0, copies
        assert pool.http.post("/admin/models/q/unload", timeout=30).status_code == 200  # ends them all at once
