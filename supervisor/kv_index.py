"""What one replica's prefix cache holds, as its engine says: the exact index.

A vLLM worker relays the engine's KV-cache events (protocol.KvEvents): blocks
stored, with their token ids and parent block, and blocks removed. The engine's
block hashes are its own (a hash it may seed or salt); the pool does not
recompute them. Each stored block is keyed here by a hash chained over the
token ids of it and of every block before it (its parent's key): a request
tokenized by the same engine (`/tokenize`) is cut into the same blocks and
keyed the same way, so the longest run of its leading keys that the index
holds is the prefix the engine would reuse, in blocks.

A block the engine hashed with more than its tokens (a LoRA, images, a cache
salt) cannot be matched from tokens alone: it and every block after it are held
unmatchable. A block whose parent is unknown (stored before a reset) likewise.
Bounded: at most `max_blocks` blocks; past that the oldest stored go first (a
forgotten block only makes the index claim less than the engine holds).
Pure: no I/O, no clock."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from supervisor.prefix_index import leading_matches

_ROOT = hash(("kv-root",))  # the parent key of a prompt's first block


def token_block_keys(tokens: Sequence[int], block_size: int) -> list[int]:
    """Chained keys of the full blocks of `tokens`: key i covers blocks 0..i."""
    key, keys = _ROOT, []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        key = hash((key, tuple(tokens[start:start + block_size])))
        keys.append(key)
    return keys


class ExactIndex:
    def __init__(self, max_blocks: int) -> None:
        self.max_blocks = max(1, max_blocks)
        self.block_size: int | None = None  # the engine's, from its first stored block
        self._blocks: OrderedDict[bytes | int, int | None] = OrderedDict()  # engine hash -> key (None: unmatchable)
        self._keys: dict[int, int] = {}  # key -> how many engine blocks have it
        self.stored = self.removed = self.cleared = self.resets = self.malformed = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def apply(self, events: list, reset: bool = False) -> None:
        """The engine's events, in order. `reset`: some before these were lost, so
        what the index held is dropped (it may be wrong); blocks stored from now on
        are known again. A malformed event is counted and skipped."""
        if reset:
            self.resets += 1
            self._clear()
        for event in events:
            try:
                self._apply(event)
            except (TypeError, ValueError, LookupError):  # LookupError: an item that is a map, not a list
                self.malformed += 1

    def _apply(self, event) -> None:
        kind = event[0]
        if kind == "stored":
            _, hashes, parent, tokens, size, extra = event
            if type(size) is not int or size <= 0 or len(tokens) != len(hashes) * size:
                raise ValueError("stored blocks and token ids disagree")
            if self.block_size is None:
                self.block_size = size
            key = _ROOT if parent is None else self._blocks.get(parent)
            for i, engine_hash in enumerate(hashes):
                # a partial block (another size) is no block a prompt is cut into: unmatchable
                if key is not None and not extra and size == self.block_size:
                    key = hash((key, tuple(tokens[i * size:(i + 1) * size])))
                else:
                    key = None
                self._put(engine_hash, key)
                self.stored += 1
        elif kind == "removed":
            for engine_hash in event[1]:
                self._drop(engine_hash)
                self.removed += 1
        elif kind == "cleared":
            self.cleared += 1
            self._clear()
        else:
            raise ValueError(f"unknown event {kind!r}")

    def _put(self, engine_hash, key: int | None) -> None:
        if engine_hash in self._blocks:
            self._drop(engine_hash)
        self._blocks[engine_hash] = key
        if key is not None:
            self._keys[key] = self._keys.get(key, 0) + 1
        while len(self._blocks) > self.max_blocks:
            self._drop(next(iter(self._blocks)))

    def _drop(self, engine_hash) -> None:
        key = self._blocks.pop(engine_hash, None)
        if key is not None:
            n = self._keys[key] - 1
            if n:
                self._keys[key] = n
            else:
                del self._keys[key]

    def _clear(self) -> None:
        self._blocks.clear()
        self._keys.clear()

    def match(self, keys: Sequence[int]) -> int:
        """How many leading blocks of a prompt (token_block_keys) the engine holds."""
        return leading_matches(keys, self._keys)
