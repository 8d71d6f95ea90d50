"""The HTTP edge: what is refused before a request reaches a route.

- `BoundedConnection`: per-connection bounds around uvicorn's HTTP protocol,
  by composition (it is the asyncio protocol; uvicorn's protocol object gets
  the bytes through the asyncio.Protocol methods). llhttp does not bound
  header size (httptools joins a header value's pieces as it goes, so a huge
  one costs memory and quadratic time on the event loop), and uvicorn has no
  header or body read timeout and no connection cap; this layer adds them.
  It also tells a request's handler when its client goes away (`Disconnect`),
  without a task per request that waits for http.disconnect.
- `HttpEdge`: one ASGI middleware for every request: keys (for /v1/*, through
  `admission`), the browser rules for the admin surface (Host, Origin,
  Sec-Fetch-Site) against cross-site and DNS-rebinding requests, and the
  request body bounds, each request's and all together.
"""

from __future__ import annotations

import asyncio
import enum
import ipaddress
import json
import logging
import time
from asyncio import TimerHandle
from contextvars import ContextVar
from urllib.parse import urlsplit

import httptools
from fastapi.responses import JSONResponse
from uvicorn.config import HTTP_PROTOCOLS
from uvicorn.importer import import_from_string

from protocol.errors import ErrorCode, PoolError
from supervisor.admission import Admission, key_matches, presented_key
from supervisor.config import ServerConfig
from supervisor.tenants import UNKNOWN_KEY

log = logging.getLogger("llm_pool.http")

# The admin surface: operator actions, and the documents that describe them.
ADMIN_PATHS = frozenset({"/admin", "/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"})
NO_RETRY = frozenset({ErrorCode.INVALID_REQUEST, ErrorCode.LOAD_FAILED, ErrorCode.MODEL_NOT_LOADED,
                      ErrorCode.RUNTIME_TIMEOUT})  # the openai SDK retries 409 and 5xx unless told not to


def is_admin_path(path: str) -> bool:
    return path in ADMIN_PATHS or path.startswith("/admin/")


def error_response(err: PoolError) -> JSONResponse:
    headers = {}
    if err.retry_after_s is not None:
        headers["Retry-After"] = str(int(err.retry_after_s))
    if err.code in NO_RETRY:
        headers["x-should-retry"] = "false"
    return JSONResponse(err.envelope(), status_code=err.status, headers=headers)


class _Throttled:
    """A warning at most once per `every_s` per kind, with how many were not logged."""

    def __init__(self, every_s: float = 10.0) -> None:
        self.every_s = every_s
        self.last: dict[str, float] = {}
        self.skipped: dict[str, int] = {}

    def warn(self, kind: str, message: str, *args) -> None:
        now = time.monotonic()
        if now - self.last.get(kind, -self.every_s) < self.every_s:
            self.skipped[kind] = self.skipped.get(kind, 0) + 1
            return
        skipped = self.skipped.pop(kind, 0)
        self.last[kind] = now
        log.warning(message + (f" ({skipped} more since the last such line)" if skipped else ""), *args)


_warnings = _Throttled()


# -- connections ------------------------------------------------------------------------------------
class _Phase(enum.Enum):
    IDLE = "idle"  # between requests (or before the first): the next bytes start a request
    HEADERS = "headers"  # a request line has begun; its headers are not complete
    BODY = "body"  # headers complete, body not yet
    UNTRACKED = "untracked"  # after an Upgrade request: no longer HTTP/1.1 requests to bound


DISCONNECT_KEY = "llm_pool.disconnect"  # in the ASGI scope of each request read by a BoundedConnection
TENANT_KEY = "llm_pool.tenant"  # in the ASGI scope of each /v1/ request: admission.Tenant

# The connection whose bytes are being handed to the server's protocol. The request task that
# the server starts then inherits it (asyncio copies the context into a new task), so that
# HttpEdge finds the connection of the request it serves.
_connection: ContextVar[BoundedConnection | None] = ContextVar("llm_pool.connection", default=None)


class Disconnect:
    """Whether a request's client has gone, and what to do when it goes: set by
    the connection (`BoundedConnection.connection_lost`), read by the
    handler. A callback costs nothing until it fires, where a task that waits
    on receive() for http.disconnect costs a task per request."""

    __slots__ = ("gone", "callback", "_listen")

    def __init__(self, listen=None) -> None:
        self.gone = False
        self.callback = None
        self._listen = listen  # resumes reading the connection, as receive() does

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
        if self._listen is not None:
            # the server pauses reading past a large body or at a pipelined request: a close
            # is only seen while reading
            self._listen()


class _Shared:
    """What the connections of one server count together."""

    def __init__(self, bounds: ServerConfig) -> None:
        self.bounds = bounds
        self.open = 0


class CoalescedWrites(asyncio.Transport):
    """The connection's transport as the server's protocol sees it: what it writes in
    one turn of the event loop leaves in one write, after that turn. The server writes
    a response's head and body (or an event stream's head and first event) separately,
    each a system call; joined, they are one. Everything else passes straight to the
    real transport, a pending write going out first where order matters (close,
    write_eof); an abort drops it."""

    def __init__(self, transport: asyncio.Transport) -> None:
        super().__init__()
        self._transport = transport
        self._pending: list[bytes] = []
        self._loop = asyncio.get_running_loop()

    def write(self, data) -> None:
        if not data:
            return
        if not self._pending:
            self._loop.call_soon(self._flush)
        self._pending.append(bytes(data))

    def writelines(self, list_of_data) -> None:
        for data in list_of_data:
            self.write(data)

    def _flush(self) -> None:
        if self._pending:
            data = self._pending[0] if len(self._pending) == 1 else b"".join(self._pending)
            self._pending = []
            if not self._transport.is_closing():
                self._transport.write(data)

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def abort(self) -> None:
        self._pending = []
        self._transport.abort()

    def write_eof(self) -> None:
        self._flush()
        self._transport.write_eof()

    def can_write_eof(self) -> bool:
        return self._transport.can_write_eof()

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def get_extra_info(self, name, default=None):
        return self._transport.get_extra_info(name, default)

    def pause_reading(self) -> None:
        self._transport.pause_reading()

    def resume_reading(self) -> None:
        self._transport.resume_reading()

    def is_reading(self) -> bool:
        return self._transport.is_reading()

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + sum(map(len, self._pending))

    def get_write_buffer_limits(self):
        return self._transport.get_write_buffer_limits()

    def set_write_buffer_limits(self, high=None, low=None) -> None:
        self._transport.set_write_buffer_limits(high, low)

    def set_protocol(self, protocol) -> None:
        self._transport.set_protocol(protocol)

    def get_protocol(self):
        return self._transport.get_protocol()


class BoundedConnection(asyncio.Protocol):
    """One HTTP connection, bounded, around the ASGI server's own protocol object
    (`inner`), which it feeds through the asyncio.Protocol interface only:
    - at most `max_connections` open connections; more are closed at once;
    - a request's line and headers: at most `max_header_bytes` and `max_headers`
      lines (else 431 and close), complete within `header_timeout_s` of the read
      that began them or of the connection opening (else the connection is closed);
    - its body complete within `body_timeout_s` of the headers (else closed);
    - a request that HTTP cannot parse gets the error envelope (400) and a close.
    The bytes are read by a parser of its own (httptools, with no per-header
    callback but a count) before the server's protocol gets them: llhttp itself
    bounds no header size, and the server has no header or body timeout and no
    connection cap. A request read whole in one read costs no timer.
    Bytes are counted as they arrive; a read that holds the end of one request
    and the start of the next counts from the next read on (so a request's
    headers can exceed the cap by one read).
    It also tells a request's handler when its client goes away (`Disconnect`)."""

    shared: _Shared  # set by bounded_protocol()
    inner_class: type[asyncio.Protocol]

    def __init__(self, *args, **kwargs) -> None:
        # whatever the server passes to its protocol factory goes to its protocol, untouched
        self.inner = self.inner_class(*args, **kwargs)
        self.bounds = self.shared.bounds
        self.transport: asyncio.Transport | None = None
        self._refused = False
        self._parser = httptools.HttpRequestParser(self)
        try:  # as uvicorn's: a request after one that asked to close is left to the server
            self._parser.set_dangerous_leniencies(lenient_data_after_close=True)
        except AttributeError:  # httptools < 0.6.3
            pass
        self._phase = _Phase.IDLE
        self._header_bytes = 0
        self._header_lines = 0
        self._completed = 0  # requests read whole
        self._timer: TimerHandle | None = None
        self.request: Disconnect | None = None  # of the request whose handler runs (HttpEdge sets it)
        self._held = False  # reading paused here at a pipelined request

    # asyncio.Protocol
    def connection_made(self, transport) -> None:
        self.transport = transport = CoalescedWrites(transport)  # this side's writes too: one order
        if self.shared.open >= self.bounds.max_connections:
            self._refused = True
            _warnings.warn("connections", "refusing a connection: %d open (server.max_connections)",
                           self.shared.open)
            transport.abort()
            return
        self.shared.open += 1
        self.inner.connection_made(transport)
        self._arm(self.bounds.header_timeout_s, self._header_timeout)

    def connection_lost(self, exc) -> None:
        if self._refused:
            return
        self.shared.open -= 1
        self._disarm()
        self.inner.connection_lost(exc)
        if self.request is not None:  # a handler still runs: its client has gone
            self.request.fire()

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    def eof_received(self):
        return self.inner.eof_received()

    def data_received(self, data: bytes) -> None:
        if self._refused or self.transport.is_closing():
            return
        if self._phase is _Phase.BODY or self._phase is _Phase.UNTRACKED:
            return self._feed(data)
        room = self.bounds.max_header_bytes - self._header_bytes
        if len(data) <= room:
            self._header_bytes += len(data)
            return self._feed(data)
        # Feed what fits: if the headers end in it, the rest is body or the next request.
        self._header_bytes += room
        self._feed(data[:room])
        if self.transport.is_closing():
            return
        if self._phase is not _Phase.BODY and self._header_bytes >= self.bounds.max_header_bytes:
            return self._refuse_headers(f"request headers over {self.bounds.max_header_bytes} bytes")
        self.data_received(data[room:])

    def _feed(self, data: bytes) -> None:
        """Parse, hand the bytes on, then start the deadline for what is left half-read.
        A request that came whole in one read (the usual case) sets no timer."""
        completed = self._completed
        if self._phase is not _Phase.UNTRACKED:
            try:
                self._parser.feed_data(data)
            except httptools.HttpParserUpgrade:
                self._phase = _Phase.UNTRACKED  # the server decides what an upgrade becomes
            except httptools.HttpParserError as exc:
                if self._header_lines > self.bounds.max_headers:
                    return self._refuse_headers(f"more than {self.bounds.max_headers} request header lines")
                return self._answer_and_close(PoolError(ErrorCode.INVALID_REQUEST,
                                                        f"invalid HTTP request: {str(exc).rstrip('.')}"))
        token = _connection.set(self)
        try:
            self.inner.data_received(data)
        finally:
            _connection.reset(token)
        if self._timer is not None or self.transport.is_closing():
            return
        if self._phase is _Phase.BODY:
            self._arm(self.bounds.body_timeout_s, self._body_timeout)
        elif self._phase is _Phase.HEADERS or (self._completed == completed and self._phase is _Phase.IDLE):
            self._arm(self.bounds.header_timeout_s, self._header_timeout)  # a partial request, or blank lines

    # our parser's callbacks
    def on_message_begin(self) -> None:
        self._phase = _Phase.HEADERS
        self._header_lines = 0

    def on_header(self, name: bytes, value: bytes) -> None:  # noqa: ARG002 -- counted, not kept
        self._header_lines += 1
        if self._header_lines > self.bounds.max_headers:
            raise _TooManyHeaders  # stops the parser: feed_data raises HttpParserCallbackError

    def on_headers_complete(self) -> None:
        self._disarm()
        self._phase = _Phase.BODY
        self._header_bytes = 0
        if self.request is not None and not self._held:
            # A pipelined request while one is answered: read no further until that one ends
            # (a handler waiting on its Disconnect resumed reading; more would pile up unbounded).
            self._held = True
            self.transport.pause_reading()

    def on_message_complete(self) -> None:
        self._disarm()
        self._phase = _Phase.IDLE
        self._completed += 1

    # the handler of a request (HttpEdge)
    def begin_request(self) -> Disconnect:
        """A request's handler starts: the Disconnect that tells it when its client goes."""
        self.request = Disconnect(self.transport.resume_reading)
        return self.request

    def end_request(self) -> None:
        self.request = None
        if self._held:
            self._held = False
            if not self.transport.is_closing():
                self.transport.resume_reading()

    # bounds
    def _refuse_headers(self, why: str) -> None:
        _warnings.warn("headers", "refused a request from %s: %s", self._peer(), why)
        self._answer_and_close(PoolError(ErrorCode.HEADERS_TOO_LARGE, why))

    def _header_timeout(self) -> None:
        self._timer = None
        if self.request is not None:
            # A pipelined request waits while the one before it is answered (reading is paused).
            return self._arm(self.bounds.header_timeout_s, self._header_timeout)
        if self._phase is _Phase.HEADERS:
            _warnings.warn("header_timeout", "closed a connection from %s: headers not complete within %gs",
                           self._peer(), self.bounds.header_timeout_s)
        self.transport.abort()  # abort, not close: a client that does not read would keep it open

    def _body_timeout(self) -> None:
        self._timer = None
        if self._held:  # a pipelined request's body is not read while the one before it is answered
            return self._arm(self.bounds.body_timeout_s, self._body_timeout)
        _warnings.warn("body_timeout", "closed a connection from %s: body not complete within %gs",
                       self._peer(), self.bounds.body_timeout_s)
        self.transport.abort()

    def _answer_and_close(self, err: PoolError) -> None:
        self._disarm()
        if self.request is not None:  # a request before this one is being answered: no room for a reply
            return self.transport.abort()
        body = json.dumps(err.envelope()).encode()
        head = (f"HTTP/1.1 {err.status} {_REASONS.get(err.status, '')}\r\n"
                f"content-type: application/json\r\ncontent-length: {len(body)}\r\n"
                "connection: close\r\n\r\n").encode()
        self.transport.write(head + body)
        self.transport.close()

    def _arm(self, delay: float, callback) -> None:
        self._disarm()
        self._timer = asyncio.get_running_loop().call_later(delay, callback)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _peer(self) -> str:
        peer = self.transport.get_extra_info("peername") if self.transport is not None else None
        return "%s:%s" % tuple(peer[:2]) if isinstance(peer, tuple) else "?"


class _TooManyHeaders(Exception):
    pass


_REASONS = {400: "Bad Request", 431: "Request Header Fields Too Large"}


def bounded_protocol(server: ServerConfig, http: str = "httptools") -> type[BoundedConnection]:
    """The protocol factory for uvicorn.Config(http=...): uvicorn's protocol `http` (its
    --http choice), each connection bounded by these limits."""
    inner = import_from_string(HTTP_PROTOCOLS[http])
    return type("BoundedConnection", (BoundedConnection,), {"shared": _Shared(server), "inner_class": inner})


# -- requests -----------------------------------------------------------------------------------------
class HttpEdge:
    """Every request's first layer: who may call what, checked before anything
    reads the request, then the body bounds. One pure ASGI layer (each layer
    costs on every request).

    Keys: /v1/* goes through `Admission.tenant` (the inference key or the admin
    key when an inference key is set); the tenant goes in `scope[TENANT_KEY]`. The admin surface (/admin/*, /docs, /redoc, /openapi.json) needs the
    admin key when any key is set; with only an inference key it is refused.

    Browser rules for the admin surface, keys or not (a web page must not drive
    it, whether cross-site or by DNS rebinding): the Host must be localhost,
    the configured host or an IP address (each with the pool's port), or one
    of `allowed_hosts`; an Origin must be that same host and port;
    Sec-Fetch-Site, when sent, must be same-origin or none.

    Body: over `max_body_bytes` is refused with 413, at once when the
    Content-Length says so, else while reading. The bodies being read are held
    here, all of them together at most `max_buffered_body_bytes`; a request
    that would go over is refused with 429 and Retry-After. The request goes
    on to `app` with its body in one message.

    The connection (BoundedConnection) tells the request's handler when its
    client goes: `scope[DISCONNECT_KEY]`.

    Inference POSTs go straight to their endpoint in `inference`, every other
    request to `app`."""

    def __init__(self, app, server: ServerConfig, admission: Admission, api_key: str | None,
                 admin_key: str | None, inference: dict | None = None, on_key_refused=None) -> None:
        self.app = app
        self.inference = inference or {}  # path -> the ASGI endpoint of its POST
        # on_key_refused(path, error, tenant): a /v1/ request refused for its key (401); tenant is
        # UNKNOWN_KEY when a key was given that no tenant holds, None when none was given
        self.on_key_refused = on_key_refused
        self.limit = server.max_body_bytes
        self.budget = server.max_buffered_body_bytes
        self.buffered = 0  # bytes of the bodies being read now
        self.admission = admission
        self.admin = [admin_key.encode()] if admin_key else []
        self.admin_refused = bool(api_key) and not admin_key
        self.allowed_hosts = frozenset(h.lower() for h in server.allowed_hosts)
        host = server.host.lower()
        wildcard = host in ("0.0.0.0", "::", "")
        self.local_names = {"localhost"} | (set() if wildcard else {f"[{host}]" if ":" in host else host})

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        refusal = self._refusal(scope)
        if refusal is not None:
            return await error_response(refusal)(scope, receive, send)
        tenant = scope.get(TENANT_KEY)
        if tenant is not None:  # every answer to a tenant says where it stands with its limits
            send = self.admission.with_limit_headers(tenant, send)
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit() and int(value) > self.limit:
                return await self._too_large()(scope, receive, send)
        body = await self._read_body(receive)
        if isinstance(body, PoolError):
            return await error_response(body)(scope, receive, send)
        if body is None:  # the client left while sending
            return
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: disconnect notices pass through

        app = (self.inference.get(scope["path"]) if scope["method"] == "POST" else None) or self.app
        connection = _connection.get()
        if connection is None:  # another server than BoundedConnection's: no disconnect notice
            return await app(scope, replay, send)
        scope[DISCONNECT_KEY] = connection.begin_request()
        try:
            return await app(scope, replay, send)
        finally:
            connection.end_request()

    async def _read_body(self, receive) -> bytes | PoolError | None:
        """The whole body; a PoolError when it is over a bound; None when the client left."""
        message = await receive()
        if message["type"] != "http.request":
            return None
        chunk = message.get("body", b"")
        if not message.get("more_body"):  # the usual case: the body came whole
            return self._too_large_error() if len(chunk) > self.limit else chunk
        chunks, size = [], 0
        try:
            while True:
                if size + len(chunk) > self.limit:
                    return self._too_large_error()
                if self.buffered + len(chunk) > self.budget:
                    _warnings.warn("buffered", "refused a request: %d bytes of bodies being read "
                                   "(server.max_buffered_body_bytes)", self.buffered)
                    return PoolError(ErrorCode.QUEUE_FULL, "the pool is reading too many request bodies at once; "
                                     "retry shortly", retry_after_s=1)
                chunks.append(chunk)
                size += len(chunk)
                self.buffered += len(chunk)
                if not message.get("more_body"):
                    return b"".join(chunks)
                message = await receive()
                if message["type"] != "http.request":
                    return None
                chunk = message.get("body", b"")
        finally:
            self.buffered -= size

    def _too_large(self) -> JSONResponse:
        return error_response(self._too_large_error())

    def _too_large_error(self) -> PoolError:
        return PoolError(ErrorCode.REQUEST_TOO_LARGE, f"request body over {self.limit} bytes")

    def _refusal(self, scope) -> PoolError | None:
        path = scope["path"]
        if path.startswith("/v1/"):
            try:
                scope[TENANT_KEY] = self.admission.tenant(scope["headers"])
            except PoolError as refusal:
                if self.on_key_refused is not None:  # a row in the request log: the key's owner, never the key
                    given = presented_key(scope["headers"])
                    self.on_key_refused(path, refusal, UNKNOWN_KEY if given else None)
                return refusal
            return None
        if not is_admin_path(path):
            return None
        why = self._browser_refusal(scope)
        if why:
            return PoolError(ErrorCode.FORBIDDEN, why)
        if self.admin_refused:
            return PoolError(ErrorCode.UNAUTHORIZED, "the admin endpoints are closed: only api_key is set; "
                                                     "set server.admin_key (or LLM_POOL_ADMIN_KEY) to use them")
        if self.admin and not key_matches(presented_key(scope["headers"]), self.admin):
            return PoolError(ErrorCode.UNAUTHORIZED, "missing or wrong admin key")
        return None

    def _browser_refusal(self, scope) -> str | None:
        host = origin = site = None
        for name, value in scope["headers"]:
            if name == b"host":
                host = value.decode("latin-1").lower()
            elif name == b"origin":
                origin = value.decode("latin-1").lower()
            elif name == b"sec-fetch-site":
                site = value.lower()
        if host is not None and not self._host_allowed(host, scope.get("server")):
            return (f"Host {host[:100]!r} is not a name this pool answers to on its admin endpoints "
                    "(add it to server.allowed_hosts)")
        if site is not None and site not in (b"same-origin", b"none"):
            return "cross-site requests to the admin endpoints are refused"
        if origin is not None and (host is None or not _same_origin(origin, host)):
            return f"cross-origin requests to the admin endpoints are refused (Origin {origin[:100]!r})"
        return None

    def _host_allowed(self, host: str, server) -> bool:
        if "*" in self.allowed_hosts or host in self.allowed_hosts:
            return True
        name, port = _split_host(host)
        if name is None:
            return False
        if name in self.allowed_hosts:  # an entry without a port allows any port
            return True
        if server is None or (port or 80) != server[1]:
            return False
        return name in self.local_names or _is_ip_literal(name)  # a page at an IP has no name to rebind


def _is_ip_literal(name: str) -> bool:
    try:
        ipaddress.ip_address(name[1:-1] if name.startswith("[") else name)
    except ValueError:
        return False
    return True


def _split_host(host: str) -> tuple[str | None, int | None]:
    """'name', 'name:port', '[v6]' or '[v6]:port' -> (name, port or None); (None, None) if malformed."""
    if host.startswith("["):
        end = host.find("]")
        name, rest = host[:end + 1], host[end + 1:]
        if end < 0 or (rest and not rest.startswith(":")):
            return None, None
        port = rest[1:] if rest else None
    else:
        name, colon, port = host.partition(":")
        port = port if colon else None
    if not name or (port is not None and not (port.isdigit() and len(port) <= 5)):
        return None, None
    return name, int(port) if port is not None else None


def _same_origin(origin: str, host: str) -> bool:
    """Whether an Origin ('scheme://name[:port]') names the host and port of the Host header.
    A Host without a port (behind a proxy) takes the Origin scheme's default."""
    try:
        parts = urlsplit(origin)
        origin_port = parts.port
    except ValueError:
        return False
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path or parts.query:
        return False
    default = 443 if parts.scheme == "https" else 80
    name, port = _split_host(host)
    origin_name = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return name == origin_name and (port or default) == (origin_port or default)
