"""Replica choice as pure logic: the prefix index (blocks, LRU), the prefix and
session policies (affinity, load guard, restart, consistent hashing) and the
routing keys of the config. The replicas are plain records with the fields a
policy reads; end to end on real llama-server replicas: test_prefix_routing_llama."""

from __future__ import annotations

import random
import time

import pytest

from protocol import Done
from supervisor.config import ConfigError, parse_config
from supervisor.scheduling.jobs import Job
from supervisor.scheduling.prefix_index import BLOCK_CHARS, BlockLRU, canonical_prompt, prompt_blocks
from supervisor.scheduling.replica_choice import (
    Decision, LeastInflight, PrefixAffinity, SessionAffinity, make_replica_choice, overloaded, session_key)
from supervisor.states import ReplicaState


class Rep:
    """What a policy reads of a replica."""

    def __init__(self, index: int, capacity: int = 1, n_ctx: int | None = 4096) -> None:
        self.index = index
        self.identity = f"m/{index}#1"
        self.state = ReplicaState.READY
        self.capacity = capacity
        self.runtime_capacity = capacity
        self.info = {"n_ctx_per_slot": n_ctx} if n_ctx else {}
        self.inflight: dict[str, Job] = {}

    @property
    def free_slots(self) -> int:
        return self.capacity - len(self.inflight) if self.state is ReplicaState.READY else 0


def chat(system: str, *turns: str, **extra) -> Job:
    messages = [{"role": "system", "content": system}]
    for i, t in enumerate(turns):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": t})
    return Job("m", {"messages": messages, **extra}, 60)


def run(policy, replicas, job) -> Rep | None:
    """Choose, and hold the slot as the executor would."""
    r = policy.choose(replicas, job)
    if r is not None:
        r.inflight[job.id] = job
    return r


def end(policy, r: Rep, job: Job, usage: dict | None = None) -> None:
    del r.inflight[job.id]
    job.finish(Done(job=job.id, finish_reason="stop", usage=usage or {}))
    policy.finished(r, job)


SYSTEMS = ["You are agent %d. " % i + "".join(random.Random(i).choice("abcdefgh ") for _ in range(4000))
           for i in range(3)]


# -- blocks ------------------------------------------------------------------------------------------
def test_blocks_are_chained_over_full_blocks():
    text = "x" * (BLOCK_CHARS * 3 + 5)
    keys = prompt_blocks(text)
    assert len(keys) == 3  # the partial last block has no key
    assert len(set(keys)) == 3  # same characters, different prefixes: different keys
    changed = "y" + text[1:]
    assert not set(prompt_blocks(changed)) & set(keys)  # a change in block 0 changes every key after it
    later = text[:BLOCK_CHARS * 2] + "z" + text[BLOCK_CHARS * 2 + 1:]
    assert prompt_blocks(later)[:2] == keys[:2] and prompt_blocks(later)[2] != keys[2]
    assert prompt_blocks(text + "more" * 100)[:3] == keys  # a longer prompt extends the chain
    assert not set(prompt_blocks(text, seed="conv-1")) & set(keys)  # a cache key starts another chain
    assert prompt_blocks(text, seed="conv-1") == prompt_blocks(text, seed="conv-1")
    assert prompt_blocks("short") == []


def test_canonical_prompt_keeps_what_the_template_renders():
    base = {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]}
    text = canonical_prompt(base)
    assert "hi" in text and "s" in text
    assert canonical_prompt({**base, "messages": base["messages"] + [{"role": "assistant", "content": "yo"}]}
                            ).startswith(text)  # a conversation's next turn extends its prompt
    assert canonical_prompt({"messages": [{"role": "user", "content": "s"}, base["messages"][1]]}) != text
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert not canonical_prompt({**base, "tools": tools}).startswith(text)  # tools render first
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "abc"}]}]}
    assert "abc" in canonical_prompt(parts)
    assert canonical_prompt({"prompt": "plain"}, "completions") == "plain"
    assert canonical_prompt({"input": "x"}, "embeddings") == ""


# -- the LRU -------------------------------------------------------------------------------------
def test_lru_matches_leading_blocks_and_evicts_tails_first():
    lru = BlockLRU(capacity=6)
    a, b = prompt_blocks("a" * BLOCK_CHARS * 4), prompt_blocks("b" * BLOCK_CHARS * 4)
    lru.record(a)
    assert lru.match(a) == 4 and lru.match(b) == 0
    assert lru.match(prompt_blocks("a" * BLOCK_CHARS * 6)) == 4  # the longer prompt's first four
    lru.record(b)  # 8 keys for 6 places: a's two deepest go, its root stays
    assert len(lru) == 6
    assert lru.match(b) == 4 and lru.match(a) == 2
    lru.record(a[:1])  # touched: a's root is now the newest
    lru.record(prompt_blocks("c" * BLOCK_CHARS * 5))
    assert lru.match(a) == 1 and lru.match(b) == 0
    lru.record(prompt_blocks("d" * BLOCK_CHARS * 50))  # longer than the cache: its start is kept
    assert lru.match(prompt_blocks("d" * BLOCK_CHARS * 50)) == 6
    lru.clear()
    assert len(lru) == 0


# -- prefix ---------------------------------------------------------------------------------------
def test_prefix_sends_each_conversation_back_to_its_replica():
    policy = PrefixAffinity()
    replicas = [Rep(0), Rep(1)]
    home = {}
    order = [c for c in range(3) for _ in range(4)]
    random.Random(7).shuffle(order)
    turns = {c: [] for c in range(3)}
    for c in order:  # one at a time, as in the workload
        turns[c] += [f"question {len(turns[c])} of {c} " * 5, f"answer {len(turns[c])} " * 5]
        job = chat(SYSTEMS[c], *turns[c][:-1])
        r = run(policy, replicas, job)
        home.setdefault(c, r.index)
        assert r.index == home[c], f"conversation {c} moved from replica {home[c]} to {r.index}"
        end(policy, r, job)
    assert policy.decisions[Decision.PREFIX_HIT] == len(order) - 3  # all but each first turn
    assert policy.decisions[Decision.LEAST_INFLIGHT] == 3


def test_prefix_below_the_threshold_is_least_inflight():
    policy = PrefixAffinity()
    replicas = [Rep(0), Rep(1)]
    shared = "same short system prompt " * 6  # one block or so, in a long prompt
    first = chat(shared, "x" * 4000)
    r0 = run(policy, replicas, first)
    end(policy, r0, first)
    other = chat(shared, "y" * 4000)
    assert run(policy, replicas, other) is not r0  # round-robin, not the shared first block
    assert policy.decisions[Decision.LEAST_INFLIGHT] == 2


def test_prefix_falls_back_when_its_replica_is_full_or_too_busy():
    policy = PrefixAffinity()
    replicas = [Rep(0, capacity=8), Rep(1, capacity=8)]
    first = chat(SYSTEMS[0], "q")
    home = run(policy, replicas, first)
    other = replicas[1 - home.index]
    # a flood of one conversation: the holder takes up to 1 + max(1, ceil(0.25 x 8)) = 3 while the other idles
    placed = [run(policy, replicas, chat(SYSTEMS[0], "q", f"a{i}", "q")) for i in range(4)]
    assert [r.index for r in placed[:2]] == [home.index] * 2
    assert placed[2] is other  # 3 on the holder, 0 elsewhere: past the guard
    assert placed[3] is other  # both hold the prefix now: the less busy one
    assert policy.decisions[Decision.BALANCE_FALLBACK] >= 1
    # a full holder: the job goes where there is room
    single = [Rep(0), Rep(1)]
    p2 = PrefixAffinity()
    held = run(p2, single, chat(SYSTEMS[1], "q"))
    again = run(p2, single, chat(SYSTEMS[1], "q", "a", "q"))
    assert again is not held and p2.decisions[Decision.BALANCE_FALLBACK] == 1
    assert run(p2, single, chat(SYSTEMS[1], "q")) is None  # no free slot anywhere


def test_overloaded_is_the_stated_bound():
    a, b = Rep(0, capacity=8), Rep(1, capacity=8)
    for i in range(2):
        a.inflight[str(i)] = None
    assert not overloaded(a, b)  # 2 - 0 <= max(1, ceil(8 / 4)) = 2
    a.inflight["2"] = None
    assert overloaded(a, b)  # 3 - 0 > 2 and 3 > 1.5 x 0
    for i in range(3):
        b.inflight[f"b{i}"] = None
    a.inflight.update({f"x{i}": None for i in range(3)})
    assert overloaded(a, b)  # 6 vs 3: 3 > 2 and 6 > 4.5
    b.inflight["b3"] = None  # 6 vs 4: 2 <= 2
    assert not overloaded(a, b)


def test_a_restarted_replica_loses_its_entries():
    policy = PrefixAffinity()
    replicas = [Rep(0), Rep(1)]
    first = chat(SYSTEMS[0], "q")
    home = run(policy, replicas, first)
    end(policy, home, first)
    home.identity = f"m/{home.index}#2"  # a new worker, even if no event said so
    run_again = chat(SYSTEMS[0], "q", "a", "q")
    r = run(policy, replicas, run_again)
    assert policy.decisions[Decision.PREFIX_HIT] == 0
    end(policy, r, run_again)
    policy.forget(r)  # the explicit hook (Replica tells its executor when a new worker starts)
    assert policy.replica_view(r)["prefix_blocks"] == 0
    third = chat(SYSTEMS[0], "q", "a", "q", "a", "q")
    run(policy, replicas, third)
    assert policy.decisions[Decision.PREFIX_HIT] == 0


def test_prefix_cache_key_separates_conversations_and_the_index_is_bounded():
    policy = PrefixAffinity(cache_tokens=1000)  # 1000 tokens ~ 4000 characters ~ 15 blocks
    replicas = [Rep(0), Rep(1)]
    job = chat(SYSTEMS[0], "q", prompt_cache_key="k1")
    r = run(policy, replicas, job)
    end(policy, r, job)
    view = policy.replica_view(r)
    assert view["prefix_blocks"] == view["prefix_capacity_blocks"] == 1000 * 4 // BLOCK_CHARS
    same = chat(SYSTEMS[0], "q", "a", "q", prompt_cache_key="k1")
    assert run(policy, replicas, same) is r
    end(policy, r, same)
    other_key = chat(SYSTEMS[0], "q", "a", "q", prompt_cache_key="k2")
    assert run(policy, replicas, other_key) is not r  # another key: no shared prefix, round-robin
    assert PrefixAffinity().replica_view(Rep(0, n_ctx=2048))["prefix_capacity_blocks"] == 2048 * 4 // BLOCK_CHARS


def test_only_ready_replicas_take_jobs():
    policy = PrefixAffinity()
    replicas = [Rep(0), Rep(1)]
    job = chat(SYSTEMS[2], "q")
    home = run(policy, replicas, job)
    end(policy, home, job)
    home.state = ReplicaState.DRAINING
    r = run(policy, replicas, chat(SYSTEMS[2], "q", "a", "q"))
    assert r is not home


# -- session -------------------------------------------------------------------------------------
def test_session_sticks_and_moves_only_the_keys_of_a_replica_that_left():
    policy = SessionAffinity()
    replicas = [Rep(i, capacity=64) for i in range(4)]
    keys = [f"user-{i}" for i in range(200)]
    first = {k: SessionAffinity.owner(replicas, k).index for k in keys}
    assert len(set(first.values())) == 4  # spread over all
    for k in keys[:20]:  # sticky, whichever field carries the key
        job = Job("m", {"messages": [{"role": "user", "content": "hi"}], "user": k}, 60)
        r = run(policy, replicas, job)
        assert r.index == first[k]
        end(policy, r, job)
    assert policy.decisions[Decision.SESSION] == 20
    replicas[2].state = ReplicaState.STOPPED
    moved = {k for k in keys if SessionAffinity.owner(replicas, k).index != first[k]}
    assert moved == {k for k in keys if first[k] == 2}  # only the keys of the replica that left
    replicas[2].state = ReplicaState.READY
    assert all(SessionAffinity.owner(replicas, k).index == first[k] for k in keys)  # and back


def test_session_key_order_and_load_guard():
    assert session_key({"prompt_cache_key": "a", "user": "b"}) == "a"
    assert session_key({"user": "b"}) == "b"
    assert session_key({"user": ""}) is None and session_key({"prompt_cache_key": 5}) is None
    policy = SessionAffinity()
    replicas = [Rep(0, capacity=4), Rep(1, capacity=4)]
    owner = SessionAffinity.owner(replicas, "k")
    placed = [run(policy, replicas, chat("s", "q", prompt_cache_key="k")) for _ in range(4)]
    assert [r is owner for r in placed] == [True, True, False, True]  # guard: 2 - 0 > max(1, 1) at the third
    assert policy.decisions[Decision.BALANCE_FALLBACK] == 1
    assert run(policy, replicas, chat("s", "q")) is not None
    assert policy.decisions[Decision.LEAST_INFLIGHT] == 1


# -- shared --------------------------------------------------------------------------------------
def test_hit_ratio_comes_from_the_runtimes_usage():
    policy = LeastInflight()
    r = Rep(0)
    for usage in ({"input_tokens": 1000, "output_tokens": 5},
                  {"input_tokens": 1100, "output_tokens": 5, "cached_tokens": 990}):
        job = chat("s", "q")
        run(policy, [r], job)
        end(policy, r, job, usage)
    view = policy.replica_view(r)
    assert (view["prompt_tokens"], view["cached_tokens"], view["cache_hit_ratio"]) == (2100, 990,
                                                                                      round(990 / 2100, 4))
    assert view["routing"] == "least_inflight" and view["decisions"]["least_inflight"] == 2
    assert policy.decisions[Decision.LEAST_INFLIGHT] == 2


def test_config_routing_keys():
    def model(**keys):
        cfg = parse_config({"models": [{"name": "m", "backend": "llama_server", "options": {"model": "x.gguf"},
                                        **keys}]})
        return cfg.models[0]
    assert model().replica_routing == "least_inflight"  # one replica
    assert model(replicas=2).replica_routing == "prefix"
    assert model(replicas=2, routing="session").replica_routing == "session"
    assert model(replicas=2, routing="least_inflight").replica_routing == "least_inflight"
    synthetic = parse_config({"models": [{"name": "s", "backend": "synthetic", "replicas": 3}]}).models[0]
    assert synthetic.replica_routing == "least_inflight"
    assert model(prefix_cache_tokens=4096).prefix_cache_tokens == 4096
    with pytest.raises(ConfigError, match="routing"):
        model(routing="random")
    with pytest.raises(ConfigError, match="prefix_cache_tokens"):
        model(prefix_cache_tokens=0)
    for routing in ("least_inflight", "prefix", "session"):
        assert make_replica_choice(routing) is not None


def test_routing_cost_is_measured():
    """Per-request cost of each policy on a unique 8,000-character prompt, 4 replicas:
    printed (run with -s), not asserted (wall time is not a test's business)."""
    replicas = [Rep(i, capacity=1000) for i in range(4)]
    rng = random.Random(1)
    jobs = [chat("".join(rng.choice("abcdefgh ") for _ in range(8000)), "q") for _ in range(200)]
    for name in ("least_inflight", "prefix", "session"):
        policy = make_replica_choice(name)
        start = time.perf_counter()
        for job in jobs:
            policy.choose(replicas, job)
        per_request_us = (time.perf_counter() - start) / len(jobs) * 1e6
        print(f"routing {name}: {per_request_us:.1f} us per request")
        assert sum(policy.decisions.values()) == len(jobs)


# -- through a real pool (synthetic workers) -------------------------------------------------------
def test_session_routing_is_seen_in_admin_and_metrics(make_pool):
    from prometheus_client.parser import text_string_to_metric_families

    from tests.conftest import synthetic
    pool = make_pool([synthetic("s", replicas=3, routing="session")])
    for i in range(6):  # one key, Chat Completions and Responses alike: one replica
        body = {"model": "s", "prompt_cache_key": "conv-7"}
        r = (pool.http.post("/v1/chat/completions", json={**body, "messages": [{"role": "user", "content": "hi"}]})
             if i % 2 else pool.http.post("/v1/responses", json={**body, "input": "hi"}))
        assert r.status_code == 200, r.text
    assert pool.http.post("/v1/responses", json={"model": "s", "input": "no key"}).status_code == 200
    views = {w["replica"]: w["routing"] for w in pool.workers()}
    assert all(v["routing"] == "session" for v in views.values())
    sessions = {i: v["decisions"]["session"] for i, v in views.items()}
    assert sorted(sessions.values()) == [0, 0, 6]  # every keyed request on one replica
    assert sum(v["decisions"]["least_inflight"] for v in views.values()) == 1
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(pool.http.get("/metrics").text) for s in f.samples}
    for i, n in sessions.items():
        key = (("decision", "session"), ("model", "s"), ("replica", str(i)))
        assert samples[("llm_pool_routing_decisions_total", key)] == n


def test_prompt_cache_key_reaches_the_runtime_and_cached_tokens_make_the_hit_ratio(make_pool):
    """Through a real pool to a scripted OpenAI runtime (openai_remote): the key
    from both APIs is sent on, and the runtime's cached_tokens are counted."""
    from tests.scripted_openai import ScriptedHandler, serve, sse_chunks

    class Runtime(ScriptedHandler):
        bodies: list[dict] = []

        def answer(self, body: dict) -> tuple[int, str, str]:
            usage = {"prompt_tokens": 100, "completion_tokens": 1, "total_tokens": 101,
                     "prompt_tokens_details": {"cached_tokens": 80}}
            return 200, "text/event-stream", sse_chunks([{"index": 0, "delta": {"content": "ok"},
                                                          "finish_reason": "stop"}], usage)

    with serve(Runtime) as runtime:
        pool = make_pool([{"name": "r", "backend": "openai_remote", "replicas": 2, "routing": "session",
                           "options": {"base_url": runtime.url + "/v1", "model": "up"}}])
        chat = pool.http.post("/v1/chat/completions", json={"model": "r", "prompt_cache_key": "k-chat",
                                                            "messages": [{"role": "user", "content": "hi"}]})
        responses = pool.http.post("/v1/responses", json={"model": "r", "prompt_cache_key": "k-resp",
                                                          "input": "hi"})
        assert chat.status_code == 200 and responses.status_code == 200, (chat.text, responses.text)
        assert [b.get("prompt_cache_key") for b in runtime.bodies] == ["k-chat", "k-resp"]
        assert chat.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 80
        views = [w["routing"] for w in pool.workers()]
        assert sum(v["prompt_tokens"] for v in views) == 200 and sum(v["cached_tokens"] for v in views) == 160
        assert {v["cache_hit_ratio"] for v in views if v["prompt_tokens"]} == {0.8}
