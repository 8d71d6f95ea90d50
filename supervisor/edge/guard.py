"""The second room: who may call what, and how much of a body is read, before
a route runs. One pure ASGI layer (`HttpEdge`; each layer costs on every request):
keys (for /v1/*, Ollama's /api/* and the runtime's calls such as /tokenize, through
`admission`), the browser rules for the admin surface (Host, Origin, Sec-Fetch-Site)
against cross-site and DNS-rebinding requests, unknown paths and refusals answered
before their body is read (their connection then closes), and the request body bounds,
each request's and all together. The bytes came through supervisor/edge/listener.py.
"""

from __future__ import annotations

import ipaddress
import logging
from urllib.parse import urlsplit

from fastapi.responses import JSONResponse
from starlette.routing import Match, Mount

from protocol.errors import ErrorCode, PoolError
from supervisor.admission.admit import Admission, key_matches, presented_key
from supervisor.shapes.anthropic import error_envelope
from supervisor.config import ServerConfig
from supervisor.edge.listener import DISCONNECT_KEY, connection_of, warnings
from supervisor.edge.request_ids import REQUEST_ID, SKIPPED_TOOLS, SendWithId, request_id
from supervisor.request_bounds import echo
from supervisor.admission.tenants import UNKNOWN_KEY

# an unknown path: the app's own 404, given before the body is read
NOT_FOUND = {"error": {"message": "Not Found", "type": "not_found_error", "param": None, "code": None}}
BODY_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})  # the methods whose routes may take a body
ANTHROPIC_PATHS = ("/v1/messages",)  # the Messages surface answers in Anthropic's envelope
OLLAMA_PREFIX = "/api/"  # Ollama's API: keyed as /v1/ is, its errors {"error": message}
TENANT_KEY = "llm_pool.tenant"  # in the ASGI scope of each keyed request: admission.Tenant


def tenant_name(scope) -> str | None:
    """The name of the tenant whose key a request carried (None before its key was known):
    the request log names who sent a request the pool refused, a bad body too."""
    tenant = scope.get(TENANT_KEY)
    return tenant.name if tenant is not None else None

# The admin surface: operator actions, and the documents that describe them.
ADMIN_PATHS = frozenset({"/admin", "/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"})
NO_RETRY = frozenset({ErrorCode.INVALID_REQUEST, ErrorCode.CONTEXT_LENGTH_EXCEEDED, ErrorCode.LOAD_FAILED, ErrorCode.MODEL_NOT_LOADED,
                      ErrorCode.RUNTIME_TIMEOUT})  # the openai SDK retries 409 and 5xx unless told not to


def is_admin_path(path: str) -> bool:
    return path in ADMIN_PATHS or path.startswith("/admin/")


def anthropic_error_response(err: PoolError) -> JSONResponse:
    """Anthropic's envelope (its request-id header is the edge's: request_ids.py)."""
    status, body = error_envelope(err)
    headers = {}
    if err.retry_after_s is not None:
        headers["retry-after"] = str(int(err.retry_after_s))
    return JSONResponse(body, status_code=status, headers=headers)


def error_response(err: PoolError, path: str = "") -> JSONResponse:
    """The error in its API family's envelope: Anthropic's on /v1/messages, Ollama's under /api/,
    else OpenAI's."""
    if path.startswith(ANTHROPIC_PATHS):
        return anthropic_error_response(err)
    if path.startswith(OLLAMA_PREFIX):
        return JSONResponse({"error": err.message}, status_code=err.status,
                            headers={"retry-after": str(int(err.retry_after_s))} if err.retry_after_s is not None else {})
    headers = {}
    if err.retry_after_s is not None:
        headers["Retry-After"] = str(int(err.retry_after_s))
    if err.code in NO_RETRY:
        headers["x-should-retry"] = "false"
    return JSONResponse(err.envelope(), status_code=err.status, headers=headers)


def scan_headers(headers, limit: int) -> tuple[bool, bool, bool]:
    """One pass over a request's headers: (a WebSocket upgrade, a body declared, a Content-Length
    over `limit`)."""
    upgrade = connection = b""
    declared = too_large = False
    for name, value in headers:
        if name == b"upgrade":
            upgrade = value.lower()
        elif name == b"connection":
            connection = value.lower()
        elif name == b"content-length":
            declared = declared or value.strip() not in (b"0", b"")
            too_large = too_large or (value.isdigit() and int(value) > limit)
        elif name == b"transfer-encoding":
            declared = True
    return b"websocket" in upgrade and b"upgrade" in connection, declared, too_large


def closing(send):
    """`send` with `connection: close` on the answer's head: the client is told the connection
    ends with this answer (the listener closes it: BoundedConnection.close_after_answer)."""
    def send_closing(message):
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", ()), (b"connection", b"close")]}
        return send(message)
    return send_closing


def websocket_refusal(scope) -> PoolError:
    """426 for a WebSocket upgrade (any path: the pool serves none as WebSocket), so that a
    client that tries one first (Codex, on /v1/responses) falls back to HTTP at once rather
    than retrying the handshake. uvicorn (ws="none") hands such a request on as plain HTTP."""
    return PoolError(ErrorCode.UPGRADE_REQUIRED, f"{echo(scope['path'])} is not served over WebSocket here: "
                     "send the request over HTTP")


def internal_error(exc: Exception) -> PoolError:
    """The contract's 500 for an exception in a handler (the app's own handler answers with it
    too, for its routes: api.py)."""
    return PoolError(ErrorCode.INTERNAL_ERROR, f"the pool failed to answer: an internal error "
                     f"({type(exc).__name__}; the supervisor's log has it, x-request-id {REQUEST_ID.get()})")


class HttpEdge:
    """Every request's first layer: who may call what, checked before anything
    reads the request, then the body bounds. One pure ASGI layer (each layer
    costs on every request).

    Keys: /v1/* and /api/* go through `Admission.tenant` (the inference key or the admin
    key when an inference key is set); the tenant goes in `scope[TENANT_KEY]`.
    The admin surface (/admin/*, /docs, /redoc, /openapi.json) needs the admin
    key when any key is set; with inference keys (api_key or [[tenants]]) and no
    admin key it is closed to every key.

    Route: a path no route of the app takes is answered 404 before its body is
    read. A body is read only for a route that takes one (an inference POST, a
    POST/PUT/PATCH/DELETE route of the app), after the key is checked; any other
    request runs without its body, and a body it declared closes the connection
    after the answer. Errors on /v1/messages take Anthropic's envelope, the rest OpenAI's.

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

    The connection (BoundedConnection) comes in the request's scope (listener.connection_of)
    and tells the request's handler when its client goes: `scope[DISCONNECT_KEY]`.

    A handler that raises (a fault of the pool's own) gets the contract's 500
    (`internal_error`) in the path's envelope, a request-log row, and its traceback in the
    log at most once per 10 s for each place it was raised.

    Inference POSTs go straight to their endpoint in `inference`, every other
    request to `app`. Every answer from here on carries the request's id
    (request_ids.py; the listener's own refusals, before a request is whole, do not)."""

    def __init__(self, app, server: ServerConfig, admission: Admission, admin_key: str | None,
                 inference: dict | None = None, on_key_refused=None, on_failure=None) -> None:
        self.app = app
        self.inference = inference or {}  # path -> the ASGI endpoint of its POST
        # on_key_refused(path, error, tenant): a /v1/ request refused for its key (401); tenant is
        # UNKNOWN_KEY when a key was given that no tenant holds, None when none was given
        self.on_key_refused = on_key_refused
        self.on_failure = on_failure  # on_failure(path, error, tenant): a handler raised (a row, 500)
        # set where the server is BoundedConnection's (server.run): every request must come with its
        # connection, whose count of unanswered requests only this layer brings down
        self.connection_required = False
        self.limit = server.max_body_bytes
        self.budget = server.max_buffered_body_bytes
        self.buffered = 0  # bytes of the bodies being read now
        self.admission = admission
        self.admin = [admin_key.encode()] if admin_key else []
        self._static: dict[str, set[str] | None] | None = None  # the app's paths -> methods (None: any), at first
        self._dynamic: list = []
        self.allowed_hosts = frozenset(h.lower() for h in server.allowed_hosts)
        host = server.host.lower()
        wildcard = host in ("0.0.0.0", "::", "")
        self.local_names = {"localhost"} | (set() if wildcard else {f"[{host}]" if ":" in host else host})

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        # every answer carries the request's id (request_ids.py), and its request-log row too
        rid = request_id(scope["headers"])
        token = REQUEST_ID.set(rid.decode("ascii"))
        skipped = SKIPPED_TOOLS.set(None)
        send = SendWithId(send, rid, scope["path"].startswith(ANTHROPIC_PATHS))
        connection = connection_of(scope)
        request = None
        if connection is not None:  # else another server than BoundedConnection's: no disconnect notice
            scope[DISCONNECT_KEY] = request = connection.begin_request()
        try:
            if connection is None and self.connection_required:
                raise RuntimeError("a request came without its connection (scope['state'][CONNECTION_KEY])")
            return await self._serve(scope, receive, send)
        except Exception as exc:  # a fault of the pool's own: the contract's 500, a row, a throttled log
            await self._failed(scope, receive, send, exc)
        finally:
            if request is not None:
                connection.end_request(request)
            REQUEST_ID.reset(token)
            SKIPPED_TOOLS.reset(skipped)

    async def _failed(self, scope, receive, send, exc: Exception) -> None:
        """A handler raised: logged (with its traceback) at most once per 10 s for each kind,
        one request-log row, and, unless an answer had begun, the 500 in the path's envelope."""
        where = exc.__traceback__
        while where.tb_next is not None:
            where = where.tb_next
        kind = f"{type(exc).__name__} at {where.tb_frame.f_code.co_filename}:{where.tb_lineno}"
        rid = REQUEST_ID.get()
        warnings.warning(f"handler {kind}", "a request's handler failed (%s %s, x-request-id %s): %s",
                         scope["method"], scope["path"][:200], rid, kind, level=logging.ERROR, exc_info=exc)
        err = internal_error(exc)
        if self.on_failure is not None:
            self.on_failure(scope["path"], err, tenant_name(scope))
        if not send.started:
            await error_response(err, scope["path"])(scope, receive, send)

    async def _serve(self, scope, receive, send):
        """Key and browser rules, the route, then the body; every refusal before the body is read.
        An answer given without reading the whole body the request declared closes its connection."""
        websocket, declared, too_large = scan_headers(scope["headers"], self.limit)
        refusal = self._refusal(scope) or (websocket_refusal(scope) if websocket else None)
        if refusal is not None:
            return await self._unread(scope, receive, send, declared, error_response(refusal, scope["path"]))
        tenant = scope.get(TENANT_KEY)
        if tenant is not None:  # every answer to a tenant says where it stands with its limits
            send = self.admission.with_limit_headers(tenant, send)
        app = (self.inference.get(scope["path"]) if scope["method"] == "POST" else None)
        if app is None:
            takes_body = self._takes_body(scope)
            if takes_body is None:  # its body is not worth reading
                return await self._unread(scope, receive, send, declared, JSONResponse(NOT_FOUND, status_code=404))
            app = self.app
            if not takes_body:
                return await self._unread(scope, self._no_body(receive), send, declared, self.app)
        if too_large:
            return await self._unread(scope, receive, send, declared,
                                      error_response(self._too_large_error(), scope["path"]))
        body = await self._read_body(receive)
        if isinstance(body, PoolError):  # refused part way: the rest is not read
            return await self._unread(scope, receive, send, True, error_response(body, scope["path"]))
        if body is None:  # the client left while sending
            return
        held = [body]  # handed over once, and then held by whoever took it, not here (a queued
        del body       # request's prompt is held in as few copies as can be)

        async def replay():
            if held:
                return {"type": "http.request", "body": held.pop(), "more_body": False}
            return await receive()  # after the body: disconnect notices pass through

        return await app(scope, replay, send)

    def _takes_body(self, scope) -> bool | None:
        """None when no route of the app takes this path (any method: a wrong one is the app's
        405); else whether the route of this path and method takes a body (POST, PUT, PATCH or
        DELETE, on a route with that method). A path with a trailing slash counts as without
        (the app redirects it, taking no body)."""
        if self._static is None:
            self._static = {}
            self._dynamic = []
            for route in self.app.routes:
                path, methods = getattr(route, "path", None), getattr(route, "methods", None)
                if path is not None and "{" not in path and not isinstance(route, Mount):
                    known = self._static.get(path, set())
                    self._static[path] = None if known is None or methods is None else known | methods
                else:
                    self._dynamic.append(route)
        path, method = scope["path"], scope["method"]
        if path in self._static:
            methods = self._static[path]
            return method in BODY_METHODS and (methods is None or method in methods)
        if path.endswith("/") and path[:-1] in self._static:
            return False
        found = None
        for route in self._dynamic:
            match = route.matches(scope)[0]
            if match is Match.FULL:
                return method in BODY_METHODS and not isinstance(route, Mount)
            if match is Match.PARTIAL:
                found = False
        return found

    @staticmethod
    async def _unread(scope, receive, send, declared: bool, app):
        """Answer with `app` without reading the request's body. A body it declared anyway is
        never read: the connection reads nothing more and closes once the answer is out, so that
        neither parser goes on through bytes nobody wants (docs/edge-rules.md, rule 2)."""
        if declared:
            connection = connection_of(scope)
            if connection is not None:
                connection.close_after_answer()
            send = closing(send)
        return await app(scope, receive, send)

    @staticmethod
    def _no_body(receive):
        """The receive of a route that takes no body: an empty body, then disconnect notices."""
        given = False

        async def no_body():
            nonlocal given
            if not given:
                given = True
                return {"type": "http.request", "body": b"", "more_body": False}
            return await receive()
        return no_body

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
                    warnings.warning("buffered", "refused a request: %d bytes of bodies being read "
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

    def _too_large_error(self) -> PoolError:
        return PoolError(ErrorCode.REQUEST_TOO_LARGE, f"request body over {self.limit} bytes")

    def _refusal(self, scope) -> PoolError | None:
        path = scope["path"]
        if path.startswith(("/v1/", OLLAMA_PREFIX)) or path in self.inference:  # /tokenize and the runtime's calls too
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
        if not self.admin and not self.admission.tenants.open:
            # inference keys (api_key or [[tenants]]) and no admin key: none of them opens /admin
            return PoolError(ErrorCode.UNAUTHORIZED, "the admin endpoints are closed: inference keys are set "
                                                     "and server.admin_key is not (or LLM_POOL_ADMIN_KEY); "
                                                     "set it to use them")
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
