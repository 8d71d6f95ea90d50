"""What a model serves, derived from its backend and options before anything loads: listed
in /v1/models as `capabilities`, and checked before the runtime's own calls are admitted
(400 unsupported_endpoint, with no slot or queue place taken). The worker's backends say
the same from inside (Backend.endpoints, which refuses too); tests/test_runtime_calls.py
checks that the two agree."""

from __future__ import annotations

from protocol.errors import ErrorCode, PoolError
from supervisor.config import ModelConfig

# The runtime's own calls (protocol.ENDPOINTS), each answered whole. A call that needs no
# generation slot in the runtime (protocol.LIGHT_ENDPOINTS) is handed to a ready replica past
# the model's queue (scheduler.Executor.enqueue); rerank runs on the runtime's slots, so it
# queues as any job.
CALLS = frozenset({"tokenize", "detokenize", "apply_template", "rerank", "count_tokens", "input_tokens"})

CHAT = ("chat", "completions", "responses", "messages")
_BY_BACKEND = {
    # messages, count_tokens: llama-server's and vLLM's own routes; input_tokens (a chat's count):
    # llama-server's own; elsewhere both translated (a tokenize of the chat)
    "llama_server": (*CHAT, "count_tokens", "input_tokens", "tokenize", "detokenize", "apply_template"),
    "vllm_serve": (*CHAT, "count_tokens", "input_tokens", "tokenize", "detokenize"),
    "openai_remote": (*CHAT, "embeddings"),
    "synthetic": (*CHAT, "count_tokens", "input_tokens", "tokenize"),
    "exllamav3": ("chat", "responses", "messages"),
}
EMBEDDING_ARGS = {"llama_server": ("--embedding", "--embeddings"), "vllm_serve": ("embed", "embedding", "pooling")}
RERANK_FLAGS = ("--reranking", "--rerank")  # llama-server's


def capabilities(cfg: ModelConfig) -> list[str]:
    """What `cfg`'s model serves: the endpoints of its backend, with embeddings and rerank
    where its options start the runtime for them."""
    found = list(_BY_BACKEND.get(cfg.backend, ("chat",)))
    args = [str(a) for a in cfg.options.get("extra_args", [])]
    if any(a in EMBEDDING_ARGS.get(cfg.backend, ()) for a in args):
        found.append("embeddings")
    if cfg.backend in ("llama_server", "vllm_serve") and (
            cfg.options.get("reranking") or any(a in RERANK_FLAGS for a in args)):
        found.append("rerank")
    return found


def native_messages(cfg: ModelConfig) -> bool:
    """Whether /v1/messages and its count_tokens go to the runtime's own routes (llama-server's, vLLM's),
    not translated to chat (and counted as a tokenize of that chat)."""
    return cfg.backend in ("llama_server", "vllm_serve")


def native_input_tokens(cfg: ModelConfig) -> bool:
    """Whether a chat's input_tokens goes to the runtime's own route (llama-server's), not to its
    /tokenize of that chat."""
    return cfg.backend == "llama_server"


# The client's headers that a runtime's own Anthropic routes get as sent: the API version and
# the betas it asks for (llama-server and vLLM read neither today; a newer runtime may). A
# header sent on several lines goes as one, comma-joined (HTTP's meaning); one longer than
# MAX_FORWARDED_HEADER is left out whole rather than cut (a cut beta name is a wrong one).
FORWARDED_HEADERS = {"messages": ("anthropic-version", "anthropic-beta"),
                     "count_tokens": ("anthropic-version", "anthropic-beta")}
MAX_FORWARDED_HEADER = 1024


def forwarded_headers(endpoint: str, headers) -> dict[str, str] | None:
    """What of the request's `headers` goes to the runtime with a job on `endpoint` (None: nothing)."""
    names = FORWARDED_HEADERS.get(endpoint)
    if not names or not headers:
        return None
    found = {}
    for name in names:
        values = headers.getlist(name) if hasattr(headers, "getlist") else [headers.get(name)]
        value = ", ".join(v for v in values if v)
        if value and len(value) <= MAX_FORWARDED_HEADER:
            found[name] = value
    return found or None


CALL_PATHS = {"tokenize": "/tokenize", "detokenize": "/detokenize", "apply_template": "/apply-template",
              "rerank": "/v1/rerank", "count_tokens": "/v1/messages/count_tokens",
              "input_tokens": "/v1/chat/completions/input_tokens"}


def check_serves(cfg: ModelConfig, endpoint: str) -> None:
    """400 unsupported_endpoint for a call `cfg`'s model does not serve. (A Messages count_tokens
    asked as a tokenize of its chat is checked as count_tokens by its surface's endpoint.)"""
    if endpoint not in capabilities(cfg):
        raise PoolError(ErrorCode.UNSUPPORTED_ENDPOINT,
                        f"model {cfg.name!r} ({cfg.backend}) does not serve {CALL_PATHS[endpoint]}", param="model")
