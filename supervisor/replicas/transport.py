"""The supervisor's one ZeroMQ ROUTER socket: binds it in a private directory,
routes incoming frames to replicas by identity, sends to a replica by identity
(the first frame for a worker in a loop turn goes at once; what follows it in
the same turn goes out after the turn, as one batch frame per worker: one
socket send, not one per job).
A malformed frame is logged and handed to its replica, which counts it; it
never escapes."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import psutil
import zmq

import protocol as p
from protocol.loop_socket import LoopSocket
from supervisor.replicas.curve_listener import CurveListener

log = logging.getLogger("llm_pool.transport")

Handler = Callable[[p.Message | p.ProtocolError], None]


DIR_PREFIX = "llm-pool-"  # + the supervisor's pid + "-" + random: a dead owner's dir can be swept


def sweep_stale_socket_dirs() -> list[Path]:
    """Remove the socket directories of supervisors that died without cleaning
    up (SIGKILL, a crash). Only ours (same user) and only when the pid in the
    name is gone."""
    removed = []
    for path in Path(tempfile.gettempdir()).glob(f"{DIR_PREFIX}*-*"):
        pid = path.name[len(DIR_PREFIX):].split("-", 1)[0]
        try:
            mine = path.is_dir() and path.stat().st_uid == os.getuid()
        except OSError:
            continue
        if mine and pid.isdigit() and not psutil.pid_exists(int(pid)):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


class Transport:
    def __init__(self) -> None:
        # mkdtemp makes it 0700
        self.dir = Path(tempfile.mkdtemp(prefix=f"{DIR_PREFIX}{os.getpid()}-"))
        os.chmod(self.dir, 0o700)
        self.endpoint = f"ipc://{self.dir}/router.sock"
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # sending to a gone peer raises
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, p.MAX_FRAME_BYTES + 1024)
        self.sock.bind(self.endpoint)
        self.handlers: dict[bytes, Handler] = {}
        self._loop_sock: LoopSocket | None = None
        # identity -> (frame, on_failed) queued this loop turn, in order; sent by _flush
        self._outgoing: dict[bytes, list[tuple[bytes, Callable[[], None] | None]]] = {}
        self.remote: CurveListener | None = None  # the CURVE TCP listener, once a remote replica exists

    def listen_tcp(self, host: str, port: int) -> CurveListener:
        """Also take workers on other hosts, over TCP with CURVE (once; from the running loop)."""
        if self.remote is None:
            self.remote = CurveListener(self.ctx, self.sock, host, port)
        return self.remote

    def start(self) -> None:
        """Begin routing incoming frames (call from the running loop)."""
        self._loop_sock = LoopSocket(self.sock, self._dispatch)

    def register(self, identity: str, handler: Handler) -> None:
        self.handlers[identity.encode()] = handler

    def unregister(self, identity: str) -> None:
        self.handlers.pop(identity.encode(), None)

    def send(self, identity: str, msg: p.Message, on_failed: Callable[[], None] | None = None) -> None:
        self.send_frame(identity, p.encode(msg), on_failed)

    def send_frame(self, identity: str, frame: bytes, on_failed: Callable[[], None] | None = None) -> None:
        """Send an encoded frame to a worker. The first frame for a worker in a loop turn
        goes at once (a lone request waits for no batch); the frames that follow it in the
        same turn go out right after the turn (_flush), in order, as one batch per worker.
        If a frame cannot be sent (the worker is gone or not reading), its `on_failed` and
        those of the frames queued after it are called after the turn. Never raises."""
        identity_bytes = identity.encode()
        out = self._outgoing.get(identity_bytes)
        if out is None:
            if not self._outgoing:
                asyncio.get_running_loop().call_soon(self._flush)
            out = self._outgoing[identity_bytes] = []
            if self._loop_sock is not None:
                try:
                    self._loop_sock.send_nowait([identity_bytes, frame])
                    return  # sent: what follows this turn is batched behind it
                except zmq.ZMQError:
                    pass  # queued: _flush tries again and calls on_failed if that fails too
        out.append((frame, on_failed))

    def _flush(self) -> None:
        outgoing, self._outgoing = self._outgoing, {}
        for identity, queued in outgoing.items():
            start = 0
            while start < len(queued):
                end, size = start, 0  # a batch stays under the frame cap (a Submit alone always fits)
                while end < len(queued) and (end == start or size + len(queued[end][0]) < p.MAX_FRAME_BYTES - 8):
                    size += len(queued[end][0])
                    end += 1
                try:
                    if self._loop_sock is None:
                        raise zmq.ZMQError(zmq.ENOTSUP, "the transport is not started")
                    self._loop_sock.send_nowait([identity, p.encode_batch([f for f, _ in queued[start:end]])])
                except zmq.ZMQError as exc:  # EHOSTUNREACH: the worker is gone; EAGAIN: it is not reading
                    log.warning("send to %s failed: %s", identity.decode(errors="replace"), exc)
                    for _, on_failed in queued[start:]:  # what follows must not overtake what failed
                        if on_failed is not None:
                            try:
                                on_failed()
                            except Exception:  # one replica's handling must not stop the others' frames
                                log.exception("handling a failed send to %r failed", identity)
                    break
                start = end

    def _dispatch(self, frames: list[bytes]) -> None:
        if len(frames) != 2:
            log.error("dropping a %d-part message", len(frames))
            return
        identity, frame = frames
        handler = self.handlers.get(identity)
        for msg in p.decode_many(frame):  # one message, or what a worker had ready at one wake-up
            if isinstance(msg, p.ProtocolError):
                log.error("bad frame from %r: %s", identity, msg.reason)
            if handler is None:  # a worker already unregistered (stopped or replaced): its last words
                log.debug("dropping a frame from unknown peer %r", identity)
                return
            try:
                handler(msg)
            except Exception:  # a bug in one replica's handling must not stop routing
                log.exception("handler for %r failed on %r", identity, msg)

    async def close(self) -> None:
        if self._loop_sock and self._outgoing:  # last words (a Shutdown) queued this turn
            self._flush()
        if self.remote:
            self.remote.close()
        if self._loop_sock:
            self._loop_sock.close()
        else:
            self.sock.close(linger=0)
        self.ctx.term()
        shutil.rmtree(self.dir, ignore_errors=True)
