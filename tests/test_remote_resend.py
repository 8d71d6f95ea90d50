"""openai_remote never sends one generation twice (issue 42, B6).

A server that read a request and then dropped the connection may have started (and
billed) the generation; aiohttp reports that drop in the same words as a pooled
connection found closed. The pool re-sends only what never left: a connection that
could not be made."""

from __future__ import annotations

import socket
import threading

from tests.pool import wait_for

CHAT = "/v1/chat/completions"


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
            data = b""
            while b"\r\n\r\n" not in data:
                if not (piece := conn.recv(65536)):
                    return
                data += piece
            head, _, body = data.partition(b"\r\n\r\n")
            length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), 0)
            while len(body) < length:
                if not (piece := conn.recv(65536)):
                    return
                body += piece
            with self._lock:
                self.requests.append(head.split(b"\r\n", 1)[0])
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
