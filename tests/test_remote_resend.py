"""openai_remote never sends one generation twice (issue 42, B6).

A server that read a request and then dropped the connection may have started (and
billed) the generation; aiohttp reports that drop in the same words as a pooled
connection found closed. The pool re-sends only what never left: a connection that
could not be made."""

from __future__ import annotations

import contextlib
import socket
import threading
from concurrent.futures import ThreadPoolExecutor

from tests.pool import wait_for

CHAT = "/v1/chat/completions"


def read_request(conn: socket.socket, data: bytes) -> tuple[bytes, bytes] | None:
    """Read one HTTP request whole from `conn` (`data`: what was read past the one before):
    (its request line, what was read past it); None when the client closed first."""
    while b"\r\n\r\n" not in data:
        if not (piece := conn.recv(65536)):
            return None
        data += piece
    head, _, rest = data.partition(b"\r\n\r\n")
    length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    while len(rest) < length:
        if not (piece := conn.recv(65536)):
            return None
        rest += piece
    return head.split(b"\r\n", 1)[0], rest[length:]


class DroppingServer:
    """A real TCP server on loopback: reads each HTTP request whole, counts it, and closes
    the connection without a byte of answer (a remote that took the request and fell over)."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.requests: list[bytes] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed: the test is over
                return
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(10)
            if (got := read_request(conn, b"")) is None:
                return
            with self._lock:
                self.requests.append(got[0])
            conn.shutdown(socket.SHUT_RDWR)  # the whole request was read: now the connection drops

    def count(self) -> int:
        with self._lock:
            return len(self.requests)

    def close(self) -> None:
        self.sock.close()


def test_a_request_the_remote_took_and_dropped_is_not_sent_again(make_pool):
    server = DroppingServer()
    try:
        pool = make_pool([{"name": "r", "backend": "openai_remote", "target_inflight": 1,
                           "options": {"base_url": f"http://127.0.0.1:{server.port}/v1", "model": "m"}}])
        for stream in (False, True):
            before = server.count()
            r = pool.http.post(CHAT, json={"model": "r", "stream": stream,
                                           "messages": [{"role": "user", "content": "bill me once"}]})
            assert r.status_code == 502, r.text
            assert r.json()["error"]["code"] == "runtime_crashed", r.text
            wait_for(lambda: server.count() > before, 10, what="the remote got the request")
            # a re-send would have reached the server by the time the client had its answer
            assert server.count() == before + 1, server.requests
            assert server.requests[-1].startswith(b"POST /v1/chat/completions ")
    finally:
        server.close()


class FirstOnlyServer(DroppingServer):
    """Each connection answers its first request (a whole chat completion, kept alive once
    `ready` connections have one in flight, so that the pool holds that many open) and drops
    every later request on it after reading it whole: each pooled connection is stale."""

    ANSWER = (b'{"id":"x","object":"chat.completion","created":0,"model":"m","choices":[{"index":0,'
              b'"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}],'
              b'"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}')

    def __init__(self, ready: int) -> None:
        self.barrier = threading.Barrier(ready, timeout=30)
        self.connections = 0
        super().__init__()

    def _one(self, conn: socket.socket) -> None:
        with self._lock:
            self.connections += 1
        with conn:
            conn.settimeout(30)
            data, first = b"", True
            while True:
                if (got := read_request(conn, data)) is None:
                    return
                line, data = got
                with self._lock:
                    self.requests.append(line)
                if not first:
                    conn.shutdown(socket.SHUT_RDWR)  # read whole, then dropped: the remote may bill it
                    return
                first = False
                with contextlib.suppress(threading.BrokenBarrierError):
                    self.barrier.wait()
                conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                             b"content-length: %d\r\n\r\n%s" % (len(self.ANSWER), self.ANSWER))


def test_a_request_on_a_stale_kept_alive_connection_is_sent_once_more_on_a_connection_of_its_own(make_pool):
    """Finding 8 of issue 53: four kept-alive connections, each stale; a request taken by one is
    sent once more, on a new connection (answered), not again and again on the other stale ones:
    the remote gets it at most twice (it was four times)."""
    server = FirstOnlyServer(ready=4)
    try:
        pool = make_pool([{"name": "r", "backend": "openai_remote", "target_inflight": 4,
                           "options": {"base_url": f"http://127.0.0.1:{server.port}/v1", "model": "m"}}])
        with ThreadPoolExecutor(4) as ex:
            answers = list(ex.map(lambda _: pool.http.post(CHAT, json={
                "model": "r", "messages": [{"role": "user", "content": "open a connection"}]}), range(4)))
        assert [r.status_code for r in answers] == [200] * 4, [r.text for r in answers]
        assert server.connections == 4
        before = server.count()
        r = pool.http.post(CHAT, json={"model": "r", "messages": [{"role": "user", "content": "bill me"}]})
        assert r.status_code == 200, r.text
        assert server.count() - before == 2, server.requests[before:]
        assert server.connections == 5  # the second try had a connection of its own
    finally:
        server.close()
