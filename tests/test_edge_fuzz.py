"""A differential fuzzer for the HTTP edge (issue 53, item 2), in the hostile tier.

Hypothesis builds byte streams of one or more HTTP/1.1 requests (pipelined; bodies by
Content-Length in odd spellings or chunked with extensions and trailers; Expect, Upgrade,
HTTP/1.0, `Connection: close`; sometimes a stray byte spliced in, sometimes cut short), sends
each over a real socket, in pieces at random boundaries, to uvicorn behind the pool's own
listener (`bounded_protocol`), whose app records every request it is handed and keeps the
listener's contract with the guard (begin_request / end_request). For each stream it holds:
- **framing**: the app is handed exactly the requests llhttp frames when it parses the whole
  stream at once (method, target, body), in order, and nothing after a request it refuses
  or after one that closes the connection;
- **answers**: one answer per request handed on, in order, and a 400 for a stream llhttp
  refuses;
- **bounds**: what a connection holds back (its pipelining backlog) stays under its cap;
- **timers**: a stream left unfinished (no close from the client) is closed by the pool
  within its phase's timer.
A failure prints the shortest stream hypothesis finds. LLM_POOL_FUZZ_EXAMPLES sets the budget
(examples per run; each costs about a second, the keep-alive timer it waits out)."""

from __future__ import annotations

import os
import socket
import time

import httptools
import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from supervisor.config import ServerConfig
from testkit.listener_app import ListenerApp

pytestmark = pytest.mark.hostile

EXAMPLES = int(os.environ.get("LLM_POOL_FUZZ_EXAMPLES", "60"))
TIMER_S = 1.0  # header, body and keep-alive timers of the server under test
CLOSED_WITHIN_S = 3 * TIMER_S + 5  # a phase's timer, on a busy machine
BOUNDS = ServerConfig(header_timeout_s=TIMER_S, body_timeout_s=TIMER_S, max_header_bytes=4096, max_headers=20,
                      max_pipelined_requests=4)


class Recorder(ListenerApp):
    """The pool's listener in front of an app that records what it is handed, whole."""

    def __init__(self) -> None:
        super().__init__(BOUNDS, timeout_keep_alive=TIMER_S)
        self.seen: list[tuple[bytes, bytes, bytes]] = []
        self.backlog_peak = 0

    async def handle(self, scope, receive, send, connection) -> None:
        body = b""
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # never whole: not handed on
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        target = scope["raw_path"] + (b"?" + scope["query_string"] if scope["query_string"] else b"")
        self.seen.append((scope["method"].encode(), target, body))
        # what the listener holds back: its backlog (a test's look inside its own code)
        self.backlog_peak = max(self.backlog_peak, len(connection._backlog))
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})


class Reference:
    """llhttp (httptools) over the whole stream at once, as the listener runs it (lenient data
    after close; an upgrade answered as HTTP/1.1, what follows parsed on): the complete requests
    up to one after which the server closes, and whether the stream is refused before its end."""

    def __init__(self, data: bytes) -> None:
        self.requests: list[tuple[bytes, bytes, bytes]] = []
        self.refused = self.refused_in_body = False
        self.closes = False  # a request asked to close: nothing after it is served
        self.cut = False  # a chunked body's framing and trailers over max_header_bytes: the connection ends
        self._url = self._body = b""
        self._chunked = False
        self._after_head = None  # bytes of the message since its head, while in its body
        parser = httptools.HttpRequestParser(self)
        parser.set_dangerous_leniencies(lenient_data_after_close=True)
        self.parser = parser
        at = 0
        while at < len(data) and not (self.closes or self.cut):
            try:  # a byte at a time: the framing of each body is counted exactly
                parser.feed_data(data[at:at + 1])
            except httptools.HttpParserUpgrade:
                pass  # the byte that ended the upgrade request's head: parsing goes on after it
            except httptools.HttpParserError:
                # in a body, its request is being answered: no room for a 400, the connection ends
                self.refused, self.refused_in_body = True, self._after_head is not None
                return
            if self._after_head is not None:
                self._after_head += 1
            at += 1

    def on_message_begin(self):
        self._url, self._body, self._chunked = b"", b"", False

    def on_header(self, name: bytes, value: bytes):
        if name.lower() == b"transfer-encoding" and b"chunked" in value.lower():
            self._chunked = True

    def on_headers_complete(self):
        self._after_head = -1  # the byte that completed the head is counted after this call

    def on_url(self, url: bytes):
        self._url += url

    def on_body(self, body: bytes):
        self._body += body

    def on_message_complete(self):
        framing, self._after_head = (self._after_head or 0) + 1 - len(self._body), None
        if self.closes or self.cut:
            return
        if self._chunked and framing > BOUNDS.max_header_bytes:
            self.cut = True
            return
        self.requests.append((self.parser.get_method(), self._url, self._body))
        # the server closes after it (uvicorn keeps no HTTP/1.0 connection alive, whatever it asks)
        if not self.parser.should_keep_alive() or self.parser.get_http_version() == "1.0":
            self.closes = True


# -- the streams -----------------------------------------------------------------------------------------------
TOKEN = st.text(alphabet="abcdefghijklmnopqrstuvwxyz-0123456789", min_size=1, max_size=12)
VALUE = st.text(alphabet="abcdefghijklmnopqrstuvwxyz ABC/=;,.0123456789", max_size=30).map(str.strip)


@st.composite
def request(draw) -> bytes:
    method = draw(st.sampled_from(["GET", "POST", "PUT", "DELETE", "OPTIONS"]))
    target = "/" + draw(TOKEN) + draw(st.sampled_from(["", "?q=1", "?a=b&c=d"]))
    version = draw(st.sampled_from(["HTTP/1.1"] * 6 + ["HTTP/1.0"]))
    headers = [("Host", "x")] + draw(st.lists(st.tuples(TOKEN.map(lambda t: "X-" + t), VALUE), max_size=4))
    extras = draw(st.sets(st.sampled_from(["close", "keep-alive", "expect", "upgrade", "h2c"])))
    if "close" in extras:
        headers.append(("Connection", "close"))
    elif "keep-alive" in extras:
        headers.append(("Connection", "keep-alive"))
    if "expect" in extras:
        headers.append(("Expect", "100-continue"))
    if "upgrade" in extras:
        headers += [("Connection", "Upgrade"), ("Upgrade", "websocket" if "h2c" not in extras else "h2c")]
    body = draw(st.binary(max_size=300))
    mode = draw(st.sampled_from(["none", "length", "length", "chunked"]))
    framed = b""
    if mode == "length":
        name = draw(st.sampled_from(["Content-Length", "content-length", "CONTENT-LENGTH"]))
        value = draw(st.sampled_from(["{n}", "{n}", "0{n}", " {n}", "{n} "])).format(n=len(body))
        headers.append((name, value))
        framed = body
    elif mode == "chunked":
        headers.append((draw(st.sampled_from(["Transfer-Encoding", "transfer-encoding"])),
                        draw(st.sampled_from(["chunked", "Chunked", "gzip, chunked"]))))
        cuts = sorted(draw(st.sets(st.integers(1, max(1, len(body) - 1)), max_size=5))) if body else []
        pieces = [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)]) if body[a:b]]
        for piece in pieces:
            extension = draw(st.sampled_from(["", ";x=1", ";name"]))
            framed += b"%x%s\r\n%s\r\n" % (len(piece), extension.encode(), piece)
        trailers = draw(st.lists(st.tuples(TOKEN.map(lambda t: "T-" + t), VALUE), max_size=2))
        if draw(st.integers(0, 5)) == 0:  # a trailer near or past max_header_bytes
            trailers.append(("T-big", "t" * draw(st.integers(BOUNDS.max_header_bytes - 200,
                                                             BOUNDS.max_header_bytes + 200))))
        framed += b"0\r\n" + b"".join(f"{n}: {v}\r\n".encode() for n, v in trailers) + b"\r\n"
    head = f"{method} {target} {version}\r\n" + "".join(f"{n}: {v}\r\n" for n, v in headers) + "\r\n"
    return head.encode("latin-1") + framed


@st.composite
def stream(draw) -> tuple[bytes, list[int], bool]:
    """(the bytes, where they are split into sends, whether the client closes its side after)."""
    data = b"".join(draw(st.lists(request(), min_size=1, max_size=4)))
    if draw(st.integers(0, 4)) == 0:  # a stray byte: most such streams are refused somewhere
        at = draw(st.integers(0, len(data)))
        data = data[:at] + draw(st.sampled_from([b"\x00", b" ", b"\r", b"\n", b":", b"\x7f", b"G"])) + data[at:]
    if draw(st.integers(0, 5)) == 0:  # cut short: the pool's timers end it
        data = data[:draw(st.integers(1, len(data)))]
    splits = sorted(draw(st.sets(st.integers(1, max(1, len(data) - 1)), max_size=6)))
    return data, splits, draw(st.booleans())


def send_and_read(port: int, data: bytes, splits: list[int], half_close: bool) -> tuple[bytes, float | None]:
    """Send the stream in its pieces, then read every answer until the pool closes the connection
    (None for how long: it did not within CLOSED_WITHIN_S)."""
    with socket.create_connection(("127.0.0.1", port), timeout=CLOSED_WITHIN_S) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for a, b in zip([0, *splits], [*splits, len(data)]):
            try:
                s.sendall(data[a:b])
            except (BrokenPipeError, ConnectionResetError):  # closed by the pool part way (a refusal)
                break
        sent = time.monotonic()
        if half_close:
            try:
                s.shutdown(socket.SHUT_WR)
            except OSError:
                pass
        answers = b""
        try:
            while piece := s.recv(65536):
                answers += piece
        except ConnectionResetError:
            pass
        except TimeoutError:
            return answers, None
        return answers, time.monotonic() - sent


def statuses(answers: bytes) -> list[int]:
    """The status of each whole answer in `answers`, interim ones (100 Continue) left out."""
    codes: list[int] = []

    class Collect:
        def on_message_complete(self):
            codes.append(parser.get_status_code())

    parser = httptools.HttpResponseParser(Collect())
    try:
        parser.feed_data(answers)
    except httptools.HttpParserError:
        pass
    return [code for code in codes if code >= 200]


@pytest.fixture(scope="module")
def server():
    with Recorder() as recorder:
        yield recorder


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                        HealthCheck.too_slow])
@given(case=stream())
def test_the_edge_frames_every_stream_as_llhttp_does_and_holds_its_bounds(server, case):
    data, splits, half_close = case
    note(f"stream: {data!r}, sent split at {splits}, {'half-closed' if half_close else 'left open'}")
    reference = Reference(data)
    server.seen.clear()
    answers, took = send_and_read(server.port, data, splits, half_close)
    assert took is not None, f"the connection outlived its timers ({CLOSED_WITHIN_S} s): {data!r}"
    seen = server.seen
    codes = statuses(answers)
    if half_close:  # a client that closed its side may lose what it had not been answered yet
        assert seen == reference.requests[:len(seen)], (data, seen, reference.requests)
    else:
        assert seen == reference.requests, (data, seen, reference.requests)
        assert codes[:len(seen)] == [200] * len(seen), (data, codes)
        if reference.refused and not (reference.closes or reference.cut or reference.refused_in_body):
            assert codes[len(seen):] == [400], (data, codes)
        else:
            assert len(codes) == len(seen), (data, codes)
    assert server.backlog_peak <= BOUNDS.max_header_bytes + 65536, server.backlog_peak
