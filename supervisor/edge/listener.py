"""The first room a request enters: each HTTP connection, bounded, around
uvicorn's own protocol object, which it feeds through the asyncio.Protocol
methods only (composition, no subclass).

llhttp bounds no header size, and uvicorn has no header, body or write
timeout, no connection cap and no bound on pipelined requests (it parses all
that one read holds); this layer adds them:
- connections: at most `max_connections`, and `max_connections_per_client`
  per client address. At either cap an idle connection (keep-alive between
  requests, or no whole request yet) is closed to make room: the oldest of
  that client's, or at the global cap the oldest of the client that holds the
  most. At the per-client cap a new one is refused when every one of that
  client's is busy; at the global cap, with none idle, the client that holds
  the most gives way, whatever the phase of its oldest connection, unless the
  newcomer's client holds as many;
- a request's line and headers: `max_header_bytes` and `max_headers` lines
  (else 431 and close), complete within `header_timeout_s` (else closed). A
  chunked body's framing (chunk sizes, extensions, the trailer section) counts
  as header bytes too, its trailers as header lines: trailers are bounded as a
  head is, and a body cannot come in more chunks than that allows;
- its body complete within `body_timeout_s` of its headers (else closed);
- a request the guard answers without reading the body it declared: nothing
  more is read from its connection, which closes once the answer is out;
- pipelining: one request at a time. Once a request is whole, nothing after
  it reaches the server until it is answered and its answer is out of the
  pool's hands (the transport's buffer under its high-water mark); meanwhile
  the connection reads on (so that a close is seen at once), and what comes
  waits here, at most about `max_header_bytes` plus one read and
  `max_pipelined_requests` request heads, then reading stops;
- a response the client does not read for `write_timeout_s` (the socket's
  send buffer stays full), or a closing connection whose answer is not out
  by then: the connection is closed, which ends the request's job (its
  handler hears it through `Disconnect`);
- answers written and not yet taken, all connections together: at most
  `max_unsent_total_bytes`; past it the connection holding the most is closed;
- an Upgrade (h2c, anything: the pool speaks no other protocol) is answered
  as plain HTTP/1.1, and every bound stays on for the connection's life;
- a request HTTP cannot parse gets the error envelope (400) and a close.
It also tells a request's handler when its client goes (`Disconnect`), and
joins what one loop turn writes into one write (`CoalescedWrites`).
"""

from __future__ import annotations

import asyncio
import enum
import json
import logging
from asyncio import TimerHandle

import httptools
from uvicorn.config import HTTP_PROTOCOLS
from uvicorn.importer import import_from_string

from protocol.errors import ErrorCode, PoolError
from supervisor.config import ServerConfig
from supervisor.edge.request_ids import fresh_id
from supervisor.edge.writes import CoalescedWrites
from supervisor.log_throttle import CLIENT_WARNING_EVERY_S, ThrottledLog

log = logging.getLogger("llm_pool.http")
warnings = ThrottledLog(log, every_s=CLIENT_WARNING_EVERY_S)  # a client can make any of these at will

DISCONNECT_KEY = "llm_pool.disconnect"  # in the ASGI scope of each request read by a BoundedConnection
HEAD_END = b"\r\n\r\n"  # where a request's head ends (and a chunked body)
# How long a connection closing after a refusal reads and drops what its client still sends
# (BoundedConnection.linger): a close with unread bytes resets the connection, and a client still
# sending its body could lose the answer with it (nginx's lingering close; its lingering_timeout is 5 s)
LINGER_S = 2.0

# The connection of a request, in its scope's "state": uvicorn hands its protocol the lifespan
# state (`app_state`) and copies it into each request's scope["state"] (the ASGI lifespan state:
# a shallow copy per request). Each connection gives its own protocol that state plus itself.
CONNECTION_KEY = "llm_pool.connection"


def connection_of(scope) -> BoundedConnection | None:
    """The BoundedConnection that read this request; None under another server."""
    state = scope.get("state")
    return state.get(CONNECTION_KEY) if state is not None else None


class Phase(enum.Enum):
    IDLE = "idle"  # between requests (or before the first): the next bytes start a request
    HEADERS = "headers"  # a request line has begun; its headers are not complete
    BODY = "body"  # headers complete, body not yet


IDLE, HEADERS, BODY = Phase.IDLE, Phase.HEADERS, Phase.BODY  # module names: see states.JOB_QUEUED


class Disconnect:
    """Whether a request's client has gone, and what to do when it goes: set by
    the connection (`BoundedConnection.connection_lost`), read by the
    handler. A callback costs nothing until it fires, where a task that waits
    on receive() for http.disconnect costs a task per request."""

    __slots__ = ("gone", "callback")

    def __init__(self) -> None:
        self.gone = False
        self.callback = None

    def fire(self) -> None:
        self.gone = True
        callback, self.callback = self.callback, None
        if callback is not None:
            callback()

    def on_gone(self, callback) -> None:
        """Call `callback` once when the client goes, at once if it has gone already."""
        if self.gone:
            return callback()
        self.callback = callback


class Connections:
    """The open connections of one server, least recently active first, all of them
    and per client address: who gets closed to make room at a cap."""

    def __init__(self, bounds: ServerConfig) -> None:
        self.bounds = bounds
        self.open: dict[BoundedConnection, None] = {}
        self.by_client: dict[str, dict[BoundedConnection, None]] = {}
        # the connections whose writing is paused (their answer past the transport's high-water
        # mark), with what each held when it paused: while it is paused the server writes little
        # more (uvicorn waits to drain), so this is about what the pool holds unsent
        self.unsent: dict[BoundedConnection, int] = {}
        self.unsent_bytes = 0

    def admit(self, connection: BoundedConnection) -> bool:
        """Count `connection` in, closing the oldest idle one at a full cap; False: no room."""
        mine = self.by_client.get(connection.client)
        if mine is not None and len(mine) >= self.bounds.max_connections_per_client:
            if not self._close_oldest_idle(mine, "max_connections_per_client"):
                return False
        if len(self.open) >= self.bounds.max_connections and not self._make_room(connection.client):
            return False
        self.open[connection] = None
        self.by_client.setdefault(connection.client, {})[connection] = None
        return True

    def active(self, connection: BoundedConnection) -> None:
        """It began a request: last in line to be closed."""
        for table in (self.open, self.by_client.get(connection.client)):
            if table is not None and table.pop(connection, 0) is None:
                table[connection] = None

    def hold_unsent(self, connection: BoundedConnection, size: int) -> None:
        """`connection` holds `size` bytes its client has not taken; over max_unsent_total_bytes
        all together, the connection that holds the most is closed (its job is cancelled)."""
        self.release_unsent(connection)
        self.unsent[connection] = size
        self.unsent_bytes += size
        if self.unsent_bytes > self.bounds.max_unsent_total_bytes:
            largest = max(self.unsent, key=self.unsent.__getitem__)
            warnings.warning("unsent", "closed a connection from %s holding %d bytes of answers its client has not "
                             "taken: %d bytes unsent on all connections (server.max_unsent_total_bytes)",
                             largest.client, self.unsent[largest], self.unsent_bytes)
            self.release_unsent(largest)
            largest.transport.abort()

    def release_unsent(self, connection: BoundedConnection) -> None:
        self.unsent_bytes -= self.unsent.pop(connection, 0)

    def remove(self, connection: BoundedConnection) -> None:
        self.release_unsent(connection)
        self.open.pop(connection, None)
        mine = self.by_client.get(connection.client)
        if mine is not None:
            mine.pop(connection, None)
            if not mine:
                del self.by_client[connection.client]

    def _make_room(self, newcomer: str) -> bool:
        """At the global cap: the oldest idle connection of the client that holds the most, so
        that a client opening connections fast pushes out its own, not a newcomer's; with none
        idle, the oldest of the client that holds the most, whatever its phase (a head, a body
        or an answer under way), when it holds more than the newcomer's client."""
        holders = sorted(self.by_client.items(), key=lambda item: len(item[1]), reverse=True)
        for _, table in holders:
            if self._close_oldest_idle(table, "max_connections"):
                return True
        client, table = holders[0]
        if client == newcomer or len(table) <= len(self.by_client.get(newcomer, ())) + 1:
            return False
        oldest = next(iter(table))
        warnings.warning("evict busy", "closed a busy connection from %s, the client that holds the most "
                         "(%d), to make room for %s (server.max_connections)", client, len(table), newcomer)
        self.remove(oldest)
        oldest.transport.abort()
        return True

    def _close_oldest_idle(self, table: dict[BoundedConnection, None], cap: str) -> bool:
        oldest = next((c for c in table if c.idle()), None)
        if oldest is None:
            return False
        warnings.warning(f"evict {cap}", "closed an idle connection from %s to make room (server.%s)",
                         oldest.client, cap)
        self.remove(oldest)
        oldest.transport.abort()
        return True


class BoundedConnection(asyncio.Protocol):
    """One HTTP connection, bounded (see the module's docstring), around the ASGI
    server's own protocol object (`inner`). The bytes are read by a parser of its own
    (httptools, with no per-header callback but a count) before the server's protocol
    gets them. A request read whole in one read costs no timer and no cut. Header
    bytes are counted as they arrive; a read that holds the end of one request and
    the start of the next counts from the next read on (so a request's headers can
    exceed the cap by one read)."""

    connections: Connections  # set by bounded_protocol()
    inner_class: type[asyncio.Protocol]

    def __init__(self, *args, **kwargs) -> None:
        # what the server passes to its protocol factory goes to its protocol, the lifespan state with
        # this connection added (the state is whole before the server accepts a connection)
        if isinstance(kwargs.get("app_state"), dict):
            kwargs["app_state"] = {**kwargs["app_state"], CONNECTION_KEY: self}
        self.inner = self.inner_class(*args, **kwargs)
        self.bounds = self.connections.bounds
        self.transport: CoalescedWrites | None = None
        self.client = "?"
        self._started = False  # counted in and handed to the server (not refused at the cap)
        self._lost = False  # connection_lost came
        self._parser = httptools.HttpRequestParser(self)
        try:  # as uvicorn's: a request after one that asked to close is left to the server
            self._parser.set_dangerous_leniencies(lenient_data_after_close=True)
        except AttributeError:  # httptools < 0.6.3
            pass
        self._phase = IDLE
        self._header_bytes = 0
        self._header_lines = 0
        self._body_left: int | None = None  # of the body being read, when its length is known
        self._chunked_body = 0  # bytes of a chunked body handed to on_body so far
        self._framing = 0  # bytes of a chunked body's framing and trailers (counted as header bytes)
        self._completed = 0  # requests read whole
        self._unanswered = 0  # requests handed to the server whose handler has not ended
        self._backlog = b""  # read, not yet handed on: the pipelining bound was reached
        self._server_reading = True  # what the server's flow control asked for
        self._reading = True
        self._discarding = False  # a body the guard will not read was declared: nothing more is read
        self._write_paused = False  # the answer is past the transport's high-water mark
        self._timer: TimerHandle | None = None  # the header or body deadline
        self._write_timer: TimerHandle | None = None  # the client takes nothing, or a close waits on it
        self.request: Disconnect | None = None  # of the newest request whose handler runs

    # -- asyncio.Protocol --------------------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = CoalescedWrites(transport, self)  # this side's writes too: one order
        peer = transport.get_extra_info("peername")
        self.client = str(peer[0]) if isinstance(peer, tuple) else "local"
        if not self.connections.admit(self):
            warnings.warning("refused", "refused a connection from %s: every open one is busy "
                             "(server.max_connections %d, per client %d)", self.client,
                             self.bounds.max_connections, self.bounds.max_connections_per_client)
            self.transport.abort()
            return
        self._started = True
        self.inner.connection_made(self.transport)
        self._arm(self.bounds.header_timeout_s, self._header_timeout)

    def connection_lost(self, exc) -> None:
        self._lost = True  # a close asked from now on (the server's, ours) arms no timer
        if not self._started:
            return
        self.connections.remove(self)
        self._disarm()
        if self._write_timer is not None:
            self._write_timer.cancel()
        self._backlog = b""
        self.inner.connection_lost(exc)
        if self.request is not None:  # a handler still runs: its client has gone
            self.request.fire()

    def pause_writing(self) -> None:
        # the client reads slower than the answer comes: it has write_timeout_s to read on
        self._write_paused = True
        self._arm_write_timer()
        self.connections.hold_unsent(self, self.transport.get_write_buffer_size())
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self._write_paused = False
        self.connections.release_unsent(self)
        if self._write_timer is not None and not self.transport.is_closing():  # a close keeps its deadline
            self._write_timer.cancel()
            self._write_timer = None
        self.inner.resume_writing()
        if self._backlog:  # a pipelined request waited for this answer to be out
            asyncio.get_running_loop().call_soon(self._release)

    def closing(self) -> None:
        """The transport closes once what was written is out (CoalescedWrites.close): the client
        has write_timeout_s to take it, whatever the answer's size."""
        if self._started and not self._lost and self._write_timer is None:
            self._arm_write_timer()

    def _arm_write_timer(self) -> None:
        if self._write_timer is not None:
            self._write_timer.cancel()
        self._write_timer = asyncio.get_running_loop().call_later(self.bounds.write_timeout_s, self._write_timeout)

    def eof_received(self):
        if self._discarding:
            return False  # the client has seen the answer and sends no more: the transport closes
        return self.inner.eof_received()

    def data_received(self, data: bytes) -> None:
        if not self._started or self._discarding or self.transport.is_closing():
            return  # discarding: the body of a refused request, dropped while the connection lingers
        if self._backlog:  # held at the pipelining bound: kept, within bounds, to see a close
            self._backlog += data
            return self._set_reading()
        self._consume(data)

    # -- reading ------------------------------------------------------------------------------------------
    def _consume(self, data: bytes) -> None:
        """Hand `data` on up to the end of the request being read; once it is whole, what follows
        waits in the backlog until it is answered (no byte of a pipelined request reaches the
        server before the answer to the one before it)."""
        while data:
            if (self._unanswered or self._write_paused) and self._phase is not BODY:
                self._backlog = data
                return self._set_reading()
            cut = self._body_left if self._phase is BODY and self._body_left else None
            if cut is None:
                end = data.find(HEAD_END)
                cut = len(data) if end < 0 else end + len(HEAD_END)
            piece, data = data[:cut], data[cut:]
            data = self._take(piece, bool(data)) + data
            if self.transport.is_closing():
                return
        self._set_reading()  # a request became whole: it reads on, within the backlog's bounds

    def _take(self, data: bytes, more: bool) -> bytes:
        """Bound the header bytes, then feed; returns what was not fed (after an upgrade).
        `more`: this read holds more bytes after `data`."""
        if self._phase is BODY:
            return self._feed(data, more)
        room = self.bounds.max_header_bytes - self._header_bytes
        if len(data) <= room:
            self._header_bytes += len(data)
            return self._feed(data, more)
        # Feed what fits: if the headers end in it, the rest is body or the next request.
        self._header_bytes += room
        rest = self._feed(data[:room], True)
        if self.transport.is_closing():
            return b""
        if rest:
            return rest + data[room:]
        if self._phase is not BODY and self._header_bytes >= self.bounds.max_header_bytes:
            self._refuse_headers(f"request headers over {self.bounds.max_header_bytes} bytes")
            return b""
        return data[room:]

    def _feed(self, data: bytes, more: bool) -> bytes:
        """Parse, hand the bytes on, then start the deadline for what is left half-read, unless
        `more` bytes of this read come next (a head and its body: the body's feed decides).
        Returns the bytes after an upgrade request, not yet fed."""
        completed = self._completed
        chunked = self._phase is BODY and self._body_left is None  # a body whose length its head did not give
        body_before = self._chunked_body
        rest = b""
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade as upgrade:
            # No protocol but HTTP/1.1 is spoken here: the server answers the request as such and
            # parses on as HTTP/1.1, as this parser does. Both get what follows as a new read.
            offset = upgrade.args[0]
            data, rest = data[:offset], data[offset:]
        except httptools.HttpParserError as exc:
            if self._header_lines > self.bounds.max_headers:
                self._refuse_headers(f"more than {self.bounds.max_headers} request header lines")
            else:
                self._answer_and_close(PoolError(ErrorCode.INVALID_REQUEST,
                                                 f"invalid HTTP request: {str(exc).rstrip('.')}"), "invalid_http")
            return b""
        if chunked and self._framing_over(len(data) - (self._chunked_body - body_before)):
            return b""  # refused before the server's parser saw any of it
        self.inner.data_received(data)
        if rest or more or self._timer is not None or self.transport.is_closing():
            return rest
        if self._phase is BODY:
            self._arm(self.bounds.body_timeout_s, self._body_timeout)
        elif self._phase is HEADERS or (self._completed == completed and self._phase is IDLE):
            self._arm(self.bounds.header_timeout_s, self._header_timeout)  # a partial request, or blank lines
        return b""

    def _framing_over(self, framing: int) -> bool:
        """Count `framing` bytes of a chunked body that are not body (chunk sizes, extensions, line
        ends, the trailer section) against max_header_bytes; past it, refuse. So trailers are
        bounded as a head is (each parser grows an unfinished header value by copying it), and so
        is the number of chunks (each costs a call in both parsers and at least 5 bytes)."""
        self._framing += framing
        if self._framing <= self.bounds.max_header_bytes:
            return False
        self._refuse_headers(f"request headers over {self.bounds.max_header_bytes} bytes "
                             "(a chunked body's framing and trailers count as headers)")
        return True

    def server_reading(self, wanted: bool) -> None:
        """The server's protocol pauses or resumes reading (its own flow control)."""
        self._server_reading = wanted
        self._set_reading()

    def _set_reading(self) -> None:
        """Read when the server wants to; while a whole request is being answered, always (a close
        is seen at once, and a request costs no pause and resume, each a system call), what comes
        then waiting in the backlog, within its bounds (about max_header_bytes, and
        max_pipelined_requests request heads)."""
        answering = self._unanswered and self._phase is not BODY
        want = (not self._discarding and (answering or self._server_reading)
                and (not self._backlog or (len(self._backlog) < self.bounds.max_header_bytes
                                           and self._backlog.count(HEAD_END) < self.bounds.max_pipelined_requests)))
        if want != self._reading and not self.transport.is_closing():
            self._reading = want
            self.transport.read(want)

    def _release(self) -> None:
        """The answer went out: hand on what waits, up to the end of its first request."""
        if self._backlog and not (self._unanswered or self._write_paused or self.transport.is_closing()):
            data, self._backlog = self._backlog, b""
            self._consume(data)
            self._set_reading()

    # -- our parser's callbacks ----------------------------------------------------------------------------
    def on_message_begin(self) -> None:
        self._phase = HEADERS
        self._header_lines = 0
        self._body_left = None

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_lines += 1
        if self._header_lines > self.bounds.max_headers:
            raise _TooManyHeaders  # stops the parser: feed_data raises HttpParserCallbackError
        if len(name) == 14 and name.lower() == b"content-length" and value.isdigit():
            self._body_left = int(value)

    def on_headers_complete(self) -> None:
        self._disarm()
        self._phase = BODY
        self._header_bytes = 0
        self._chunked_body = self._framing = 0
        self._unanswered += 1

    def on_body(self, body: bytes) -> None:
        if self._body_left is not None:
            self._body_left -= len(body)
        else:
            self._chunked_body += len(body)

    def on_message_complete(self) -> None:
        self._disarm()
        self._phase = IDLE
        self._completed += 1

    # -- the handler of a request (the guard) ---------------------------------------------------------------
    def begin_request(self) -> Disconnect:
        """A request's handler starts: the Disconnect that tells it when its client goes."""
        self.connections.active(self)
        self.request = Disconnect()
        return self.request

    def close_after_answer(self) -> None:
        """The guard answers this request without reading the body it declared: no byte more
        of this connection reaches a parser (of that body, or of a request after it); reading
        stops until the answer is out, then the connection lingers and closes (`linger`)."""
        self._discarding = True
        self._backlog = b""
        self._disarm()  # the body's deadline: what bounds the connection now is the close's
        self._set_reading()

    def linger(self) -> bool:
        """A close asked for a connection closing after a refusal (CoalescedWrites.close): the
        answer goes out with a FIN, what the client still sends is read and dropped, and the
        connection closes at the client's own end (eof_received) or is cut after LINGER_S.
        False: close at once (no refusal, or the transport cannot half-close)."""
        if not self._discarding or not self.transport.can_write_eof():
            return False
        if self._timer is None:  # not lingering already
            self._reading = True
            self.transport.read(True)  # the kernel's buffer is emptied: the close is then no reset
            self.transport.half_close()
            self._timer = asyncio.get_running_loop().call_later(LINGER_S, self.transport.abort)
        return True

    def end_request(self, request: Disconnect) -> None:
        self._unanswered = max(0, self._unanswered - 1)
        if self.request is request:
            self.request = None
        if self._discarding:
            return self.transport.close()  # lingers, unless the server closed it already
        if self.transport.is_closing():
            return
        self._set_reading()
        if self._backlog:  # from the loop, not from inside the handler's task
            asyncio.get_running_loop().call_soon(self._release)

    def idle(self) -> bool:
        """Nothing to answer and no body coming: between requests, a request's head unfinished,
        or closing after a refusal."""
        return self._discarding or (not self._unanswered and self._phase is not BODY and not self._backlog)

    # -- bounds -------------------------------------------------------------------------------------------
    def _refuse_headers(self, why: str) -> None:
        self._answer_and_close(PoolError(ErrorCode.HEADERS_TOO_LARGE, why), "headers")

    def _header_timeout(self) -> None:
        self._timer = None
        if self._unanswered:
            # A pipelined request waits while the one before it is answered.
            return self._arm(self.bounds.header_timeout_s, self._header_timeout)
        if self._phase is HEADERS:
            warnings.warning("header_timeout", "closed a connection from %s: headers not complete within %gs",
                             self.client, self.bounds.header_timeout_s)
        self.transport.abort()  # abort, not close: a client that does not read would keep it open

    def _body_timeout(self) -> None:
        self._timer = None
        warnings.warning("body_timeout", "closed a connection from %s: body not complete within %gs",
                         self.client, self.bounds.body_timeout_s)
        self.transport.abort()

    def _write_timeout(self) -> None:
        self._write_timer = None
        warnings.warning("write_timeout", "closed a connection from %s: its client read nothing for %gs "
                         "(server.write_timeout_s)", self.client, self.bounds.write_timeout_s)
        self.transport.abort()

    def _answer_and_close(self, err: PoolError, kind: str) -> None:
        """The error's answer, then close. It carries a fresh x-request-id (the request was never
        whole: it has no row of its own, nor the client's id), which the warning names where its
        throttle lets it log."""
        self._disarm()
        if self._unanswered:  # a request before this one is being answered: no room for a reply
            warnings.warning(kind, "refused a request from %s: %s (closed: no room for an answer)",
                             self.client, err.message)
            return self.transport.abort()
        rid = fresh_id().decode()
        warnings.warning(kind, "refused a request from %s: %s (x-request-id %s)", self.client, err.message, rid)
        body = json.dumps(err.envelope()).encode()
        head = (f"HTTP/1.1 {err.status} {_REASONS.get(err.status, '')}\r\n"
                f"content-type: application/json\r\ncontent-length: {len(body)}\r\n"
                f"x-request-id: {rid}\r\nconnection: close\r\n\r\n").encode()
        self.transport.write(head + body)
        self.transport.close()

    def _arm(self, delay: float, callback) -> None:
        self._disarm()
        self._timer = asyncio.get_running_loop().call_later(delay, callback)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


class _TooManyHeaders(Exception):
    pass


_REASONS = {400: "Bad Request", 431: "Request Header Fields Too Large"}


def bounded_protocol(server: ServerConfig, http: str = "httptools") -> type[BoundedConnection]:
    """The protocol factory for uvicorn.Config(http=...): uvicorn's protocol `http` (its
    --http choice), each connection bounded by these limits."""
    inner = import_from_string(HTTP_PROTOCOLS[http])
    return type("BoundedConnection", (BoundedConnection,),
                {"connections": Connections(server), "inner_class": inner})
