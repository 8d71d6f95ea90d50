"""How many choices a request asks for: the one rule both sides hold a runtime to
(the worker as it reads a runtime's answer, the supervisor as it takes the worker's).
A choice index at or above it is a broken answer, and nothing is ever allocated for it."""

from __future__ import annotations

N_MAX = 128  # OpenAI's bound on `n`: choices per prompt
MAX_CHOICES = 2048  # n times the prompts of a legacy /v1/completions batch


def prompt_count(request: dict) -> int:
    """Prompts in a /v1/completions request: a list of strings or of token lists is a batch."""
    prompt = request.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(x, (str, list)) for x in prompt):
        return len(prompt)
    return 1


def choice_limit(request: dict, endpoint: str) -> int:
    """The choices an answer to `request` at `endpoint` (protocol.ENDPOINTS) may hold:
    its `n` (1 to N_MAX; anything else counts as 1), for legacy completions times the
    prompts of its batch; at most MAX_CHOICES."""
    n = request.get("n")
    n = n if isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= N_MAX else 1
    return min(MAX_CHOICES, n * prompt_count(request)) if endpoint == "completions" else n
