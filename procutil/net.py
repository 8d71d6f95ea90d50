"""Ports."""

from __future__ import annotations

import random
import socket

LOWEST = 10_000  # below the ephemeral range, above the usual services
TRIES = 64


def ephemeral_low() -> int:
    """The first port the kernel hands out for outgoing connections (Linux), else IANA's."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 49_152


def free_port() -> int:
    """A loopback TCP port free now, for a server to bind soon. It is taken at random below
    the kernel's ephemeral range: a port the OS picked from that range could be handed to an
    outgoing connection (any client on the machine) before the server binds it, which a busy
    test run meets. Another process may still take it first: bind it soon."""
    high = ephemeral_low() - 1
    for _ in range(TRIES if high > LOWEST else 0):
        port = random.randint(LOWEST, high)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # no room below the range: the OS picks
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
