"""Which replica takes the next job: one policy object per executor.

The executor asks `choose` whenever it has a job and some replica may have a
free slot; the policy sees the replicas and the job and answers one replica
with a free slot, or None. A policy that keeps per-replica state (what a
replica's cache holds) is told when a replica restarts (`forget`) and when a
job ends (`finished`).

Per model, `routing` picks the policy:
- least_inflight: least occupancy (inflight / effective capacity), round-robin among equals.
- prefix: the free replica whose prompt cache probably holds the longest prefix
  of the prompt (prefix_index), if that is at least CACHE_THRESHOLD of it. For
  a replica whose engine reports its cache (vLLM's KV events: kv_index) and a
  job whose token ids the pool has, the engine's own blocks are matched
  instead (exact); any gap falls back to the approximate index, which is kept
  either way: no token ids (that job), lost events (that replica, where the
  approximate index claims more). A KvEvents message is applied a bounded piece
  a loop turn (kv_index.APPLY_*_PER_STEP), in order with the messages after it;
  a prompt is matched by its first blocks (kv_index.MAX_MATCH_*), and its share
  is of those.
- session: the replica a session key (a client's session header, else prompt_cache_key,
  else user) hashes to,
  by rendezvous hashing over the ready replicas: when one leaves, only its
  sessions move.
Both affinities yield to the load guard (`overloaded`): the replica they want
takes the job only while its inflight exceeds the least-loaded free replica's
by at most max(1, ceil(BALANCE_ABS_SHARE x its slots)) jobs, or by at most
BALANCE_REL times. Past both, or when it has no free slot, the least-loaded
replica takes it (a balance fallback): a flood of one conversation spreads.

Whatever the policy, each replica's prompt and cached tokens (from the
runtime's usage) are counted, for the hit ratio operators see."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence
from enum import StrEnum
from typing import Protocol

from protocol import Done
from supervisor.scheduling.jobs import Job
from supervisor.scheduling.kv_index import APPLY_BLOCKS_PER_STEP, APPLY_TOKENS_PER_STEP, ExactIndex, token_block_keys
from supervisor.scheduling.prefix_index import BLOCK_CHARS, CHARS_PER_TOKEN, BlockLRU, canonical_prompt, prompt_blocks
from supervisor.replicas.replica import Replica
from supervisor.states import REPLICA_READY

ROUTINGS = ("least_inflight", "prefix", "session")
# SGLang's router anchors these (64 requests absolute, 1.5 relative, 0.3 cache threshold); its
# workers queue hundreds of requests, a replica here at most its slots: the absolute bound is
# a share of the slots.
BALANCE_ABS_SHARE = 0.25
BALANCE_REL = 1.5
CACHE_THRESHOLD = 0.3  # share of the prompt's blocks a replica must hold to be preferred
DEFAULT_CACHE_TOKENS = 32768  # a replica's cache when neither the runtime nor the config says
MAX_EXACT_BLOCKS = 262_144  # engine blocks one replica's exact index follows (4M tokens at 16 a block)


class Decision(StrEnum):
    PREFIX_HIT = "prefix_hit"  # the replica that holds the longest prefix
    SESSION = "session"  # the replica the session key hashes to
    BALANCE_FALLBACK = "balance_fallback"  # that replica was full or past the load guard: the least-loaded
    LEAST_INFLIGHT = "least_inflight"  # nothing to go on (or routing = "least_inflight")


class ReplicaChoice(Protocol):
    decisions: dict[Decision, int]

    def choose(self, replicas: Sequence[Replica], job: Job) -> Replica | None:
        """A replica with a free slot for `job`, or None if none has one."""

    def forget(self, replica: Replica) -> None:
        """The replica restarted or stopped: whatever was known of it is gone."""

    def finished(self, replica: Replica, job: Job) -> None:
        """`job` ended on `replica` (the answer's usage is on the job)."""

    def replica_view(self, replica: Replica) -> dict:
        """What the policy knows of a replica, for /admin/workers and /metrics."""

    def kv_events(self, replica: Replica, events: list, reset: bool) -> None:
        """The replica's engine reports what its cache stored and dropped (protocol.KvEvents)."""


def overloaded(wanted: Replica, least: Replica) -> bool:
    """The load guard: `wanted` is too much busier than `least` to take one more."""
    a, b = len(wanted.inflight), len(least.inflight)
    return a - b > max(1, math.ceil(BALANCE_ABS_SHARE * wanted.capacity)) and a > BALANCE_REL * b


def session_key(request: dict) -> str | None:
    """The request's session: OpenAI's prompt_cache_key, else its user. (A
    Responses previous_response_id never gets here: the pool stores no
    responses and refuses it.)"""
    for field in ("prompt_cache_key", "user"):
        value = request.get(field)
        if isinstance(value, str) and value:
            return value
    return None


class _Policy:
    """Least-inflight, the decision counters and each replica's cache figures."""

    routing = "least_inflight"

    def __init__(self) -> None:
        self._rr = 0  # the replica index a tie goes to first
        self.decisions = dict.fromkeys(Decision, 0)  # over the model's replicas
        self._decided: dict[int, dict[Decision, int]] = {}  # replica index -> the decisions that chose it
        self._tokens: dict[int, list[int]] = {}  # replica index -> [prompt tokens, of them cached]

    def least_loaded(self, replicas: Sequence[Replica]) -> Replica | None:
        """Least occupancy (inflight / effective capacity) among replicas with a free slot,
        the earliest from the round-robin cursor among equals."""
        n = len(replicas)
        best, best_key = None, None
        for offset in range(n):
            r = replicas[(self._rr + offset) % n]
            if r.free_slots <= 0:
                continue
            key = len(r.inflight) / r.capacity
            if best_key is None or key < best_key:
                best, best_key = r, key
        return best

    def _take(self, replicas: Sequence[Replica], replica: Replica, decision: Decision) -> Replica:
        self._rr = (replica.index + 1) % len(replicas)
        self.decisions[decision] += 1
        decided = self._decided.get(replica.index)
        if decided is None:
            decided = self._decided[replica.index] = dict.fromkeys(Decision, 0)
        decided[decision] += 1
        return replica

    def forget(self, replica: Replica) -> None:
        pass

    def kv_events(self, replica: Replica, events: list, reset: bool) -> None:
        pass  # only the prefix policy reads them

    def finished(self, replica: Replica, job: Job) -> None:
        done = job.events[-1] if job.events else None  # the Done was put there just now
        if isinstance(done, Done) and done.usage.get("input_tokens"):
            tokens = self._tokens.setdefault(replica.index, [0, 0])
            tokens[0] += int(done.usage["input_tokens"])
            tokens[1] += int(done.usage.get("cached_tokens") or 0)

    def replica_view(self, replica: Replica) -> dict:
        prompt, cached = self._tokens.get(replica.index, (0, 0))
        decided = self._decided.get(replica.index) or dict.fromkeys(Decision, 0)
        return {"routing": self.routing, "decisions": {d.value: n for d, n in decided.items()},
                "prompt_tokens": prompt, "cached_tokens": cached,
                "cache_hit_ratio": round(cached / prompt, 4) if prompt else None}


class LeastInflight(_Policy):
    """Least occupancy (inflight / effective capacity), round-robin among equals."""

    def choose(self, replicas: Sequence[Replica], job: Job) -> Replica | None:
        best = self.least_loaded(replicas)
        return None if best is None else self._take(replicas, best, Decision.LEAST_INFLIGHT)


class PrefixAffinity(_Policy):
    """The free replica that holds the longest prefix of the prompt: exactly, from
    the engine's events, where it reports them and the job has token ids; else
    probably, from the approximate index."""

    routing = "prefix"

    def __init__(self, cache_tokens: int | None = None) -> None:
        super().__init__()
        self.cache_tokens = cache_tokens  # per replica; None: from the runtime (slots x context)
        self._index: dict[int, tuple[str, BlockLRU]] = {}  # replica index -> (its worker's identity, keys)
        self._exact: dict[int, tuple[str, ExactIndex]] = {}  # replica index -> (identity, engine blocks)
        # per replica index: how its match was judged; "approximate_fallback": it reports its
        # cache but the job had no token ids (the tokenize call failed or timed out), or its
        # events had a gap and the approximate index claimed more
        self._matched: dict[int, dict[str, int]] = {}

    def _lru(self, replica: Replica) -> BlockLRU:
        """The replica's keys; empty for a new worker (a restart cleared its cache,
        even if the event that says so was missed)."""
        entry = self._index.get(replica.index)
        if entry is None or entry[0] != replica.identity:
            entry = self._index[replica.index] = (replica.identity, BlockLRU(self._capacity(replica)))
        return entry[1]

    def exact(self, replica: Replica) -> ExactIndex | None:
        """The engine's blocks, for a replica whose worker relays its KV events (its
        Ready info says so); a new worker starts empty."""
        if not (isinstance(replica.info, dict) and replica.info.get("kv_events")):
            return None
        entry = self._exact.get(replica.index)
        if entry is None or entry[0] != replica.identity:
            entry = self._exact[replica.index] = (replica.identity, ExactIndex(MAX_EXACT_BLOCKS))
        return entry[1]

    def kv_events(self, replica: Replica, events: list, reset: bool) -> None:
        """Queued behind those not yet applied; the first piece now, unless a later
        loop turn already takes the next."""
        index = self.exact(replica)
        if index is not None:
            index.feed(events, reset)
            if not index.draining:
                self._drain(replica.index, index)

    def _drain(self, slot: int, index: ExactIndex) -> None:
        """One bounded step of the index's queue; the next in the next loop turn."""
        index.draining = False
        entry = self._exact.get(slot)
        if entry is None or entry[1] is not index:  # the worker restarted: its events are moot
            return
        if not index.step(APPLY_BLOCKS_PER_STEP, APPLY_TOKENS_PER_STEP):
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop (a tool, a test): no turn to hold
            while index.step():
                pass
            return
        index.draining = True
        loop.call_soon(self._drain, slot, index)

    def _capacity(self, replica: Replica) -> int:
        """Blocks in the replica's cache: the configured tokens, else the runtime's
        context per slot x slots (llama-server reports both), else a default."""
        tokens = self.cache_tokens
        per_slot = replica.info.get("n_ctx_per_slot") if isinstance(replica.info, dict) else None
        if tokens is None and isinstance(per_slot, int) and replica.runtime_capacity:
            tokens = per_slot * replica.runtime_capacity
        return max(1, (tokens or DEFAULT_CACHE_TOKENS) * CHARS_PER_TOKEN // BLOCK_CHARS)

    def blocks(self, job: Job) -> list[int]:
        key = job.request.get("prompt_cache_key")
        return prompt_blocks(canonical_prompt(job.request, job.endpoint), key if isinstance(key, str) else None)

    def _share(self, replica: Replica, job: Job, keys: list[int], token_keys: dict) -> float:
        """The share of the prompt the replica's cache holds: from the engine's
        blocks where it can be, else from the approximate index."""
        matched = self._matched.setdefault(replica.index, {"exact": 0, "approximate": 0,
                                                           "approximate_fallback": 0})
        exact = self.exact(replica)

        def approximate() -> float:
            return self._lru(replica).match(keys) / len(keys) if keys else 0.0

        prompt_tokens = job.admitted.prompt_tokens
        if exact is None or prompt_tokens is None:
            matched["approximate_fallback" if exact is not None else "approximate"] += 1
            return approximate()
        share = 0.0
        size = exact.block_size  # None: it has stored nothing yet
        if size is not None:
            if size not in token_keys:  # of the prompt's first blocks only: a longer prefix counts as those
                token_keys[size] = token_block_keys(prompt_tokens, size)
            total = len(token_keys[size])
            share = exact.match(token_keys[size]) / total if total else 0.0
        if exact.resets:  # events were lost: what it held before the gap is known only approximately
            guess = approximate()
            if guess > share:
                matched["approximate_fallback"] += 1
                return guess
        matched["exact"] += 1
        return share

    def choose(self, replicas: Sequence[Replica], job: Job) -> Replica | None:
        least = self.least_loaded(replicas)
        if least is None:
            return None
        keys = self.blocks(job)
        decision, chosen = Decision.LEAST_INFLIGHT, least
        if keys or job.admitted.prompt_tokens:
            token_keys: dict[int, list[int]] = {}  # block size -> the prompt's token block keys
            best, best_share, full_share = None, 0.0, 0.0
            n_replicas = len(replicas)
            for offset in range(n_replicas):  # from the round-robin cursor: equal matches take turns
                r = replicas[(self._rr + offset) % n_replicas]
                if r.state is not REPLICA_READY:
                    continue
                share = self._share(r, job, keys, token_keys)
                if share <= 0 or share < CACHE_THRESHOLD:
                    continue
                if r.free_slots <= 0:  # holds it, but is full
                    full_share = max(full_share, share)
                elif share > best_share or (share == best_share and len(r.inflight) / r.capacity
                                            < len(best.inflight) / best.capacity):
                    best, best_share = r, share
            if best is not None and not overloaded(best, least):
                decision, chosen = Decision.PREFIX_HIT, best
            elif best is not None or full_share:
                decision = Decision.BALANCE_FALLBACK
            if keys:
                self._lru(chosen).record(keys)
        return self._take(replicas, chosen, decision)

    def forget(self, replica: Replica) -> None:
        self._index.pop(replica.index, None)
        self._exact.pop(replica.index, None)

    def replica_view(self, replica: Replica) -> dict:
        entry = self._index.get(replica.index)
        lru = entry[1] if entry and entry[0] == replica.identity else None
        view = {**super().replica_view(replica), "prefix_blocks": len(lru) if lru else 0,
                "prefix_capacity_blocks": lru.capacity if lru else self._capacity(replica),
                "prefix_matches": dict(self._matched.get(replica.index) or {})}
        exact = self._exact.get(replica.index)
        if exact is not None and exact[0] == replica.identity:
            x = exact[1]
            view["kv_index"] = {"blocks": len(x), "block_size": x.block_size, "stored": x.stored,
                                "removed": x.removed, "cleared": x.cleared, "resets": x.resets,
                                "malformed": x.malformed, "queued": x.queued}  # queued: events not yet applied
        return view


class SessionAffinity(_Policy):
    """The ready replica a session key hashes to (rendezvous hashing)."""

    routing = "session"

    @staticmethod
    def owner(replicas: Sequence[Replica], key: str) -> Replica | None:
        ready = [r for r in replicas if r.state is REPLICA_READY]
        return max(ready, key=lambda r: hash((key, r.index)), default=None)

    def choose(self, replicas: Sequence[Replica], job: Job) -> Replica | None:
        least = self.least_loaded(replicas)
        if least is None:
            return None
        key = job.admitted.session or session_key(job.request)
        if key is None:
            return self._take(replicas, least, Decision.LEAST_INFLIGHT)
        owner = self.owner(replicas, key)
        if owner is not None and owner.free_slots > 0 and not overloaded(owner, least):
            return self._take(replicas, owner, Decision.SESSION)
        return self._take(replicas, least, Decision.BALANCE_FALLBACK)


def make_replica_choice(routing: str = "least_inflight", cache_tokens: int | None = None) -> ReplicaChoice:
    if routing == "least_inflight":
        return LeastInflight()
    if routing == "prefix":
        return PrefixAffinity(cache_tokens)
    if routing == "session":
        return SessionAffinity()
    raise ValueError(f"unknown routing {routing!r}")
