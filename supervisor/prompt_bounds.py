"""What one request's prompt may carry, per model: max_messages, max_content_parts
and max_prompt_chars (checked before a job exists, so a request that cannot travel
starts no load)."""

from __future__ import annotations

from protocol.errors import ErrorCode, PoolError
from supervisor.config import ModelConfig


# a legacy prompt, embeddings' input, the text of the runtime's own calls (tokenize's content,
# detokenize's tokens, rerank's query and documents), and an Anthropic body's system
TEXT_FIELDS = ("prompt", "input", "content", "tokens", "query", "documents", "system")


def check_prompt_bounds(cfg: ModelConfig, request: dict) -> None:
    """400 for a prompt over the model's max_messages or max_prompt_chars (chat
    messages, a legacy completion's prompt, or an embedding's input)."""
    messages = request.get("messages") or []
    if len(messages) > cfg.max_messages:
        raise PoolError(ErrorCode.INVALID_REQUEST, f"{len(messages)} messages, over model {cfg.name!r}'s "
                        f"max_messages ({cfg.max_messages})", param="messages")
    chars = sum(_text_chars(request.get(key)) for key in TEXT_FIELDS)
    parts = 0
    for m in messages:
        if isinstance(m, dict):
            content = m.get("content")
            chars += _text_chars(content)
            parts += len(content) if isinstance(content, list) else 0
    if parts > cfg.max_content_parts:
        raise PoolError(ErrorCode.INVALID_REQUEST, f"{parts} content parts, over model {cfg.name!r}'s "
                        f"max_content_parts ({cfg.max_content_parts})", param="messages")
    if chars > cfg.max_prompt_chars:
        raise PoolError(ErrorCode.INVALID_REQUEST, f"the prompt has {chars} characters, over model "
                        f"{cfg.name!r}'s max_prompt_chars ({cfg.max_prompt_chars})",
                        param="messages" if messages else next((k for k in TEXT_FIELDS if k in request), "prompt"))


def _text_chars(content) -> int:
    """Size of a message's content or a prompt: a string's characters, a list of
    strings, content parts or blocks (their text, an Anthropic thinking block's thinking,
    a tool_result's own content), token ids (one each) or token-id lists."""
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(_text_chars(part) if isinstance(part, (str, list))
                   else _block_chars(part) if isinstance(part, dict) else 1 for part in content)
    return 0


def _block_chars(block: dict) -> int:
    text, thinking = block.get("text"), block.get("thinking")
    return (len(text) if isinstance(text, str) else 0) + (len(thinking) if isinstance(thinking, str) else 0) \
        + _text_chars(block.get("content"))
