"""A client that asks for a stream and stops reading it (issue 33, finding 4).

Once the client's socket and the edge's write buffer are full, the stream's
handler waits on its write and the runtime's deltas pile up in the job. A fast
runtime once made the supervisor hold them all (75 -> 308 MB in 54 s for four
such clients, still held after they left): each queued Delta costs about 40
times its text. [server] max_unsent_output_bytes bounds what a job holds
unsent; past it the job ends, its worker stops it (the slot frees) and what it
held is dropped."""

from __future__ import annotations

import json
import socket
import time

import psutil

from tests.conftest import synthetic
from tests.pool import wait_for

CHAT = "/v1/chat/completions"
# per answer: 19 MB of text, so that even a worker that joins many tokens per Delta sends
# more than the bound (with the sockets' buffers) before the answer ends
TOKENS = 3_000_000
STREAMS = 4
RSS_SLACK = 64 * 2**20


def stalled_stream(pool) -> socket.socket:
    """A raw connection that sends a streaming chat request, reads the response
    head, and then reads nothing more (a small receive buffer, so that the
    supervisor's writes back up soon)."""
    client = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 * 1024)
    client.settimeout(30)
    client.connect(("127.0.0.1", pool.port))
    body = json.dumps({"model": "syn", "stream": True, "messages": [{"role": "user", "content": "go"}]}).encode()
    client.sendall(b"POST " + CHAT.encode() + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                   b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    head = b""
    while b"\r\n\r\n" not in head:
        piece = client.recv(1)  # byte by byte: nothing of the body is read
        assert piece, f"connection closed before the response head: {head!r}"
        head += piece
    assert head.startswith(b"HTTP/1.1 200"), head
    return client


def read_to_end(client: socket.socket, deadline_s: float = 30) -> bytes:
    """The rest of a chunked response, up to its last chunk."""
    deadline = time.monotonic() + deadline_s
    data = b""
    while not data.endswith(b"\r\n0\r\n\r\n"):
        assert time.monotonic() < deadline, f"the stream did not end: ...{data[-300:]!r}"
        piece = client.recv(1 << 16)
        if not piece:
            break
        data += piece
    return data


def test_clients_that_stop_reading_their_streams_do_not_make_the_supervisor_hold_them(make_pool):
    """Four clients read the head of a fast stream and then nothing (the finding's case):
    each job ends at max_unsent_output_bytes (8 MiB, the default), its worker stops it,
    the supervisor grows by far less than the 64 MiB it took before the bound (and went
    on taking), and the next client is served at once."""
    # a token per wake-up of the worker: one Delta each, as a fast runtime sends them
    pool = make_pool([synthetic("syn", tokens=TOKENS, tps=100_000, capacity=STREAMS, target_inflight=STREAMS)])
    supervisor = psutil.Process(pool.proc.pid)
    r = pool.http.post(CHAT, json={"model": "syn", "messages": [{"role": "user", "content": "warm"}],
                                   "max_tokens": 2})
    assert r.status_code == 200, r.text
    rss_start = supervisor.memory_info().rss

    def jobs_ended() -> bool:
        grown = supervisor.memory_info().rss - rss_start
        assert grown < RSS_SLACK, f"the supervisor grew {grown / 2**20:.0f} MiB holding streams nobody reads"
        return pool.workers("syn")[0]["inflight"] == 0 and pool.model("syn")["runtime_inflight"] == 0

    clients = []
    try:
        for _ in range(STREAMS):
            clients.append(stalled_stream(pool))
        # each job ends at the bound and its worker stops it: the slots free while the clients read nothing
        wait_for(jobs_ended, 60, what="the unread streams' jobs ended and their slots free")
        # a client that reads again gets what was sent, then the error: never the end of the answer
        rests = [read_to_end(client) for client in clients]
    finally:
        for client in clients:
            client.close()
    for rest in rests:
        assert b'"code":"runtime_timeout"' in rest and b"did not read" in rest, rest[-500:]
        assert b"max_unsent_output_bytes" in rest and b'"finish_reason":"stop"' not in rest
        assert rest.count(b" ") < TOKENS // 4  # it ended early, not at the end of the answer
    assert supervisor.memory_info().rss - rss_start < RSS_SLACK
    # the next clients are served at once, in full
    started = time.monotonic()
    r = pool.http.post(CHAT, json={"model": "syn", "messages": [{"role": "user", "content": "next"}],
                                   "max_tokens": 5})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length", r.text
    assert time.monotonic() - started < 2.0
    with pool.http.stream("POST", CHAT, json={"model": "syn", "stream": True, "max_tokens": 50,
                                              "messages": [{"role": "user", "content": "next"}]}) as r:
        body = r.read().decode()
    assert r.status_code == 200 and body.endswith("data: [DONE]\n\n"), body[-300:]
    workers = pool.workers("syn")
    assert [w["inflight"] for w in workers] == [0] and [w["restarts"] for w in workers] == [0]


def test_a_whole_answer_is_collected_as_it_comes_and_never_hits_the_bound(make_pool):
    """The bound is on what waits for a reader that is not there: a whole answer of many
    deltas (tens of times the bound, as held) is taken as it comes and served, while a
    stream nobody reads still ends at the same small bound."""
    pool = make_pool([synthetic("syn", tokens=TOKENS, tps=100_000, capacity=2, target_inflight=2)],
                     server={"max_unsent_output_bytes": 64 * 1024})
    r = pool.http.post(CHAT, json={"model": "syn", "messages": [{"role": "user", "content": "whole"}],
                                   "max_tokens": 40_000})  # 10 MB as held, had it waited
    assert r.status_code == 200, r.text[:500]
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length" and len(choice["message"]["content"].split()) == 40_000
    client = stalled_stream(pool)
    try:
        wait_for(lambda: pool.workers("syn")[0]["inflight"] == 0, 30, what="the unread stream's job ended")
        rest = read_to_end(client)
    finally:
        client.close()
    assert b"max_unsent_output_bytes" in rest and b'"finish_reason":"stop"' not in rest, rest[-500:]
