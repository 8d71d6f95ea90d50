"""Who is asking: the tenants table ([[tenants]] and [server] api_key), their
live limits, and their shares of each model's queue.

`Tenants` is built from the config at start and rebuilt by every reload
(`apply`): a tenant that keeps its name keeps its state (its requests in
flight, its rate windows), so a reload changes weights, scopes and limits
without touching a worker or a queued request.

Keys: a presented key is looked up by its SHA-256 digest (the lookup shows
nothing about the key in its timing), then compared with the stored key by
`hmac.compare_digest`. Keys never appear in a log line, a repr or an error."""

from __future__ import annotations

import hashlib
import hmac
import math
import os
import time
from dataclasses import dataclass, field
from fnmatch import fnmatchcase

from protocol.errors import ErrorCode, PoolError
from supervisor.config import ConfigError, PoolConfig
from supervisor.config.tenants import DEFAULT, UNKNOWN_KEY  # noqa: F401  (the names admission's users know)
from supervisor.scheduling.fair_queue import Share
from supervisor.replicas.process import withhold_env



@dataclass(frozen=True)
class TenantSpec:
    """One tenant's configured rights (replaced whole by a reload)."""
    name: str
    weight: float = 1.0
    priority: int = 0
    models: tuple[str, ...] = ("*",)
    rpm: int = 0
    tpm: int = 0
    max_inflight: int = 0
    slo_ttft_ms: float | None = None  # its requests' default deadlines (supervisor/scheduling/deadlines.py)
    slo_tpot_ms: float | None = None
    share: Share = field(init=False)
    scope: dict[str, bool] = field(init=False, default_factory=dict, compare=False)  # model name -> may use

    def __post_init__(self) -> None:
        object.__setattr__(self, "share", Share(self.weight, self.priority))

    def may_use(self, names: tuple[str, ...]) -> bool:
        """Whether a model known by these names (its name, then its aliases) is in scope."""
        allowed = self.scope.get(names[0])
        if allowed is None:  # one check per model and config: the cache is as big as the model list
            allowed = self.scope[names[0]] = any(fnmatchcase(n, p) for p in self.models for n in names)
        return allowed


class Window:
    """A per-minute allowance as a token bucket: full at `per_minute`, refilled
    evenly over a minute. Tokens counted after the fact (`charge`) may empty it,
    no further: then nothing more is admitted until it refills."""

    __slots__ = ("per_minute", "level", "at")

    def __init__(self, per_minute: int, now: float) -> None:
        self.per_minute = per_minute
        self.level = float(per_minute)
        self.at = now

    def refill(self, now: float) -> float:
        self.level = min(self.per_minute, self.level + (now - self.at) * self.per_minute / 60)
        self.at = now
        return self.level

    def wait_s(self, need: float, now: float) -> float:
        """Seconds until `need` fits (0: now)."""
        level = self.refill(now)
        return 0.0 if level >= need else (need - level) * 60 / self.per_minute

    def reset_s(self, now: float) -> float:
        """Seconds until the bucket is full again."""
        return (self.per_minute - self.refill(now)) * 60 / self.per_minute

    def charge(self, count: float, now: float) -> None:
        """Count `count` after the fact (negative: give it back). What can be owed is one window:
        the level stops at empty, so no wait (Retry-After, x-ratelimit-reset-*) is ever longer than
        the window, however far a request's usage ran past its reserve (else hours of lockout)."""
        self.level = max(0.0, self.refill(now) - count)


class Tenant:
    """A tenant's live state: its spec, requests in flight, rate windows."""

    __slots__ = ("name", "spec", "inflight", "requests", "tokens", "limited")

    def __init__(self, spec: TenantSpec) -> None:
        self.name = spec.name
        self.inflight = 0  # admitted requests not yet ended (queued or running), pool-wide
        self.requests: Window | None = None
        self.tokens: Window | None = None
        self.configure(spec)

    def configure(self, spec: TenantSpec) -> None:
        self.spec = spec
        now = time.monotonic()
        self.requests = _window(self.requests, spec.rpm, now)
        self.tokens = _window(self.tokens, spec.tpm, now)
        self.limited = bool(spec.rpm or spec.tpm or spec.max_inflight)

    # -- limits --------------------------------------------------------------------------------------
    def admit(self) -> None:
        """Count one request in, or raise 429 rate_limit_exceeded saying when to retry."""
        now = time.monotonic()
        spec = self.spec
        if spec.max_inflight and self.inflight >= spec.max_inflight:
            raise _limited(f"tenant {self.name!r} has {self.inflight} requests in flight (max_inflight)", 1)
        if self.requests is not None:
            wait = self.requests.wait_s(1, now)
            if wait:
                raise _limited(f"tenant {self.name!r} is over its {spec.rpm} requests per minute (rpm)", wait)
        if self.requests is not None:
            self.requests.level -= 1
        self.inflight += 1

    def refused(self) -> None:
        """The request was admitted here and then refused further on (queue full, ...): it used nothing."""
        self.inflight -= 1
        if self.requests is not None:
            self.requests.level += 1

    def release(self) -> None:
        """An admitted request ended."""
        self.inflight -= 1

    def reserve_tokens(self, count: int) -> int:
        """Hold `count` tokens of the tpm window for an admitted request (its prompt's estimate and
        the most output it may ask for), or raise 429 saying when they fit; returns what it holds.
        A reserve never exceeds the window: a request larger than it holds the whole window, once
        the window is full (else it could never run). What the request did not use is given back
        at its end (`charge_tokens` with the difference from what was held)."""
        if self.tokens is None:
            return 0
        count = min(count, self.tokens.per_minute)
        wait = self.tokens.wait_s(count, time.monotonic())
        if wait:
            raise _limited(f"tenant {self.name!r} is over its {self.spec.tpm} tokens per minute (tpm): this "
                           f"request reserves {count} tokens (prompt + max output tokens)", wait)
        self.tokens.level -= count
        return count

    def charge_tokens(self, count: int) -> None:
        if self.tokens is not None and count:
            self.tokens.charge(count, time.monotonic())

    def limit_headers(self) -> list[tuple[bytes, bytes]]:
        """OpenAI's x-ratelimit-* headers for the limits this tenant has (rpm: -requests, tpm: -tokens)."""
        now = time.monotonic()
        headers = []
        for kind, window in (("requests", self.requests), ("tokens", self.tokens)):
            if window is not None:
                reset = window.reset_s(now)
                headers += [(b"x-ratelimit-limit-" + kind.encode(), str(window.per_minute).encode()),
                            (b"x-ratelimit-remaining-" + kind.encode(), str(max(0, int(window.level))).encode()),
                            (b"x-ratelimit-reset-" + kind.encode(), duration(reset).encode())]
        return headers


def _window(old: Window | None, per_minute: int, now: float) -> Window | None:
    if not per_minute:
        return None
    if old is None:
        return Window(per_minute, now)
    old.refill(now)  # a changed limit keeps what was used (at most the new window: see Window.charge)
    used = old.per_minute - old.level
    old.per_minute, old.level = per_minute, max(0.0, per_minute - used)
    return old


def _limited(message: str, wait_s: float) -> PoolError:
    return PoolError(ErrorCode.RATE_LIMIT_EXCEEDED, message, retry_after_s=max(1, math.ceil(wait_s)))


def duration(seconds: float) -> str:
    """OpenAI's reset format: '120ms', '1.5s', '6m0s'."""
    if seconds < 1:
        return f"{max(0, round(seconds * 1000))}ms"
    if seconds < 60:
        return f"{seconds:.3g}s"
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes}m{rest}s"


class Tenants:
    """The table of tenants and their keys; replaced in place by `apply` on reload."""

    def __init__(self, config: PoolConfig, api_key: str | None = None, admin_key: str | None = None) -> None:
        self.api_key = api_key if api_key is not None else config.server.api_key
        self.admin_key = admin_key if admin_key is not None else config.server.admin_key
        self.output_weight = config.server.output_token_weight  # a server key: fixed until restart
        self.by_name: dict[str, Tenant] = {}
        self._by_digest: dict[bytes, tuple[bytes, Tenant]] = {}
        self.configured = False  # [[tenants]] present: keys are tenant keys, the admin key is not one
        self.open = False  # no key at all: every request is the default tenant's
        self.apply(config)

    def apply(self, config: PoolConfig) -> None:
        """Take the tenants of `config` (a reload). Raises ConfigError and changes nothing
        when a key cannot be resolved or collides."""
        specs, keys = self._build(config)
        withhold_env(var for t in config.tenants for var in t.key_env)  # once valid: in no worker's environment
        by_name = {}
        for spec in specs:
            tenant = self.by_name.get(spec.name)
            if tenant is None:
                tenant = Tenant(spec)
            else:
                tenant.configure(spec)
            by_name[spec.name] = tenant
        self.by_name = by_name
        self._by_digest = {hashlib.sha256(k).digest(): (k, by_name[name]) for k, name in keys.items()}
        self.configured = bool(config.tenants)
        self.open = not keys

    def _build(self, config: PoolConfig) -> tuple[list[TenantSpec], dict[bytes, str]]:
        specs: list[TenantSpec] = []
        keys: dict[bytes, str] = {}

        def add_key(key: str, name: str) -> None:
            if self.admin_key and hmac.compare_digest(key.encode(), self.admin_key.encode()) and config.tenants:
                raise ConfigError(f"tenant {name!r}: the admin key is not a tenant key")
            if keys.setdefault(key.encode(), name) != name:
                raise ConfigError(f"tenant {name!r}: a key of tenant {keys[key.encode()]!r} too")

        for t in config.tenants:
            specs.append(TenantSpec(t.name, t.weight, t.priority, tuple(t.models), t.rpm, t.tpm, t.max_inflight,
                                    t.slo_ttft_ms, t.slo_tpot_ms))
            for key in t.keys:
                add_key(key, t.name)
            for var in t.key_env:
                value = os.environ.get(var)
                if not value:
                    raise ConfigError(f"tenant {t.name!r}: the environment variable {var} is not set or empty")
                add_key(value, t.name)
        if not any(s.name == DEFAULT for s in specs):
            specs.append(TenantSpec(DEFAULT))
        if self.api_key:
            add_key(self.api_key, DEFAULT)
            if self.admin_key and not config.tenants:  # no tenants: the admin key may call /v1/ too, as before
                keys.setdefault(self.admin_key.encode(), DEFAULT)
        return specs, keys

    # -- lookups -------------------------------------------------------------------------------------------
    def for_key(self, key: bytes) -> Tenant | None:
        entry = self._by_digest.get(hashlib.sha256(key).digest())
        if entry is None or not hmac.compare_digest(entry[0], key):
            return None
        return entry[1]

    def default(self) -> Tenant:
        return self.by_name[DEFAULT]

    def share(self, name: str) -> Share:
        """A tenant's weight and priority band for the fair queue (a removed tenant's jobs: the default)."""
        tenant = self.by_name.get(name)
        return tenant.spec.share if tenant is not None else Share()

    def names(self) -> list[str]:
        return list(self.by_name)
