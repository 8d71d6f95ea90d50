"""Admission: the one place an inference request passes, in this order:

    key -> tenant -> model scope -> limits -> queue

`tenant()` runs first, at the HTTP edge, on the headers alone (a wrong key
is refused before anything reads the body); `submit()` runs once the body
names the model: scope, then limits, then the engine's queue.

Today there is one tenant, "default": any inference key (or none when no
key is set) maps to it, its scope is every model and it has no limits. A
tenants table fills in `_tenant_for`, `_in_scope` and `_check_limits`
without touching the edge or the routes.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass

from protocol.errors import ErrorCode, PoolError
from supervisor.jobs import Job


@dataclass(frozen=True, slots=True)
class Tenant:
    """Who a request is for: what it may use and how much of it."""
    name: str


DEFAULT_TENANT = Tenant("default")


def presented_key(headers) -> bytes:
    """The key an ASGI request carries: `Authorization: Bearer <key>`, else `x-api-key`; b"" when none."""
    given = b""
    for name, value in headers:
        if name == b"authorization" and value[:7].lower() == b"bearer ":
            return value[7:]
        if name == b"x-api-key":
            given = value
    return given


def key_matches(given: bytes, wanted: list[bytes]) -> bool:
    """Constant time per key compared: how much of a key matches does not show in the timing."""
    matched = False
    for key in wanted:
        matched |= hmac.compare_digest(given, key)
    return matched


class Admission:
    """Key, tenant, scope and limits of inference requests, then the engine's queue.

    Keys: with an inference key set, a request needs it (or the admin key);
    with none, every request is the default tenant's."""

    def __init__(self, engine, api_key: str | None, admin_key: str | None) -> None:
        self.engine = engine
        self.keys = [k.encode() for k in (api_key, admin_key) if k] if api_key else []

    # -- key -> tenant: at the edge, before the body is read -----------------------------------------------
    def tenant(self, headers) -> Tenant:
        """The tenant of a request with these ASGI headers; 401 for a missing or wrong key."""
        if not self.keys:
            return DEFAULT_TENANT
        given = presented_key(headers)
        tenant = self._tenant_for(given) if key_matches(given, self.keys) else None
        if tenant is None:
            raise PoolError(ErrorCode.UNAUTHORIZED, "missing or wrong API key")
        return tenant

    def _tenant_for(self, key: bytes) -> Tenant | None:  # noqa: ARG002 -- one tenant holds every key today
        return DEFAULT_TENANT

    # -- scope -> limits -> queue: once the body names the model -------------------------------------------
    def submit(self, tenant: Tenant, model: str, request: dict, endpoint: str) -> Job:
        """The job for this request, queued on its model; PoolError when it is refused."""
        if not self._in_scope(tenant, model):
            # the same answer as a model that does not exist: a tenant does not learn other tenants' models
            raise PoolError(ErrorCode.MODEL_NOT_FOUND, f"model {model!r} does not exist", param="model")
        self._check_limits(tenant, model, request)
        return self.engine.submit(model, request, endpoint)

    def _in_scope(self, tenant: Tenant, model: str) -> bool:  # noqa: ARG002 -- every model, today
        return True

    def _check_limits(self, tenant: Tenant, model: str, request: dict) -> None:  # noqa: ARG002 -- none today
        return None
