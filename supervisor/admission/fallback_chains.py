"""Fallbacks: which model serves a request when the one it named cannot.

A model's `fallbacks = ["b", "c"]` are tried in order, with the same request
and tenant, when the model cannot serve (FALLS_BACK: failed, no healthy
replica, queue full, unloading, the deadline unmeetable) or its runtime fails
before a byte of the answer reached the client (a crash, a 5xx, a timeout); a
fallback out of the tenant's scope is skipped;
`context_fallback = "big"` takes a request refused for its context length.
A fallback's own fallbacks follow it (depth first), each model once. The
config is refused when the chains loop (config/load.py `chain_error`)."""

from __future__ import annotations

from collections.abc import Callable

from protocol.errors import ErrorCode, PoolError

# the model cannot serve the request now: another may
FALLS_BACK = frozenset({
    ErrorCode.QUEUE_FULL, ErrorCode.NO_HEALTHY_REPLICA, ErrorCode.MODEL_UNLOADING, ErrorCode.MODEL_NOT_LOADED,
    ErrorCode.LOAD_FAILED, ErrorCode.INSUFFICIENT_MEMORY, ErrorCode.DEADLINE_UNMEETABLE,
    ErrorCode.RUNTIME_CRASHED, ErrorCode.RUNTIME_RESTARTED, ErrorCode.RUNTIME_ERROR, ErrorCode.PROTOCOL_ERROR,
    ErrorCode.RUNTIME_TIMEOUT, ErrorCode.UPSTREAM_RATE_LIMITED})


class Chain:
    """The models one request tries, in order, and what each answered (for the request log)."""

    def __init__(self, first: str, config_of: Callable[[str], object | None]) -> None:
        self.config_of = config_of  # model name -> its ModelConfig (None: not a model)
        self.tried: list[tuple[str, str | None]] = []  # (model, its error code; None: it served)
        self.pending: list[str] = [first]
        self.last_job = None  # the job of the model tried last, once admitted
        self.deadline: float | None = None  # monotonic: the whole chain's (the first model's request_timeout_s)

    def next_after(self, err: PoolError | None) -> str | None:
        """The next model to try after the last one failed with `err` (None: the first); None
        when there is none or the error is not one another model could help with."""
        if err is None:  # the model the request named: its own answer, a 404 too
            return self.pending.pop(0) if not self.tried and self.pending else None
        cfg = self.config_of(self.tried[-1][0])
        if err.code is ErrorCode.CONTEXT_LENGTH_EXCEEDED:
            self.pending = [cfg.context_fallback] if cfg is not None and cfg.context_fallback else []
        elif err.code in FALLS_BACK:
            self.pending = [*(cfg.fallbacks if cfg is not None else ()), *self.pending]
        elif err.code is ErrorCode.MODEL_NOT_FOUND and len(self.tried) > 1:
            pass  # a fallback out of the tenant's scope: skipped (the client hears the first model's error)
        else:
            return None
        seen = {getattr(self.config_of(name), "name", name) for name, _ in self.tried}
        while self.pending:
            name = self.pending.pop(0)
            cfg = self.config_of(name)
            if cfg is not None and cfg.name not in seen:
                return name
        return None

    def attempt(self, name: str) -> None:
        self.tried.append((name, None))
        self.last_job = None

    def failed(self, err: PoolError) -> None:
        self.tried[-1] = (self.tried[-1][0], err.code.value)

    @property
    def fell_back(self) -> bool:
        return len(self.tried) > 1

    def text(self) -> str:
        """The chain as the request log keeps it: `a (queue_full) -> b`."""
        return " -> ".join(f"{name} ({code})" if code else name for name, code in self.tried)
