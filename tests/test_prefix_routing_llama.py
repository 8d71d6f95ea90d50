"""Cache-aware replica choice end to end: real llama-server replicas of the
tiny GGUF, one slot each. The prefill the runtimes computed is read from their
own usage (prompt tokens minus cached tokens), never from the pool's guess."""

from __future__ import annotations

import random

import pytest

from tests.conftest import llama
from tests.pool import wait_for

pytestmark = pytest.mark.llama

WORDS = ("the", "pool", "model", "token")  # about a token a character in the tiny GGUF's vocabulary
CONVERSATIONS, TURNS = 3, 4
MAX_RATIO_PREFIX = 1.15  # the bound; least_inflight computes each prefix once per replica (~1.95)


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def conversation_workload(pool, model: str, seed: int = 0, **extra) -> tuple[int, int, list[int]]:
    """The issue's workload: CONVERSATIONS conversations, each with its own
    ~1,000-token system prompt, TURNS turns each, in a shuffled order, one at
    a time. Returns (prompt tokens computed, the minimum, the replica that
    served each turn). The answers in the history are fixed text, so each
    turn's prompt extends the last one: the minimum is each conversation's
    last prompt, computed once."""
    rng = random.Random(seed)
    history = {c: [{"role": "system", "content": words(rng, 200)}] for c in range(CONVERSATIONS)}
    order = [c for c in range(CONVERSATIONS) for _ in range(TURNS)]
    rng.shuffle(order)
    computed, last_prompt, served = 0, {}, []
    for c in order:
        history[c].append({"role": "user", "content": words(rng, 10)})
        before = {w["replica"]: sum(w["routing"]["decisions"].values()) for w in pool.workers()}
        r = pool.http.post("/v1/chat/completions", json={"model": model, "messages": history[c], "max_tokens": 2,
                                                         **extra}, timeout=120)
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        computed += usage["prompt_tokens"] - cached
        last_prompt[c] = usage["prompt_tokens"]
        history[c].append({"role": "assistant", "content": words(rng, 8)})
        after = {w["replica"]: sum(w["routing"]["decisions"].values()) for w in pool.workers()}
        served.append(next(i for i in after if after[i] != before.get(i)))
    return computed, sum(last_prompt.values()), served


def two_replicas(tiny_gguf, llama_server_bin, routing: str) -> dict:
    return llama("tiny", tiny_gguf, llama_server_bin, slots=1, ctx=4096, replicas=2, routing=routing)


def test_prefix_routing_computes_each_prefix_once(make_pool, tiny_gguf, llama_server_bin):
    pool = make_pool([two_replicas(tiny_gguf, llama_server_bin, "prefix")])
    computed, minimum, served = conversation_workload(pool, "tiny")
    ratio = computed / minimum
    print(f"prefix routing: {computed} prompt tokens computed, minimum {minimum}: {ratio:.2f}x")
    assert ratio <= MAX_RATIO_PREFIX, (computed, minimum, served)
    workers = pool.workers()
    hits = sum(w["routing"]["decisions"]["prefix_hit"] for w in workers)
    assert hits == CONVERSATIONS * (TURNS - 1)  # every turn after a conversation's first
    assert all(w["routing"]["cache_hit_ratio"] > 0.5 for w in workers), workers
    assert all(w["routing"]["prefix_blocks"] > 0 for w in workers)


def test_a_session_key_sticks_and_a_restart_drops_the_index(make_pool, tiny_gguf, llama_server_bin):
    pool = make_pool([two_replicas(tiny_gguf, llama_server_bin, "session")])
    rng = random.Random(3)
    served = set()
    for _ in range(4):  # different prompts, one key: one replica
        r = pool.http.post("/v1/chat/completions", json={
            "model": "tiny", "prompt_cache_key": "conv-1", "max_tokens": 2,
            "messages": [{"role": "user", "content": words(rng, 20)}]}, timeout=120)
        assert r.status_code == 200, r.text
        served |= {w["replica"] for w in pool.workers() if w["routing"]["decisions"]["session"]}
    assert len(served) == 1
    # the prefix index of a replica whose worker restarts is empty again
    pool2 = make_pool([two_replicas(tiny_gguf, llama_server_bin, "prefix")])
    conversation_workload(pool2, "tiny", seed=5)
    held = {w["replica"]: w["routing"]["prefix_blocks"] for w in pool2.workers()}
    assert all(held.values()), held
    r = pool2.http.post("/admin/models/tiny/restart", params={"replica": 0}, timeout=120)
    assert r.status_code == 200, r.text
    wait_for(lambda: all(w["state"] == "ready" for w in pool2.workers()), 60, what="replica 0 ready again")
    views = {w["replica"]: w["routing"] for w in pool2.workers()}
    assert views[0]["prefix_blocks"] == 0 and views[1]["prefix_blocks"] == held[1]


def test_least_inflight_computes_prefixes_on_every_replica(make_pool, tiny_gguf, llama_server_bin):
    """The baseline the issue measured: without affinity, each replica computes the
    prefixes again (the ratio approaches the replica count)."""
    pool = make_pool([two_replicas(tiny_gguf, llama_server_bin, "least_inflight")])
    computed, minimum, served = conversation_workload(pool, "tiny")
    ratio = computed / minimum
    print(f"least_inflight: {computed} prompt tokens computed, minimum {minimum}: {ratio:.2f}x")
    assert ratio > MAX_RATIO_PREFIX  # what the prefix test's bound is measured against
