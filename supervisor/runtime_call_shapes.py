"""The runtime's own calls, as the pool serves them per model: /tokenize, /detokenize and
/apply-template (llama-server's names; vLLM has the first two), and rerank at /v1/rerank and
/rerank in the Jina/Cohere shape. The pool reads the model's name (and, for rerank, checks
the shape every reranker takes); every other field reaches the runtime as sent, and its
answer comes back as it gave it, with the model's public name where it names one. No I/O."""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

from supervisor.openai_shapes import ModelName

# path -> (the protocol endpoint, the metrics label)
PATHS = {"/tokenize": "tokenize", "/detokenize": "detokenize", "/apply-template": "apply_template",
         "/v1/rerank": "rerank", "/rerank": "rerank"}


class RuntimeCall(msgspec.Struct, kw_only=True):
    """/tokenize, /detokenize, /apply-template: the model names where it goes; the rest is the runtime's."""
    model: ModelName


class RerankRequest(msgspec.Struct, kw_only=True):
    """Jina/Cohere rerank: `query` against `documents` (text, or objects a runtime may take)."""
    model: ModelName
    query: str
    documents: Annotated[list[str | dict], Meta(min_length=1)]
    top_n: Annotated[int, Meta(ge=1)] | None = None


def call_request(data: dict) -> dict:
    """What the runtime gets: the body as sent, less the model's name (the pool owns it)."""
    return {k: v for k, v in data.items() if k != "model"}


def call_answer(model: str, result: dict) -> dict:
    """The runtime's answer; a rerank's names the public model, as an embeddings answer does."""
    answer = dict(result)
    if "results" in answer:
        answer["model"] = model
    return answer


def token_count(result: dict) -> int:
    """The tokens a /tokenize answer counted: vLLM's and the synthetic runtime's `count`,
    else its token list's length."""
    count = result.get("count")
    if isinstance(count, int) and not isinstance(count, bool) and count >= 0:
        return count
    tokens = result.get("tokens")
    return len(tokens) if isinstance(tokens, list) else 0
