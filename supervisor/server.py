"""Run the app under uvicorn with a draining shutdown."""

from __future__ import annotations

import asyncio
import gc
import logging
import resource
import signal

import uvicorn

from protocol.errors import PoolError
from supervisor.api import create_app
from supervisor.config import PoolConfig
from supervisor.edge.listener import bounded_protocol
from supervisor.log_throttle import CLIENT_WARNING_EVERY_S, ThrottledMessages
from supervisor.state_dir import claim_state_dir

log = logging.getLogger("llm_pool.server")

GC_YOUNG_THRESHOLD = 7000  # allocations (net) between two young collections (Python: 700); see run()

# What uvicorn logs for every Upgrade request (the guard answers those: 426, or plain HTTP/1.1),
# two lines each, which any client could make at will
UVICORN_UPGRADE_WARNINGS = ("Unsupported upgrade request", "No supported WebSocket library detected")


class DrainingServer(uvicorn.Server):
    """First SIGTERM/SIGINT: drain (/ready 503, new work refused, submitted
    jobs get `grace_s` to finish), stop the workers (each within its stop
    timeout), then stop uvicorn. A second signal ends the drain at once: the
    workers are stopped right away. Any later one is uvicorn's own: it starts
    uvicorn's stop, and only a repeated SIGINT force-quits (a SIGTERM does not)."""

    def __init__(self, config: uvicorn.Config, engine, grace_s: float) -> None:
        super().__init__(config)
        self.engine = engine
        self.grace_s = grace_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._signals = 0
        self._drainer: asyncio.Task | None = None

    async def serve(self, sockets=None):
        self._loop = asyncio.get_running_loop()
        self._loop.add_signal_handler(signal.SIGHUP, self._reload)
        await super().serve(sockets)

    def _reload(self) -> None:
        """SIGHUP: re-read the config, as POST /admin/reload does."""
        async def reload() -> None:
            try:
                log.info("SIGHUP: %s", await self.engine.reload())
            except PoolError as exc:
                log.error("SIGHUP: reload refused: %s", exc.message)
        self.engine.spawn(reload(), "sighup-reload")  # held until it ends; anything unexpected is logged

    def handle_exit(self, sig, frame) -> None:
        self._signals += 1
        if self._loop is None or self._signals > 2:
            return super().handle_exit(sig, frame)
        if self._signals == 1:
            self._loop.call_soon_threadsafe(self._start_drain, sig)
        else:
            log.warning("second signal: stopping now")
            self._loop.call_soon_threadsafe(self.engine.stop_draining)

    def _start_drain(self, sig) -> None:
        self._drainer = asyncio.ensure_future(self._drain_then_exit(sig))

    async def _drain_then_exit(self, sig) -> None:
        try:
            log.info("draining for up to %.0fs before exit", self.grace_s)
            await self.engine.drain_all(self.grace_s, by=signal.Signals(sig).name if sig else None)
            # the workers go before uvicorn stops: what still runs ends with an error and its
            # connection closes, so uvicorn has no connection left to wait for
            await self.engine.shutdown(self.grace_s)
        except Exception:
            log.exception("graceful stop failed")
        finally:
            super().handle_exit(sig, None)


def _room_for_connections(connections: int) -> None:
    """Raise the open-file soft limit so that max_connections fit (each is a file),
    with room for the workers' sockets and logs."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = connections + 256
    if soft == resource.RLIM_INFINITY or soft >= need:
        return
    new = need if hard == resource.RLIM_INFINITY else min(need, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
    if new < need:
        log.warning("open-file limit %d leaves room for about %d of server.max_connections = %d",
                    new, new - 256, connections)


def run(cfg: PoolConfig, log_level: str = "info") -> None:
    """Serve `cfg` until stopped. StateDirRefused, before anything starts, when its state
    directory is not this user's alone or another pool holds it."""
    state_dir = claim_state_dir(cfg.server.state_dir)  # held while this process lives
    app = create_app(cfg)
    app.connection_required = True  # served by bounded_protocol's connections: each comes in its scope
    # What exists now (modules, the app, its models) lives as long as the process: out of the
    # collector's sight, a full collection walks only what requests make, not the whole heap
    # (a pause of milliseconds between two tokens otherwise)
    gc.freeze()
    # A request leaves no reference cycle (tests/test_no_cycles.py): what it makes is freed by
    # reference counts, and the cycle collector finds little but closed connections. Run at its
    # default (every 700 allocations net), it walked the requests in flight again and again: 6.8 µs
    # of a request at c = 16; every 7,000, 2.4 µs, a young collection taking 0.1-0.3 ms.
    gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])
    _room_for_connections(cfg.server.max_connections)
    server = DrainingServer(uvicorn.Config(
        app, host=cfg.server.host, port=cfg.server.port, log_level=log_level, loop="uvloop",
        http=bounded_protocol(cfg.server), ws="none",  # no WebSocket routes: no upgrade path to guard
        # nothing reads a request's client address or scheme (the connection caps take the peer's):
        # no X-Forwarded-* layer, which costs a coroutine and a pass over the headers per request
        proxy_headers=False,
        access_log=False, timeout_graceful_shutdown=5),
        app.app.state.engine, cfg.server.shutdown_grace_s)
    # after uvicorn.Config, which sets up its loggers
    logging.getLogger("uvicorn.error").addFilter(ThrottledMessages(UVICORN_UPGRADE_WARNINGS, CLIENT_WARNING_EVERY_S))
    try:
        server.run()
    finally:
        state_dir.release()
