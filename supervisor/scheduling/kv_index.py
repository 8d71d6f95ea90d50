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

The supervisor's event loop runs all of this, so no one call may hold it long
(issue 33: one message of the largest kind held it ~0.6 s, one 1M-token match
~0.4 s). Events are queued (`feed`) and applied a bounded piece at a time
(`step`): a stored event may be cut between two blocks, its next block chained
on as if it had not been. A prompt is matched by its first blocks only
(`token_block_keys`): a longer prefix counts as that cap. Pure: no I/O, no
clock; the caller decides when the next piece runs."""

from __future__ import annotations

import sys
from collections import OrderedDict, deque
from collections.abc import Sequence
from itertools import islice

from supervisor.scheduling.prefix_index import leading_matches

_ROOT = hash(("kv-root",))  # the parent key of a prompt's first block
_RESET = ("reset",)  # queued where a message says events before it were lost

# Loop-time bounds (issue 33; measured on a 2-core machine, CPython 3.11): applying costs ~1-2 µs a
# block plus ~10 ns a token hashed, matching ~0.3 µs a block plus ~10 ns a token, so that a piece of
# either holds the event loop a few ms. (The index's own dicts still resize now and then as blocks come
# and go: ~20-40 ms at MAX_EXACT_BLOCKS, once per some 10^5 blocks stored, whatever the message.)
APPLY_BLOCKS_PER_STEP = 2048  # blocks stored or removed in one step (~2-4 ms); the rest in later turns
APPLY_TOKENS_PER_STEP = 131_072  # token ids hashed in one step (~1.5 ms): a step ends at whichever comes first
MAX_MATCH_BLOCKS = 8192  # a prompt is matched by its first 8,192 blocks at most (~2.5 ms at 1 token a block)...
MAX_MATCH_TOKENS = 131_072  # ...and its first 131,072 tokens at most: all of a 128K-token prompt at vLLM's
# default 16 tokens a block. A longer prefix held counts as the cap (replicas that hold more than it tie:
# the lighter-loaded one wins). A block of more tokens than this is stored unmatchable, unhashed (no
# prompt's keys reach it), so that no one block costs a step more than the cap.
MAX_QUEUED_EVENTS = 4096  # events fed, not yet applied (16 full messages): an engine that outruns the
# steps this far is treated as a gap (the queue dropped, the index reset), as the relay treats its own backlog


def token_block_keys(tokens: Sequence[int], block_size: int) -> list[int]:
    """Chained keys of the full blocks of `tokens`, key i covering blocks 0..i: of its
    first blocks only, at most MAX_MATCH_BLOCKS and MAX_MATCH_TOKENS tokens of them."""
    key, keys = _ROOT, []
    end = min(len(tokens), MAX_MATCH_TOKENS, MAX_MATCH_BLOCKS * block_size)
    for start in range(0, end - block_size + 1, block_size):
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
        self._queue: deque = deque()  # events fed, not yet applied, oldest first
        self._cursor: tuple[int, int | None] | None = None  # the head event, part applied: (next block, key)
        self.draining = False  # its owner has a later loop turn take the next step

    def __len__(self) -> int:
        return len(self._blocks)

    @property
    def queued(self) -> int:
        """Events fed and not yet (all) applied."""
        return len(self._queue)

    def apply(self, events: list, reset: bool = False) -> None:
        """`feed`, then every step at once (for a caller that has no loop turn to keep short)."""
        self.feed(events, reset)
        while self.step():
            pass

    def feed(self, events: list, reset: bool = False) -> None:
        """The engine's events, in order, queued behind those not yet applied (`step`
        applies them). `reset`: some before these were lost, so what the index held
        is dropped (it may be wrong); blocks stored from then on are known again.
        Past MAX_QUEUED_EVENTS queued, those are dropped, as lost."""
        if len(self._queue) > MAX_QUEUED_EVENTS:
            self._queue.clear()
            self._cursor = None
            reset = True
        if reset:
            self._queue.append(_RESET)
        self._queue.extend(events)

    def step(self, max_blocks: int = sys.maxsize, max_tokens: int = sys.maxsize) -> bool:
        """Apply queued events, in order, until `max_blocks` blocks are stored or removed
        or `max_tokens` token ids hashed (at least one block: a block is not cut); an
        event of no blocks counts as one. A malformed event is counted and skipped.
        True while some remain queued."""
        queue, blocks, tokens = self._queue, 0, 0
        while queue and blocks < max_blocks and tokens < max_tokens:
            try:
                did_blocks, did_tokens, done = self._apply(queue[0], max_blocks - blocks, max_tokens - tokens)
            except (TypeError, ValueError, LookupError):  # LookupError: an item that is a map, not a list
                self.malformed += 1
                did_blocks, did_tokens, done = 0, 0, True
            blocks += max(1, did_blocks)
            tokens += did_tokens
            if done:
                queue.popleft()
                self._cursor = None
        return bool(queue)

    def _apply(self, event, max_blocks: int, max_tokens: int) -> tuple[int, int, bool]:
        """Apply (some of) `event`: (blocks, tokens hashed, whether it is done)."""
        if event is _RESET:
            self.resets += 1
            self._clear()
            return 0, 0, True
        kind = event[0]
        if kind == "stored":
            _, hashes, parent, tokens, size, extra = event
            if self._cursor is None:  # its first piece
                if type(size) is not int or size <= 0 or len(tokens) != len(hashes) * size:
                    raise ValueError("stored blocks and token ids disagree")
                if self.block_size is None:
                    self.block_size = size
                start, key = 0, _ROOT if parent is None else self._blocks.get(parent)
            else:  # where the last step stopped, chained on its last key (its block may be evicted since)
                start, key = self._cursor
            # a partial block (another size) is no block a prompt is cut into, nor one past the match cap:
            # unmatchable, as every block after it
            keyed = key is not None and not extra and size == self.block_size and size <= MAX_MATCH_TOKENS
            n = min(len(hashes) - start, max_blocks, max(1, max_tokens // size) if keyed else max_blocks)
            for i, engine_hash in enumerate(islice(hashes, start, start + n), start):
                key = hash((key, tuple(tokens[i * size:(i + 1) * size]))) if keyed else None
                self._put(engine_hash, key)
                self.stored += 1
            done = start + n == len(hashes)
            self._cursor = None if done else (start + n, key)
            return n, n * size if keyed else 0, done
        if kind == "removed":
            hashes = event[1]
            start = 0 if self._cursor is None else self._cursor[0]
            n = min(len(hashes) - start, max_blocks)
            for engine_hash in islice(hashes, start, start + n):
                self._drop(engine_hash)
                self.removed += 1
            done = start + n == len(hashes)
            self._cursor = None if done else (start + n, None)
            return n, 0, done
        if kind == "cleared":
            self.cleared += 1
            self._clear()
            return 0, 0, True
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
