"""The runtime's own calls, as the pool serves them per model: /tokenize, /detokenize and
/apply-template (llama-server's names; vLLM has the first two), and rerank at /v1/rerank and
/rerank (and llama-server's aliases /v1/reranking, /reranking) in the Jina/Cohere shape. The pool reads the model's name (and, for rerank, checks
the shape every reranker takes); every other field reaches the runtime as sent, and its
answer comes back as it gave it, with the model's public name where it names one. No I/O."""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

from supervisor.shapes.openai import ModelName

# path -> (the protocol endpoint, the metrics label)
PATHS = {"/tokenize": "tokenize", "/detokenize": "detokenize", "/apply-template": "apply_template",
         "/v1/rerank": "rerank", "/rerank": "rerank", "/v1/reranking": "rerank", "/reranking": "rerank"}
# llama-server's count of a chat's prompt tokens (served as the runtime call "input_tokens")
INPUT_TOKENS_PATHS = ("/v1/chat/completions/input_tokens", "/chat/completions/input_tokens")


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


def chat_tokenize_request(data: dict) -> dict:
    """A chat body's prompt as a runtime's /tokenize counts it (vLLM's form: `messages` and `tools`,
    with the model's chat template and the assistant's opening, as a chat request is rendered)."""
    request = {"messages": data["messages"], "add_generation_prompt": True}
    if data.get("tools"):
        request["tools"] = data["tools"]
    return request


def input_tokens_answer(count: int) -> dict:
    """llama-server's answer to /v1/chat/completions/input_tokens (OpenAI's input token count)."""
    return {"object": "response.input_tokens", "input_tokens": count}


def token_count(result: dict) -> int:
    """The tokens a /tokenize answer counted: vLLM's and the synthetic runtime's `count`,
    else its token list's length."""
    count = result.get("count")
    if isinstance(count, int) and not isinstance(count, bool) and count >= 0:
        return count
    tokens = result.get("tokens")
    return len(tokens) if isinstance(tokens, list) else 0
