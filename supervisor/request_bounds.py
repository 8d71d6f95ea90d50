"""Bounds on the request fields that multiply what a runtime sends back, with
OpenAI's own ranges: past them one small request could make a runtime answer
hundreds of megabytes (llama-server returns every alternative it is asked
for). Checked on the job request (the client's body less what the pool owns),
whatever schema library parsed it; each refusal is a 400 naming the field.

Also: how many choices a job may produce (a choice index a runtime sends must
be below it: see Job.push)."""

from __future__ import annotations

from protocol.choices import MAX_CHOICES, N_MAX, prompt_count
from protocol.errors import ErrorCode, PoolError

TOP_LOGPROBS_MAX = 20  # chat `top_logprobs`, Responses `top_logprobs`
LEGACY_LOGPROBS_MAX = 5  # /v1/completions `logprobs` (the number of alternatives there)
LOGIT_BIAS_MAX_ENTRIES = 300


def _int_in(request: dict, field: str, low: int, high: int) -> int | None:
    value = request.get(field)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise PoolError(ErrorCode.INVALID_REQUEST, f"{field}: must be an integer from {low} to {high}", param=field)
    if not low <= value <= high:
        shown = value if abs(value) < 10**12 else "that"  # an echo of the client's input stays short
        raise PoolError(ErrorCode.INVALID_REQUEST, f"{field}: {shown} is out of range ({low} to {high})",
                        param=field)
    return value


def check_request_bounds(request: dict, endpoint: str) -> None:
    """400 `invalid_request` naming the first field out of its range."""
    _int_in(request, "top_logprobs", 0, TOP_LOGPROBS_MAX)
    if endpoint == "completions":
        _int_in(request, "logprobs", 0, LEGACY_LOGPROBS_MAX)  # chat's `logprobs` is a bool: the runtime judges it
    n = _int_in(request, "n", 1, N_MAX) or 1
    bias = request.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict):
            raise PoolError(ErrorCode.INVALID_REQUEST, "logit_bias: must be an object of token ids to numbers",
                            param="logit_bias")
        if len(bias) > LOGIT_BIAS_MAX_ENTRIES:
            raise PoolError(ErrorCode.INVALID_REQUEST, f"logit_bias: {len(bias)} entries, over the "
                            f"{LOGIT_BIAS_MAX_ENTRIES} allowed", param="logit_bias")
    if endpoint == "completions" and n * prompt_count(request) > MAX_CHOICES:
        raise PoolError(ErrorCode.INVALID_REQUEST, f"n times the prompts is {n * prompt_count(request)}, "
                        f"over the {MAX_CHOICES} choices one request may ask for", param="prompt")


ECHO_CHARS = 256  # client text quoted back in an error message


def clip(text: str, limit: int = ECHO_CHARS) -> str:
    """`text` cut to `limit` characters, saying how many more there were."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text) - limit} more characters)"


def echo(value) -> str:
    """Client input quoted for an error message, cut to ECHO_CHARS characters: a
    4,000,000-character model name must not come back whole (nor fill the request log)."""
    return repr(clip(value)) if isinstance(value, str) else clip(repr(value))
