"""What one request's prompt may carry, per model: max_messages, max_content_parts
and max_prompt_chars (checked before a job exists, so a request that cannot travel
starts no load)."""

from __future__ import annotations

from protocol.errors import ErrorCode, PoolError
from supervisor.config import ModelConfig


# a legacy prompt, embeddings' input, the text of the runtime's own calls (tokenize's content,
# detokenize's tokens, rerank's query and documents), and an Anthropic body's system
TEXT_FIELDS = ("prompt", "input", "content", "tokens", "query", "documents", "system")
TEXT_KEYS = frozenset(TEXT_FIELDS)


def check_prompt_bounds(cfg: ModelConfig, request: dict) -> None:
    """400 for a prompt over the model's max_messages, max_content_parts or max_prompt_chars
    (chat or Anthropic messages, a legacy completion's prompt, an embedding's input, the
    runtime's own calls). Content parts: every block (an object) in a message's content, an
    Anthropic `system`, a prompt field, or a block's own content, and every tool."""
    messages = request.get("messages") or []
    if len(messages) > cfg.max_messages:
        raise PoolError(ErrorCode.INVALID_REQUEST, f"{len(messages)} messages, over model {cfg.name!r}'s "
                        f"max_messages ({cfg.max_messages})", param="messages")
    tools = request.get("tools")
    contents = [m.get("content") for m in messages if type(m) is dict]
    contents += [request[key] for key in request if key in TEXT_KEYS]  # a body's few keys, not all seven
    chars, parts = _measure(contents)
    parts += len(tools) if isinstance(tools, list) else 0
    if parts > cfg.max_content_parts:
        raise PoolError(ErrorCode.INVALID_REQUEST, f"{parts} content parts, over model {cfg.name!r}'s "
                        f"max_content_parts ({cfg.max_content_parts})", param="messages")
    if chars > cfg.max_prompt_chars:
        raise PoolError(ErrorCode.INVALID_REQUEST, f"the prompt has {chars} characters, over model "
                        f"{cfg.name!r}'s max_prompt_chars ({cfg.max_prompt_chars})",
                        param="messages" if messages else next((k for k in TEXT_FIELDS if k in request), "prompt"))


def _measure(contents: list) -> tuple[int, int]:
    """(characters, blocks) of these contents, walked with a stack (a body nested deep costs
    no recursion): a string's characters; in a list, strings, nested lists, token ids (one
    each) and blocks: an object, counted as a part, whose text, an Anthropic thinking
    block's thinking and its own content (a tool_result's) count."""
    chars = parts = 0
    stack = [c for c in contents if isinstance(c, (str, list))]
    while stack:
        content = stack.pop()
        if isinstance(content, str):
            chars += len(content)
            continue
        for part in content:
            if isinstance(part, (str, list)):
                stack.append(part)
            elif isinstance(part, dict):
                parts += 1
                text, thinking, inner = part.get("text"), part.get("thinking"), part.get("content")
                chars += (len(text) if isinstance(text, str) else 0) + (len(thinking) if isinstance(thinking, str) else 0)
                if isinstance(inner, (str, list)):
                    stack.append(inner)
            else:
                chars += 1
    return chars, parts
