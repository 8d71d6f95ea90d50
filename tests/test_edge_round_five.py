"""The edge, round five (issue 53): the three rules that were missing, end to end against a
real supervisor over raw sockets (and one real client, httpx):
- a request answered without reading the body it declared closes its connection, reading
  nothing more of it (and lingering just long enough for a client still sending to see it);
- a chunked body's framing and trailers count as header bytes;
- answers nobody takes are bounded: per connection (no pipelined answer is built while one is
  unsent) and for the whole pool (max_unsent_total_bytes).
While each runs, another client's /health is answered within a second and the supervisor's RSS
stays within 64 MiB of where it started."""

from __future__ import annotations

import json
import socket
import time

import httpx
import psutil
import pytest

from supervisor.edge.listener import LINGER_S
from testkit.listener_app import ListenerApp
from tests.conftest import synthetic
from tests.pool import Pool, wait_for
from tests.test_edge_attacks import health_within_a_second

CHAT = "/v1/chat/completions"
KEY, ADMIN = "key-a", "admin-key"
RSS_SLACK = 64 * 2**20
MAX_CONNECTIONS = 120
HEADER_BYTES = 16 * 1024  # max_header_bytes: a chunked body's framing counts against it
BIG_TOKENS = 1_200_000  # a whole answer of about 7 MB (the synthetic text, as fast as possible)
UNSENT_TOTAL = 10 * 2**20  # max_unsent_total_bytes: more than one answer, less than three
CLOSED_WITHIN_S = LINGER_S + 10  # a lingering connection's end, on a busy machine


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    pool = Pool(tmp_path_factory.mktemp("round5"),
                [synthetic("syn", capacity=4, target_inflight=4, tokens=4),
                 synthetic("big", capacity=4, target_inflight=4, tokens=BIG_TOKENS)],
                server={"admin_key": ADMIN, "max_connections": MAX_CONNECTIONS, "max_connections_per_client": 40,
                        "max_header_bytes": HEADER_BYTES, "body_timeout_s": 60, "write_timeout_s": 60,
                        "max_unsent_total_bytes": UNSENT_TOTAL},
                tenants=[{"name": "a", "keys": [KEY]}])
    pool.http.headers["authorization"] = f"Bearer {ADMIN}"
    pool.start()
    try:
        pool.process = psutil.Process(pool.proc.pid)
        yield pool
    finally:
        pool.stop()


@pytest.fixture
def watched(pool):
    """The pool; after the test, nothing in flight and its RSS within bounds."""
    before = pool.process.memory_info().rss
    yield pool
    wait_for(lambda: all(m["runtime_inflight"] == 0 and m["queue_depth"] == 0 for m in pool.models().values()),
             30, what="nothing in flight or queued")
    grown = pool.process.memory_info().rss - before
    assert grown < RSS_SLACK, f"supervisor RSS grew {grown >> 20} MiB"


def connect(pool, source: str, timeout: float = 5.0, rcvbuf: int | None = None) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf is not None:  # before connect: the window the client offers stays small
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.settimeout(timeout)
    s.bind((source, 0))
    s.connect(("127.0.0.1", pool.port))
    return s


def head_of(s: socket.socket) -> bytes:
    """The answer's head (and whatever came with it)."""
    answer = b""
    while b"\r\n\r\n" not in answer:
        piece = s.recv(65536)
        assert piece, answer[:300]
        answer += piece
    return answer


def closed_within(s: socket.socket, seconds: float) -> bool:
    """Whether the pool ends the connection within `seconds` (whatever came before is read)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        s.settimeout(max(0.05, deadline - time.monotonic()))
        try:
            if not s.recv(65536):
                return True
        except (ConnectionResetError, BrokenPipeError):
            return True
        except TimeoutError:
            return False
    return False


def chat_request(model: str, rid: str, key: str = KEY) -> bytes:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}]})
    return (f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nAuthorization: Bearer {key}\r\n"
            f"x-request-id: {rid}\r\nContent-Length: {len(body)}\r\n\r\n{body}").encode()


def rows(pool, rid: str) -> list[dict]:
    return pool.http.get("/admin/requests", params={"id": rid}).json()["requests"]


# -- rule: a refusal closes ---------------------------------------------------------------------------------
REFUSED_HEADS = {
    "401 no key": f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Length: 100000000000\r\n\r\n",
    "401 wrong key": f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer nope\r\nContent-Length: 100\r\n\r\n",
    "404": "POST /nothing-here HTTP/1.1\r\nHost: x\r\nContent-Length: 100000000000\r\n\r\n",
    "413": f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\nContent-Length: 100000000000\r\n\r\n",
    "426": (f"POST /v1/responses HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\nConnection: Upgrade\r\n"
            "Upgrade: websocket\r\nContent-Length: 100\r\n\r\n"),
    "401 chunked": f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n",
}


@pytest.mark.parametrize("case", list(REFUSED_HEADS))
def test_a_refusal_closes_its_connection_and_reads_nothing_of_the_body(watched, case):
    """The refusal says `connection: close`, and however fast the client then sends the body it
    declared, the pool parses none of it (RSS stays) and ends the connection within its linger."""
    with connect(watched, "127.0.5.1") as s:
        s.sendall(REFUSED_HEADS[case].encode())
        answer = head_of(s)
        status = case.split()[0].encode()
        assert answer.startswith(b"HTTP/1.1 " + status), answer[:300]
        assert b"connection: close" in answer.lower()
        chunk = (b"ffff\r\n" + b"x" * 0xFFFF + b"\r\n") if case.endswith("chunked") else b"x" * 2**16
        s.settimeout(0.2)
        sent, until = 0, time.monotonic() + LINGER_S + 3
        try:
            while time.monotonic() < until:
                try:
                    sent += s.send(chunk)
                except TimeoutError:
                    continue
        except (ConnectionResetError, BrokenPipeError):
            pass  # ended after its linger
        else:
            assert closed_within(s, CLOSED_WITHIN_S), "the refused connection stayed open"
    health_within_a_second(watched)


def test_a_refused_client_still_sending_its_body_sees_its_answer(watched):
    """A real client (httpx) sending a 3 MiB prompt with a wrong key gets its 401, not a reset:
    the pool reads and drops the rest of the body while the connection lingers."""
    body = json.dumps({"model": "syn", "messages": [{"role": "user", "content": "x" * (3 * 2**20)}]})
    with httpx.Client(base_url=f"http://127.0.0.1:{watched.port}", timeout=30) as client:
        for key in ("nope", None):
            headers = {"content-type": "application/json", **({"authorization": f"Bearer {key}"} if key else {})}
            r = client.post(CHAT, content=body, headers=headers)
            assert r.status_code == 401, r.text[:300]
            assert r.json()["error"]["code"] in ("invalid_api_key", "unauthorized") and r.headers["connection"] == "close"


def test_many_refused_connections_hold_the_pool_for_no_one(watched):
    """Addresses past max_connections, each a keyless POST head, its 401, then one byte of the
    body: every one ends within its linger (not body_timeout_s), and a newcomer is answered."""
    sockets = []
    try:
        for i in range(MAX_CONNECTIONS + 30):
            try:
                s = connect(watched, f"127.0.6.{i % 200 + 1}", timeout=2)
                s.sendall(f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n".encode())
                assert head_of(s).startswith(b"HTTP/1.1 401")
                s.sendall(b"x")
            except (ConnectionResetError, BrokenPipeError):
                continue  # made room for a newer one: a refused connection counts as idle
            sockets.append(s)
        health_within_a_second(watched, "127.0.7.1")
        still_open = [s for s in sockets if not closed_within(s, CLOSED_WITHIN_S)]
        assert not still_open, f"{len(still_open)} refused connections still open"
    finally:
        for s in sockets:
            s.close()


# -- rule: trailers and chunk framing are header bytes ------------------------------------------------------------
def chunked_head(path: str = CHAT) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nAuthorization: Bearer {KEY}\r\n"
            f"Transfer-Encoding: chunked\r\n\r\n").encode()


def test_a_chunked_body_with_small_trailers_is_served(watched):
    body = json.dumps({"model": "syn", "messages": [{"role": "user", "content": "hi"}]}).encode()
    chunks = b"".join(b"%x;ext=1\r\n%s\r\n" % (len(body[i:i + 7]), body[i:i + 7]) for i in range(0, len(body), 7))
    with connect(watched, "127.0.5.2") as s:
        s.sendall(chunked_head() + chunks + b"0\r\nX-Checksum: abc\r\n\r\n")
        answer = head_of(s)
    assert answer.startswith(b"HTTP/1.1 200"), answer[:300]


@pytest.mark.parametrize("what", ["trailer", "one-byte chunks"])
def test_chunk_framing_and_trailers_past_max_header_bytes_end_the_connection(watched, what):
    """A trailer value sent a little at a time (each parser grows it by copying), or a body in
    1-byte chunks (a call in each parser per chunk): once its framing passes max_header_bytes the
    connection ends; the pool's CPU and RSS stay put and others are answered meanwhile."""
    cpu_before = sum(watched.process.cpu_times()[:2])
    with connect(watched, "127.0.5.3") as s:
        if what == "trailer":
            s.sendall(chunked_head() + b"1\r\n{\r\n0\r\nX-T: ")
            piece = b"a" * 512
        else:
            s.sendall(chunked_head())
            piece = b"1\r\nx\r\n" * 100
        s.settimeout(0.5)
        sent = 0
        with pytest.raises((ConnectionResetError, BrokenPipeError)):
            while sent < 64 * HEADER_BYTES:
                s.sendall(piece)
                sent += len(piece)
                if sent % (8 * HEADER_BYTES) < len(piece):
                    health_within_a_second(watched)
            s.recv(1)  # the close, when every send made it into the kernel's buffers
    took = sum(watched.process.cpu_times()[:2]) - cpu_before
    assert took < 5.0, f"the supervisor spent {took:.1f} s of CPU on it"
    health_within_a_second(watched)


# -- rule: answers nobody takes are held against a budget ---------------------------------------------------------
class WholeAnswers(ListenerApp):
    """An app behind the pool's listener that answers every request whole, in one write of
    ANSWER_BYTES (as an admin answer is sent), and records what it built."""

    ANSWER_BYTES = 8 * 2**20

    def __init__(self) -> None:
        super().__init__()
        self.built: list[str] = []

    async def handle(self, scope, receive, send, connection) -> None:
        self.built.append(scope["path"])
        body = b"x" * self.ANSWER_BYTES
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


def test_no_pipelined_answer_is_built_while_one_is_unsent(tmp_path):
    """A client pipelines three requests, each answered whole with 8 MiB, and reads nothing: the
    second is not built while the first answer is unsent (a request on another connection, made
    after the first answer, is); once the client reads, all three come, in order."""
    with WholeAnswers() as server:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.settimeout(30)
        with s:
            s.connect(("127.0.0.1", server.port))
            s.sendall(b"".join(b"GET /%d HTTP/1.1\r\nHost: x\r\n\r\n" % i for i in range(3)))
            wait_for(lambda: server.built, 10, what="the first answer built")
            with socket.create_connection(("127.0.0.1", server.port), timeout=30) as other:
                other.sendall(b"GET /probe HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                wait_for(lambda: "/probe" in server.built, 10, what="the probe built")
                other.shutdown(socket.SHUT_RDWR)
            assert server.built == ["/0", "/probe"], server.built
            want = 3 * (server.ANSWER_BYTES + len(b"HTTP/1.1 200 OK\r\n"))
            got = 0
            while got < want and len(server.built) < 4:
                piece = s.recv(2**20)
                assert piece, got
                got += len(piece)
            wait_for(lambda: len(server.built) == 4, 30, what="the pipelined requests built once read")
        assert server.built == ["/0", "/probe", "/1", "/2"], server.built


def test_answers_nobody_takes_are_bounded_for_the_whole_pool(watched):
    """Four clients each ask a 7 MB answer and read nothing: past max_unsent_total_bytes the
    connection that holds the most is closed (said in the log), so the pool holds at most about
    that much; those left get their whole answer once they read."""
    sockets = []
    try:
        for i in range(4):
            s = connect(watched, f"127.0.5.{10 + i}", timeout=30, rcvbuf=4096)
            s.sendall(chat_request("big", f"unsent-{i}-{time.monotonic_ns()}"))
            sockets.append(s)
        wait_for(lambda: "max_unsent_total_bytes" in watched.log(), 60,
                 what="a connection closed for the pool's unsent budget")
        health_within_a_second(watched)
        whole = cut = 0
        for s in sockets:
            answer = b""
            try:
                while piece := s.recv(2**20):
                    answer += piece
                    if answer.endswith(b"}"):
                        break
            except ConnectionResetError:
                pass
            length = int(answer.split(b"content-length: ")[1].split(b"\r\n")[0]) if b"content-length: " in answer \
                else -1
            body = answer.split(b"\r\n\r\n", 1)[1] if b"\r\n\r\n" in answer else b""
            if len(body) == length:
                whole += 1
            else:
                cut += 1
        assert cut >= 1 and whole >= 1, (whole, cut)
    finally:
        for s in sockets:
            s.close()
