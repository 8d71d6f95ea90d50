"""ZeroMQ CURVE for workers on other hosts: the names of the environment
variables that carry a worker's keys (Z85 text). They travel in the
environment, never in argv, which any user of that host can read through ps;
the worker takes them out of its environment before it starts a runtime."""

from __future__ import annotations

import os

SERVER_KEY_ENV = "LLM_POOL_CURVE_SERVER_KEY"  # the supervisor's public key for this run
PUBLIC_KEY_ENV = "LLM_POOL_CURVE_PUBLIC_KEY"  # this worker's own key pair, made for it alone
SECRET_KEY_ENV = "LLM_POOL_CURVE_SECRET_KEY"


def curve_env(server_public: bytes, public: bytes, secret: bytes) -> dict[str, str]:
    return {SERVER_KEY_ENV: server_public.decode(), PUBLIC_KEY_ENV: public.decode(),
            SECRET_KEY_ENV: secret.decode()}


def take_curve_keys() -> tuple[bytes, bytes, bytes] | None:
    """(server public, public, secret) from this process's environment, removed
    from it; None when they are not all there (a local worker on ipc)."""
    values = [os.environ.pop(name, None) for name in (SERVER_KEY_ENV, PUBLIC_KEY_ENV, SECRET_KEY_ENV)]
    if not all(values):
        return None
    return tuple(v.encode() for v in values)  # type: ignore[return-value]
