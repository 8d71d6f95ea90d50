"""Ports."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A loopback TCP port free now (the OS picks it; another process may take it
    before it is bound again, so bind it soon)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
