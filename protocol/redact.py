"""Secrets kept out of sight: credentials in URLs (https://user:secret@host/...) never reach a view
or a log, and a worker's environment holds no key it must not see."""

from __future__ import annotations

import re

# scheme://userinfo@ : the userinfo is everything up to the @ before the host (no /, no space)
_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/@\s]+@")


def mask_url_credentials(text: str) -> str:
    """`text` with the user:password part of every URL in it replaced by ***."""
    return _USERINFO.sub(r"\1***@", text) if "@" in text else text


def mask_values(info: dict) -> dict:
    """A flat map whose text values have their URL credentials masked."""
    return {k: mask_url_credentials(v) if isinstance(v, str) else v for k, v in info.items()}


# The pool's own keys: never in a worker's (hence a runtime's) environment.
POOL_SECRET_ENV = frozenset({"LLM_POOL_API_KEY", "LLM_POOL_ADMIN_KEY"})


def worker_env(base: dict[str, str], extra: dict[str, str | None]) -> dict[str, str]:
    """`base` with `extra` over it; a name whose value is None is left out (a secret it must not see)."""
    env = {**base, **extra}
    return {name: value for name, value in env.items() if value is not None}
