"""The one error tree of the project and its HTTP status table.

Workers send `ErrorCode` values in `error` messages; the supervisor raises
`PoolError`s; the API layer turns them into the OpenAI error envelope with
`HTTP_STATUS[code]`.
"""

from __future__ import annotations

import signal
from enum import IntEnum, StrEnum


class ErrorCode(StrEnum):
    INVALID_REQUEST = "invalid_request"
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"  # prompt and output do not fit the model's context
    UNSUPPORTED_PARAMETER = "unsupported_parameter"  # a field this model's backend cannot honour
    UNSUPPORTED_ENDPOINT = "unsupported_endpoint"  # an endpoint this model cannot serve
    REQUEST_TOO_LARGE = "request_too_large"
    UNAUTHORIZED = "unauthorized"
    INVALID_API_KEY = "invalid_api_key"  # a key no tenant holds
    FORBIDDEN = "forbidden"  # a browser or Host the admin surface refuses
    HEADERS_TOO_LARGE = "headers_too_large"
    UPGRADE_REQUIRED = "websocket_not_served"  # a WebSocket upgrade: the pool answers over HTTP only
    MODEL_NOT_FOUND = "model_not_found"
    MODEL_NOT_LOADED = "model_not_loaded"
    MODEL_BUSY = "model_busy"  # a load, unload or restart of the model is under way
    QUEUE_FULL = "queue_full"
    MODEL_UNLOADING = "model_unloading"
    QUEUE_TIMEOUT = "queue_timeout"
    DEADLINE_UNMEETABLE = "deadline_unmeetable"  # the request's x-slo-* deadline cannot be met (or passed queued)
    NO_HEALTHY_REPLICA = "no_healthy_replica"
    RUNTIME_CRASHED = "runtime_crashed"
    RUNTIME_RESTARTED = "runtime_restarted"  # an operator restart's drain ran out while the job ran
    RUNTIME_TIMEOUT = "runtime_timeout"
    RUNTIME_ERROR = "runtime_error"  # the runtime answered with an error of its own
    UPSTREAM_RATE_LIMITED = "upstream_rate_limited"
    RATE_LIMIT_EXCEEDED = "rate_limit_exceeded"  # a tenant over its rpm, tpm or max_inflight
    LOAD_FAILED = "load_failed"
    INSUFFICIENT_MEMORY = "insufficient_memory"  # the model does not fit the memory budget now
    PROTOCOL_ERROR = "protocol_error"
    INTERNAL_ERROR = "internal_error"  # a fault of the pool's own (an exception in a handler)


HTTP_STATUS: dict[ErrorCode, int] = {
    ErrorCode.INVALID_REQUEST: 400,
    ErrorCode.CONTEXT_LENGTH_EXCEEDED: 400,
    ErrorCode.UNSUPPORTED_PARAMETER: 400,
    ErrorCode.UNSUPPORTED_ENDPOINT: 400,
    ErrorCode.REQUEST_TOO_LARGE: 413,
    ErrorCode.UNAUTHORIZED: 401,
    ErrorCode.INVALID_API_KEY: 401,
    ErrorCode.FORBIDDEN: 403,
    ErrorCode.HEADERS_TOO_LARGE: 431,
    ErrorCode.UPGRADE_REQUIRED: 426,
    ErrorCode.MODEL_NOT_FOUND: 404,
    ErrorCode.MODEL_NOT_LOADED: 409,
    ErrorCode.MODEL_BUSY: 409,
    ErrorCode.QUEUE_FULL: 429,
    ErrorCode.UPSTREAM_RATE_LIMITED: 429,
    ErrorCode.RATE_LIMIT_EXCEEDED: 429,
    ErrorCode.MODEL_UNLOADING: 503,
    ErrorCode.QUEUE_TIMEOUT: 503,
    ErrorCode.DEADLINE_UNMEETABLE: 503,
    ErrorCode.NO_HEALTHY_REPLICA: 503,
    ErrorCode.LOAD_FAILED: 503,
    ErrorCode.INSUFFICIENT_MEMORY: 503,
    # 503, not 502: the pool stopped the runtime on purpose (nothing is broken upstream); a retry
    # soon is served by another replica or by this one once it is back
    ErrorCode.RUNTIME_RESTARTED: 503,
    ErrorCode.RUNTIME_CRASHED: 502,
    ErrorCode.RUNTIME_ERROR: 502,
    ErrorCode.PROTOCOL_ERROR: 502,
    ErrorCode.RUNTIME_TIMEOUT: 504,
    ErrorCode.INTERNAL_ERROR: 500,
}

# OpenAI "type" field of the envelope, by status class.
ERROR_TYPE: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    426: "invalid_request_error",
    431: "invalid_request_error",
    429: "rate_limit_error",
}


class PoolError(Exception):
    def __init__(self, code: ErrorCode, message: str, *, param: str | None = None,
                 retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.code = ErrorCode(code)
        self.message = message
        self.param = param
        self.retry_after_s = retry_after_s

    @property
    def status(self) -> int:
        return HTTP_STATUS[self.code]

    def envelope(self) -> dict:
        return {"error": {
            "message": self.message,
            "type": ERROR_TYPE.get(self.status, "server_error"),
            "param": self.param,
            "code": self.code.value,
        }}


class WorkerExit(IntEnum):
    """Exit codes of `python -m runtime_worker`."""
    OK = 0
    CRASH = 1
    BOOT_FAILURE = 3  # the runtime could not load: retrying will not help
    SUPERVISOR_GONE = 4


def exit_text(code: int | None) -> str:
    """A process's exit for people: "code 1", or the signal that ended it ("SIGKILL")."""
    if code is None:
        return "an unknown code"
    if code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            return f"signal {-code}"
    return f"code {code}"


def context_message(prompt_tokens: int | None, context: int) -> str:
    """A context_length_exceeded error's message in OpenAI's wording, which agents match to
    compact a conversation (the Messages surface words it as Anthropic does, from these numbers)."""
    resulted = f"However, your messages resulted in {prompt_tokens} tokens. " if prompt_tokens is not None else ""
    return (f"This model's maximum context length is {context} tokens. {resulted}"
            "Please reduce the length of the messages.")
