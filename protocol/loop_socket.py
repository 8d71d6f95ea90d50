"""A ZeroMQ socket served by the asyncio loop without a future per message.

pyzmq's asyncio socket costs a future, a callback and a poller update for each
message; on the token path that was a third of the worker's CPU. Here the
socket's FD is watched with `loop.add_reader`, and every readiness callback
takes all waiting messages at once and hands each to `on_message`.

The ZMQ_FD is edge-triggered and any socket operation can consume its edge.
Reading until EAGAIN drains the socket's command mailbox, which re-arms the
FD (no EVENTS check per message received: that syscall was a sixth of the
supervisor's CPU on the token path). A send may consume an edge too, so
EVENTS is read after each send (senders batch their messages, so that is
rare) and a waiting input is taken on the next loop turn.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import zmq

log = logging.getLogger("llm_pool.loop_socket")
BATCH = 256  # messages per loop turn, so that a flood cannot starve other tasks
POLLIN, POLLOUT = int(zmq.POLLIN), int(zmq.POLLOUT)  # plain ints: no enum object per check


class LoopSocket:
    def __init__(self, sock: zmq.Socket, on_message: Callable[[list[bytes]], None]) -> None:
        self.sock = sock
        self.on_message = on_message
        self.loop = asyncio.get_running_loop()
        self._fd = sock.getsockopt(zmq.FD)
        self._writable: asyncio.Future | None = None
        self._scheduled = False
        self._closed = False
        self.loop.add_reader(self._fd, self._service)
        self._reschedule()  # something may be queued already

    def _reschedule(self) -> None:
        if not self._scheduled and not self._closed:
            self._scheduled = True
            self.loop.call_soon(self._service)

    def _service(self) -> None:
        self._scheduled = False
        for _ in range(BATCH):
            if self._closed:
                return
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:  # drained: the FD is armed again
                return self._check_writable()
            except zmq.ZMQError as exc:
                log.error("recv failed: %s", exc)
                return self._check_writable()
            try:
                self.on_message(frames)
            except Exception:  # a bug in handling one message must not stall the socket
                log.exception("handling a message failed")
        self._reschedule()  # more is waiting: take it after the other ready callbacks

    def _check_writable(self) -> None:
        """Wake a sender waiting for room (checked last: reading may have taken the edge of it)."""
        if self._writable is None or self._writable.done():
            return
        events = self.sock.getsockopt(zmq.EVENTS)
        if events & POLLOUT:
            self._writable.set_result(None)
        if events & POLLIN:  # arrived since the read: this check took its edge
            self._reschedule()

    def send_nowait(self, parts: list[bytes]) -> None:
        """Send now or raise (zmq.Again: the peer's queue is full; for a ROUTER
        with ROUTER_MANDATORY, EHOSTUNREACH: no such peer)."""
        try:
            self.sock.send_multipart(parts, zmq.NOBLOCK)
        finally:
            if self.sock.getsockopt(zmq.EVENTS) & POLLIN:  # the send may have taken the FD's edge
                self._reschedule()

    async def send(self, parts: list[bytes]) -> None:
        """Send, waiting while the peer's queue is full (back-pressure)."""
        while True:
            try:
                return self.send_nowait(parts)
            except zmq.Again:
                self._writable = self.loop.create_future()
                self._reschedule()
                await self._writable

    def close(self) -> None:
        self._closed = True
        self.loop.remove_reader(self._fd)
        if self._writable is not None and not self._writable.done():
            self._writable.cancel()
        self.sock.close()
