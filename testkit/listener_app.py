"""uvicorn in a thread of the test's process, with the pool's own listener (bounded_protocol) in
front of an ASGI app the test writes: the listener's rules tested without a whole pool. The app
keeps the listener's contract with the guard (begin_request / end_request) through `served`."""

from __future__ import annotations

import threading

import uvicorn

from supervisor.config import ServerConfig
from supervisor.edge.listener import bounded_protocol, connection_of
from testkit.pool import free_port
from testkit.waits import wait_for


class ListenerApp:
    """Subclass and write `handle(scope, receive, send, connection)`; use as a context manager."""

    def __init__(self, bounds: ServerConfig | None = None, **uvicorn_settings) -> None:
        self.port = free_port()
        config = uvicorn.Config(self.app, host="127.0.0.1", port=self.port, lifespan="off", log_level="warning",
                                interface="asgi3", http=bounded_protocol(bounds or ServerConfig()),
                                ws="none", **uvicorn_settings)  # ws as the pool runs it (server.run)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    async def app(self, scope, receive, send):
        connection = connection_of(scope)
        request = connection.begin_request()
        try:
            await self.handle(scope, receive, send, connection)
        finally:
            connection.end_request(request)

    async def handle(self, scope, receive, send, connection) -> None:
        raise NotImplementedError

    def __enter__(self):
        self.thread.start()
        wait_for(lambda: self.server.started, 10, what="uvicorn started")
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(10)
