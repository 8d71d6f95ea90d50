"""The ROUTER's TCP listener for workers on other hosts (placement = "ray").

Bound only when a remote replica exists; local workers keep the ipc path. The
link is encrypted and authenticated with ZeroMQ CURVE: the supervisor makes a
server key pair per run and one client key pair per remote worker it starts,
and a ZAP handler lets in only those client keys (a worker's key is revoked
when it exits). Every refused peer is logged: a key that was not handed out
(refused by ZAP), or a peer without this run's server key or not speaking
CURVE at all (its handshake fails; seen through the socket's monitor)."""

from __future__ import annotations

import logging

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import parse_monitor_message

from protocol.loop_socket import LoopSocket
from supervisor.log_throttle import ThrottledLog

log = logging.getLogger("llm_pool.curve")

ZAP_DOMAIN = "llm-pool"
REPEAT_LOG_S = 60.0  # a refused peer retries every 100 ms: one line per peer and reason a minute
_HANDSHAKE_FAILURES = {
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "handshake failed",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "handshake failed: not this run's server key, or not CURVE",
}


class WorkerKeys(ThreadAuthenticator):
    """ZAP handler (in its own thread): a CURVE client gets in only with a public
    key in `allowed`. The set is changed from the loop's thread; a membership
    test against it is atomic."""

    def __init__(self, ctx: zmq.Context) -> None:
        super().__init__(ctx, log=logging.getLogger("llm_pool.curve.zap"))  # pyzmq's own lines: debug
        self.allowed: set[bytes] = set()  # Z85 public keys
        self._peer = "?"
        self._refusals = ThrottledLog(log, REPEAT_LOG_S)

    async def handle_zap_message(self, msg: list[bytes]) -> None:
        # requests are handled one at a time: the address is the current request's
        self._peer = msg[3].decode(errors="replace") if len(msg) > 3 else "?"
        await super().handle_zap_message(msg)

    def callback(self, domain: str, key: bytes) -> bool:  # pyzmq's credentials-provider hook
        if key in self.allowed:
            return True
        shown = key.decode(errors="replace")
        self._refusals.warning(f"{self._peer} {shown}", "refused a worker connection from %s: its CURVE key %s "
                               "is not one this supervisor handed out", self._peer, shown)
        return False


class CurveListener:
    """A CURVE TCP endpoint on `sock` (the transport's ROUTER, which also keeps its
    ipc endpoint: security options apply to the endpoints bound after them)."""

    def __init__(self, ctx: zmq.Context, sock: zmq.Socket, host: str, port: int) -> None:
        self.server_public, secret = zmq.curve_keypair()
        self.keys = WorkerKeys(ctx)
        self.keys.start()
        self.keys.configure_curve_callback(ZAP_DOMAIN, credentials_provider=self.keys)
        sock.curve_secretkey = secret
        sock.curve_publickey = self.server_public
        sock.curve_server = True
        sock.zap_domain = ZAP_DOMAIN.encode()
        if ":" in host:
            sock.ipv6 = True
        try:
            sock.bind(f"tcp://{_bracket(host)}:{port or '*'}")
        except zmq.ZMQError:
            self.keys.stop()
            raise
        self.port = int(sock.last_endpoint.decode().rsplit(":", 1)[1])
        self._sock = sock
        self._failures = ThrottledLog(log, REPEAT_LOG_S)
        self._monitor = LoopSocket(sock.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL), self._on_event)

    def allow(self, public: bytes) -> None:
        self.keys.allowed.add(public)

    def revoke(self, public: bytes) -> None:
        self.keys.allowed.discard(public)

    def _on_event(self, frames: list[bytes]) -> None:
        # the monitor names our endpoint, not the peer (libzmq's stable API has no more)
        event = parse_monitor_message(frames)
        reason = _HANDSHAKE_FAILURES.get(event["event"], "handshake failed")
        self._failures.warning(f"{event['event']} {event['value']}", "refused a connection on %s: %s (code %#x)",
                               event["endpoint"].decode(errors="replace"), reason, event["value"])

    def close(self) -> None:
        """Before the context ends: the monitor's and the ZAP handler's sockets live in it."""
        self._monitor.close()
        try:
            self._sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self.keys.stop()


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
