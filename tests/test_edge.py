"""The HTTP edge on documented APIs (supervisor/edge/):
request bodies decoded and validated by msgspec (pure tests of `request_body`), the
OpenAPI document made from the same Structs, and the global bound on the request
bodies being read, against a real pool over raw sockets."""

from __future__ import annotations

import asyncio
import json
import math
import select
import socket

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from protocol.errors import ErrorCode, PoolError
from supervisor.shapes import openai as shapes
from supervisor.shapes import responses as rshapes
from supervisor.edge.listener import DISCONNECT_KEY, Disconnect
from supervisor.edge.schemas import request_body
from supervisor.edge.streams import JobStream
from tests.conftest import synthetic
from tests.pool import wait_for

JSON = "application/json"
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def refused(raw: bytes, content_type: str | None = JSON, model=shapes.ChatRequest) -> PoolError:
    with pytest.raises(PoolError) as error:
        request_body(raw, content_type, model)
    assert error.value.code is ErrorCode.INVALID_REQUEST and error.value.status == 400
    return error.value


# -- bodies -----------------------------------------------------------------------------------------------
def test_unknown_fields_pass_through_as_sent():
    sent = {**CHAT, "stream": True, "stream_options": {"include_usage": True, "x": 1}, "top_k": 5,
            "temperature": 1, "logit_bias": {"50256": -100}, "response_format": {"type": "json_object"},
            "messages": [{"role": "user", "content": "hi", "name": "ann", "cache_control": {"type": "x"}}]}
    body, data = request_body(json.dumps(sent).encode(), JSON, shapes.ChatRequest)
    assert data == sent
    assert body.stream and body.stream_options.include_usage and body.model == "m"
    job = shapes.job_request(data)
    assert job == {k: v for k, v in sent.items() if k not in ("model", "stream", "stream_options")}
    assert type(job["temperature"]) is int  # as sent: no float made of it


@given(st.dictionaries(st.text(min_size=1).filter(lambda k: k not in {"model", "messages", "stream"}),
                       st.none() | st.booleans() | st.integers() | st.text(), max_size=5))
def test_any_extra_field_reaches_the_job_request(extra):
    fields = shapes.ChatRequest.__struct_fields__
    extra = {k: v for k, v in extra.items() if k not in fields}  # declared fields are typed: not "any"
    _, data = request_body(json.dumps({**CHAT, **extra}).encode(), JSON, shapes.ChatRequest)
    assert shapes.job_request(data) == {"messages": CHAT["messages"], **extra}


@pytest.mark.parametrize("raw, param", [
    (b'{"model": "m", "messages": [}', "body"), (b"\xff\xfe", "body"), (b'{"model":', "body"),
    (b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "body"),
    (b"", None), (b"[1, 2]", None), (b'"text"', None),
    (b'{"messages": [{"role": "user"}]}', "model"), (b'{"model": "m"}', "messages"),
    (b'{"model": "", "messages": [{"role": "user"}]}', "model"),
    (b'{"model": "m", "messages": []}', "messages"),
    (b'{"model": "m", "messages": [{"content": "x"}]}', "messages.0.role"),
    (b'{"model": "m", "messages": [{"role": "user"}, {"role": "robot"}]}', "messages.1.role"),
    (b'{"model": "m", "messages": [{"role": "user"}], "temperature": NaN}', "temperature"),
    (b'{"model": "m", "messages": [{"role": "user"}], "top_p": 1e999}', "top_p"),
    (b'{"model": "m", "messages": [{"role": "user"}], "max_tokens": true}', "max_tokens"),
    (b'{"model": "m", "messages": [{"role": "user"}], "n": 129}', "n"),
    (b'{"model": "m", "messages": [{"role": "user"}], "stream_options": {"include_usage": 1}}',
     "stream_options.include_usage"),
])
def test_a_refused_body_names_where(raw, param):
    error = refused(raw)
    assert error.param == param, error.message
    assert error.message.startswith(f"{param or 'body'}: "), error.message


def test_a_body_must_be_sent_as_json():
    raw = json.dumps(CHAT).encode()
    assert refused(raw, None).param is None
    assert refused(raw, "text/plain").param is None
    for content_type in ("application/json; charset=utf-8", "Application/JSON", "application/vnd.api+json"):
        assert request_body(raw, content_type, shapes.ChatRequest)[1] == CHAT


def test_responses_bodies_keep_their_runtime_fields_and_drop_bookkeeping():
    sent = {"model": "m", "input": "hi", "seed": 3, "top_k": 2, "store": True, "include": [], "user": "u"}
    body, data = request_body(json.dumps(sent).encode(), JSON, rshapes.ResponsesRequest)
    job = rshapes.job_request_from_responses(body, data).request
    assert job == {"messages": [{"role": "user", "content": "hi"}], "seed": 3, "top_k": 2, "user": "u"}
    assert refused(b'{"model": "m", "input": "x", "top_p": 0}', model=rshapes.ResponsesRequest).param == "top_p"
    # a huge number where none is checked is the standard library's infinity, for the runtime to judge
    _, data = request_body(b'{"model": "m", "prompt": "x", "logit_scale": 1e999}', JSON, shapes.CompletionRequest)
    assert math.isinf(data["logit_scale"])


# -- against a real pool --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    from tests.pool import Pool
    pool = Pool(tmp_path_factory.mktemp("edge"), [synthetic("syn", capacity=4, target_inflight=4, tokens=2),
                                                  synthetic("slow", ttft_ms=1000, tokens=2)],
                server={"max_body_bytes": 256 * 1024, "max_buffered_body_bytes": 256 * 1024})
    pool.start()
    yield pool
    pool.stop()


def test_the_openapi_document_lists_the_inference_routes_with_their_schemas(pool):
    doc = pool.http.get("/openapi.json").json()
    schemas = doc["components"]["schemas"]
    for path, name in (("/v1/chat/completions", "ChatRequest"), ("/v1/completions", "CompletionRequest"),
                       ("/v1/embeddings", "EmbeddingRequest"), ("/v1/responses", "ResponsesRequest")):
        post = doc["paths"][path]["post"]
        ref = post["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert ref == f"#/components/schemas/{name}", post
        assert post["requestBody"]["required"] is True and "200" in post["responses"]
    chat = schemas["ChatRequest"]
    assert set(chat["required"]) == {"model", "messages"}
    assert chat["properties"]["messages"]["minItems"] == 1
    assert chat["properties"]["messages"]["items"] == {"$ref": "#/components/schemas/ChatMessage"}
    assert {"type": "number", "minimum": 0, "maximum": 2} in chat["properties"]["temperature"]["anyOf"]
    assert "ChatMessage" in schemas and "StreamOptions" in schemas and "ErrorEnvelope" in schemas
    # every reference resolves
    refs = {m for m in json.dumps(doc).split('"') if m.startswith("#/components/schemas/")}
    assert {r.rsplit("/", 1)[1] for r in refs} <= set(schemas)
    # the routes answer only POST, as ordinary routes do
    assert pool.http.get("/v1/chat/completions").status_code == 405


def test_a_wrong_field_is_a_400_with_the_envelope(pool):
    r = pool.http.post("/v1/embeddings", json={"model": "syn", "input": "x", "stream": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream", r.text
    r = pool.http.post("/v1/chat/completions", json={**CHAT, "model": "syn", "n": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
    assert r.headers["x-should-retry"] == "false"


def test_a_request_pipelined_behind_a_waiting_one_is_answered_after_it(pool):
    """The first request's handler listens for its client's close (reading resumes); the
    pipelined one that comes meanwhile waits, read no further, and is answered second."""
    chat = json.dumps({**CHAT, "model": "slow"}).encode()
    with socket.create_connection(("127.0.0.1", pool.port), timeout=10) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(chat), chat))
        # the scenario: the next request comes while the first one waits for its first token
        wait_for(lambda: pool.model("slow")["runtime_inflight"] == 1, 10, what="the first request running")
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\nGET /nope HTTP/1.1\r\nHost: x\r\n"
                  b"Connection: close\r\n\r\n")
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    statuses = [int(part.split(b" ", 1)[0]) for part in answer.split(b"HTTP/1.1 ")[1:]]
    assert statuses == [200, 200, 404], answer[:600]
    assert b'"chat.completion"' in answer.split(b"HTTP/1.1 ")[1]


def chunked_post(pool, payload: bytes, keep: int) -> socket.socket:
    """A chunked POST of `payload` whose last `keep` bytes (and end) are not sent yet."""
    s = socket.create_connection(("127.0.0.1", pool.port), timeout=10)
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Transfer-Encoding: chunked\r\n\r\n")
    sent = payload[:-keep]
    for i in range(0, len(sent), 16 * 1024):
        piece = sent[i:i + 16 * 1024]
        s.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
    return s


def finish(s: socket.socket, payload: bytes, keep: int) -> bytes:
    rest = payload[-keep:]
    s.sendall(b"%x\r\n%s\r\n0\r\n\r\n" % (len(rest), rest))
    return read_response(s)


def read_response(s: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < content_length(data):
        chunk = s.recv(65536)
        if not chunk:
            break
        data += chunk
    return data


def content_length(data: bytes) -> int:
    for line in data.split(b"\r\n\r\n", 1)[0].split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 0


WS_HANDSHAKE = (b"GET %s HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
                b"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
                b"Authorization: Bearer unused\r\n\r\n")


@pytest.mark.parametrize("path", [b"/v1/responses", b"/v1/responses?x=1", b"/nope", b"/health"])
def test_a_websocket_upgrade_is_426_and_the_connection_goes_on_over_http(pool, path):
    """Codex tries a WebSocket to /v1/responses first: 426 (not 405 or 404, which it retries with
    backoff for seconds) makes it fall back to HTTP at once. No path is served as WebSocket."""
    body = json.dumps({"model": "syn", "input": "hi"}).encode()
    with socket.create_connection(("127.0.0.1", pool.port), timeout=10) as s:
        s.sendall(WS_HANDSHAKE % path)
        answer = read_response(s)
        assert answer.startswith(b"HTTP/1.1 426 "), answer[:300]
        error = json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]
        assert error["code"] == "websocket_not_served" and "HTTP" in error["message"]
        assert b"x-request-id: req_" in answer.lower()
        s.sendall(b"POST /v1/responses HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        answer = read_response(s)  # the same connection, over HTTP/1.1
        assert answer.startswith(b"HTTP/1.1 200 ") and b'"completed"' in answer, answer[:300]
    # a WebSocket client library hears the same: no switch, status 426
    ws_client = pytest.importorskip("websockets.sync.client")
    with pytest.raises(Exception) as refused:
        ws_client.connect(f"ws://127.0.0.1:{pool.port}{path.decode()}", open_timeout=10)
    assert getattr(getattr(refused.value, "response", None), "status_code", None) == 426, repr(refused.value)
    # an Upgrade that is not a WebSocket's is answered as HTTP/1.1 (test_edge_attacks.py)
    h2c = pool.http.get("/health", headers={"Connection": "Upgrade", "Upgrade": "h2c"})
    assert h2c.status_code == 200


def test_the_bodies_being_read_are_bounded_all_together(pool):
    """max_buffered_body_bytes = 256 KiB: two bodies of 160 KiB, each held unfinished, cannot
    both be read: one is refused with 429 and Retry-After, at once; the other, once complete,
    is answered; and then the room is back."""
    pad = "p" * 160 * 1024
    big = {"model": "syn", "messages": [{"role": "user", "content": pad}]}
    payload = json.dumps(big).encode()
    uploads = [chunked_post(pool, payload, keep=100) for _ in range(2)]
    try:
        ready, _, _ = select.select(uploads, [], [], 10)
        assert len(ready) == 1, "exactly one upload is refused while both are held"
        answer = read_response(ready[0])
        assert answer.startswith(b"HTTP/1.1 429"), answer[:300]
        assert b"retry-after: 1" in answer.lower() and b'"queue_full"' in answer
        held = uploads[1 - uploads.index(ready[0])]
        answer = finish(held, payload, keep=100)
        assert answer.startswith(b"HTTP/1.1 200"), answer[:300]
    finally:
        for s in uploads:
            s.close()
    r = httpx.post(pool.url + "/v1/chat/completions", json=big, timeout=10)
    assert r.status_code == 200, r.text


async def _stream_until_client_leaves(scope: dict, leave) -> tuple[list, list]:
    """Run a JobStream whose job would never end; once its first event is written, the
    client leaves: `leave()` is called, and the server's receive() says http.disconnect.
    Returns (what was sent, what end() got)."""
    first_sent = asyncio.Event()
    sent, ended = [], []

    async def body():
        yield b"data: 1\n\n"
        await asyncio.Event().wait()  # a job that never ends: only the client's leaving stops this

    async def send(message) -> None:
        sent.append(message)
        if message["type"] == "http.response.body" and not first_sent.is_set():
            first_sent.set()
            asyncio.get_running_loop().call_soon(leave)  # the connection drops after this write

    async def receive() -> dict:  # the server's own notice (what a task must wait for without the edge)
        await first_sent.wait()
        return {"type": "http.disconnect"}

    await asyncio.wait_for(JobStream("job", ended.append, body())(scope, receive, send), 10)
    return sent, ended


def test_a_stream_ends_when_its_client_leaves_under_any_asgi_server():
    """Under another server than the edge's, a task waiting for http.disconnect ends the
    stream; the stream's task itself is not left cancelled, and its job is ended once."""
    async def go():
        sent, ended = await _stream_until_client_leaves({"type": "http"}, lambda: None)
        assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
        assert sent[1]["body"] == b"data: 1\n\n" and (b"content-type", b"text/event-stream; charset=utf-8") \
            in sent[0]["headers"]
        assert ended == ["job"]
        assert not asyncio.current_task().cancelling()
    asyncio.run(go())


def test_a_stream_ends_when_the_connection_says_its_client_left():
    """Behind the edge, the connection's Disconnect ends the stream (no task waits for it)."""

    async def go():
        disconnect = Disconnect()
        sent, ended = await _stream_until_client_leaves({"type": "http", DISCONNECT_KEY: disconnect},
                                                        disconnect.fire)
        assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
        assert ended == ["job"] and disconnect.callback is None
    asyncio.run(go())


def test_a_stream_cancelled_for_another_reason_stays_cancelled_and_ends_its_job():

    async def go():
        ended, started = [], asyncio.Event()

        async def body():
            started.set()
            yield b"data: 1\n\n"
            await asyncio.Event().wait()

        async def send(message) -> None:
            pass

        async def receive() -> dict:
            await asyncio.Event().wait()

        task = asyncio.create_task(JobStream("job", ended.append, body())({"type": "http"}, receive, send))
        await asyncio.wait_for(started.wait(), 10)
        task.cancel()  # a server shutting down, say: not the client leaving
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 10)
        assert ended == ["job"]
    asyncio.run(go())


def test_a_stream_whose_servers_receive_fails_ends_and_says_so(caplog):
    """Under another ASGI server: a receive() that raises leaves the connection unusable.
    The stream ends as if its client had left, its job is ended once, and the failure is
    logged, not lost in a task nobody awaits."""
    async def go():
        ended = []

        async def body():
            yield b"data: 1\n\n"
            await asyncio.Event().wait()  # a job that never ends

        async def send(message) -> None:
            pass

        async def receive() -> dict:
            await asyncio.sleep(0)
            raise RuntimeError("the server lost the connection")

        await asyncio.wait_for(JobStream("job", ended.append, body())({"type": "http"}, receive, send), 10)
        assert ended == ["job"]
        assert not asyncio.current_task().cancelling()
    with caplog.at_level("ERROR", logger="llm_pool.inference"):
        asyncio.run(go())
    assert any("waiting for the client to leave failed" in r.getMessage() and r.exc_info for r in caplog.records)
