"""What each replica's prompt cache probably holds: an approximate prefix index.

The pool has no token ids, so a prompt is rendered canonically (tools, then
each message's role, name and content, in order: what a chat template puts
in front of the model), cut into fixed-size blocks of characters, and each
full block is keyed by a hash chained over every block before it: two prompts
share block i's key only if they share everything up to its end. A runtime's
cache is a prefix cache too, so the longest run of leading keys a replica
holds is the best guess at how much of the prompt it can reuse.

Each replica's keys sit in an LRU bounded by that replica's cache capacity:
once more prompts went there than its cache holds, the oldest are gone from
both. A prompt's keys are touched deepest first, so its first block is the
most recent and the tail of a long prompt is evicted before its root (as a
radix tree evicts leaves first). Pure: no I/O, no clock."""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Sequence

from supervisor.shapes.anthropic import unstamped

BLOCK_CHARS = 256  # one block of the canonical prompt: ~64 tokens at ~4 characters a token
CHARS_PER_TOKEN = 4  # to size an index from a runtime's cache in tokens
_SEP_MESSAGE, _SEP_FIELD = "\x1e", "\x1f"  # cannot appear inside a JSON-escaped value, and rarely in text


def _text(value) -> str:
    if isinstance(value, str):
        return value
    if value is None:
        return ""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)


def canonical_prompt(request: dict, endpoint: str = "chat") -> str:
    """The prompt as the runtime will see it, up to the template's own words:
    a chat's tools, then each message's role, name, content, tool calls and
    tool-call id; a legacy completion's prompt; an Anthropic body's system (its
    per-request stamp made constant), then the same. Empty for what no prompt
    cache reuses (embeddings) or what is not a prompt."""
    if endpoint == "completions":
        return _text(request.get("prompt"))
    if endpoint not in ("chat", "messages"):
        return ""
    parts = []
    if endpoint == "messages" and request.get("system"):  # Anthropic's, on a runtime's own route
        parts.append(unstamped(_text(request["system"])))
    if request.get("tools"):
        parts.append(_text(request["tools"]))
    for m in request.get("messages") or ():
        if not isinstance(m, dict):
            continue
        parts.append(_SEP_MESSAGE + str(m.get("role", "")) + _SEP_FIELD + _text(m.get("name"))
                     + _SEP_FIELD + _text(m.get("content")))
        if m.get("tool_calls") or m.get("tool_call_id"):
            parts.append(_SEP_FIELD + _text(m.get("tool_calls")) + _SEP_FIELD + _text(m.get("tool_call_id")))
    return "".join(parts)


def prompt_blocks(text: str, seed: str | None = None, block_chars: int = BLOCK_CHARS) -> list[int]:
    """Chained keys of the full blocks of `text`: key i covers blocks 0..i. A
    `seed` (the request's prompt_cache_key) starts the chain, so prompts under
    different keys never share a key. The partial last block has no key (a
    runtime caches whole blocks too, and the next turn completes it)."""
    key = hash(("seed", seed))
    keys = []
    for start in range(0, len(text) - block_chars + 1, block_chars):
        key = hash((key, text[start:start + block_chars]))
        keys.append(key)
    return keys



def leading_matches(keys: Sequence[int], held) -> int:
    """How many of `keys`, from the first, are in `held` (a prompt's chained block keys:
    a match ends at the first block not held)."""
    n = 0
    for key in keys:
        if key not in held:
            break
        n += 1
    return n

class BlockLRU:
    """The keys one replica's cache probably holds, at most `capacity` of them."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self._keys: OrderedDict[int, None] = OrderedDict()  # oldest first

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: int) -> bool:
        return key in self._keys

    def match(self, keys: Sequence[int]) -> int:
        """How many leading keys of a prompt this replica holds."""
        return leading_matches(keys, self._keys)

    def record(self, keys: Sequence[int]) -> None:
        """The replica has just been given this prompt: its keys are the newest,
        the first one newest of all; the oldest keys beyond capacity go."""
        held = self._keys
        for key in reversed(keys[:self.capacity]):  # a prompt longer than the cache: its start
            held[key] = None
            held.move_to_end(key)
        while len(held) > self.capacity:
            held.popitem(last=False)

    def clear(self) -> None:
        self._keys.clear()
