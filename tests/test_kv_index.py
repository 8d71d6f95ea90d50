"""The exact prefix index: vLLM's KV-event messages decoded (runtime_worker/kv_events.py),
relayed over a real ZeroMQ socket, carried by the protocol, and applied to one
replica's index (supervisor/scheduling/kv_index.py) and to the prefix policy. No processes.

The payloads are built as vLLM's publisher makes them (vllm/distributed/kv_events.py:
msgspec msgpack of KVEventBatch, an array [ts, events, rank], each event a map tagged
by "type"); the vLLM tier (tests/test_vllm_serve.py) checks the same path on a real engine."""

from __future__ import annotations

import asyncio
import json
import math
import socket
import tempfile
import time

import msgpack
import pytest
import zmq
import zmq.asyncio

import protocol as p
from runtime_worker.kv_events import MAX_BLOCKS_PER_EVENT, MAX_PENDING_EVENTS, KvEventRelay, decode_frame
from supervisor.scheduling.jobs import Admitted, Job
from supervisor.scheduling.kv_index import (APPLY_BLOCKS_PER_STEP, MAX_MATCH_BLOCKS, MAX_MATCH_TOKENS, MAX_QUEUED_EVENTS,
                                 ExactIndex, token_block_keys)
from supervisor.scheduling.replica_choice import Decision, make_replica_choice
from supervisor.states import ReplicaState

BS = 4  # block size of these tests


def stored(hashes, parent, tokens, size=BS, **extra) -> dict:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
            "block_size": size, "lora_id": None, "medium": "GPU", "lora_name": None, **extra}


def removed(hashes) -> dict:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU"}


def frame(seq: int, events: list, topic: bytes = b"") -> list[bytes]:
    return [topic, seq.to_bytes(8, "big"), msgpack.packb([1.5, events, None])]


def h(i: int) -> bytes:
    return i.to_bytes(32, "big")


# -- the decoder ------------------------------------------------------------------------------------
def test_decode_vllm_frame():
    seq, events = decode_frame(frame(7, [stored([h(1), h(2)], None, list(range(8))), removed([h(1)]),
                                         {"type": "AllBlocksCleared"}]))
    assert seq == 7
    assert events == [["stored", [h(1), h(2)], None, list(range(8)), BS, False], ["removed", [h(1)]], ["cleared"]]


def test_decode_marks_extra_keys_and_skips_other_caches():
    _, events = decode_frame(frame(0, [
        stored([h(1)], None, [1, 2, 3, 4], extra_keys=[["salt"]]),
        stored([h(2)], None, [1, 2, 3, 4], medium="CPU"),  # an offload tier: not the engine's cache
        stored([h(3)], None, [1, 2, 3, 4], group_idx=1),  # another KV group
        stored([5], None, [1, 2, 3, 4]),  # int hashes (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES)
    ]))
    assert events == [["stored", [h(1)], None, [1, 2, 3, 4], BS, True], ["stored", [5], None, [1, 2, 3, 4], BS, False]]


def test_decode_splits_long_events():
    n = MAX_BLOCKS_PER_EVENT * 2 + 3
    _, events = decode_frame(frame(0, [stored([h(i) for i in range(n)], h(999), list(range(n * BS)))]))
    assert [len(e[1]) for e in events] == [MAX_BLOCKS_PER_EVENT, MAX_BLOCKS_PER_EVENT, 3]
    assert [e[2] for e in events] == [h(999), h(MAX_BLOCKS_PER_EVENT - 1), h(2 * MAX_BLOCKS_PER_EVENT - 1)]
    assert [t for e in events for t in e[3]] == list(range(n * BS))


@pytest.mark.parametrize("parts", [
    [b"", b"\x00" * 8],  # two frames
    [b"", b"\x00" * 7, msgpack.packb([1.0, []])],  # short sequence number
    [b"", b"\x00" * 8, b"\xc1garbage"],
    [b"", b"\x00" * 8, msgpack.packb({"ts": 1})],
    [b"", b"\x00" * 8, msgpack.packb([1.0, [{"type": "BlockExploded"}]])],
    [b"", b"\x00" * 8, msgpack.packb([1.0, [stored([h(1)], None, [1, 2, 3])]])],  # tokens do not fill it
    [b"", b"\x00" * 8, msgpack.packb([1.0, [stored(["x"], None, [1, 2, 3, 4])]])],
    [b"", b"\x00" * 8, msgpack.packb([1.0, [stored([h(1)], None, [1, 2, "3", 4])]])],
    [b"", b"\x00" * 8, msgpack.packb([1.0, [stored([h(1)], None, [1, 2, 3, 4], size=True)]])],
    [b"", b"\x00" * 8, msgpack.packb([1.0, ["not a map"]])],
])
def test_decode_refuses_malformed(parts):
    assert isinstance(decode_frame(parts), str)


# -- the relay, over a real socket -------------------------------------------------------------------
async def _relay_run(messages: list, want: int):
    """A PUB bound where an engine would, the relay subscribed: what reaches `send`.
    `messages`: (sequence number counted after the probes, events), or raw frames."""
    sent: list[tuple[list, bool]] = []
    with tempfile.TemporaryDirectory() as d:
        endpoint = f"ipc://{d}/events"
        ctx = zmq.Context()
        relay = KvEventRelay(ctx, endpoint, lambda events, reset: sent.append((events, reset)))
        pub = ctx.socket(zmq.PUB)
        pub.bind(endpoint)
        try:
            deadline = asyncio.get_running_loop().time() + 10
            # a PUB drops what it sends before the subscription arrives: a probe until one gets through
            probes = 0
            while not sent:
                pub.send_multipart(frame(probes, []))
                probes += 1
                await asyncio.sleep(0.05)
                assert asyncio.get_running_loop().time() < deadline, "the relay never heard the publisher"
            while relay._next_seq != probes:  # the probes in flight arrive: the relay has taken the last one sent
                await asyncio.sleep(0.02)
                assert asyncio.get_running_loop().time() < deadline, "the last probe never arrived"
            sent.clear()
            probe_gaps = relay.gaps  # a probe sent before the subscription arrived is a gap too
            for m in messages:
                pub.send_multipart(frame(probes + m[0], m[1]) if isinstance(m, tuple) else m)
            while sum(len(e) for e, _ in sent) + sum(r for _, r in sent) < want:
                await asyncio.sleep(0.02)
                assert asyncio.get_running_loop().time() < deadline, f"relay sent {sent}"
        finally:
            pub.close(0)
            relay.close()
            ctx.term()
    return sent, relay.gaps - probe_gaps, relay.malformed


def test_relay_passes_events_in_order_and_resets_on_a_gap_or_garbage():
    messages = [(0, [stored([h(1)], None, [1, 2, 3, 4])]),
                (2, [removed([h(1)])]),  # 1 is missing: a gap, said with the events after it
                [b"", b"\x00" * 8, b"\xc1garbage"],  # malformed: the relay survives it
                (3, [{"type": "AllBlocksCleared"}])]
    sent, gaps, malformed = asyncio.run(_relay_run(messages, want=5))
    assert sent == [([["stored", [h(1)], None, [1, 2, 3, 4], BS, False]], False),
                    ([["removed", [h(1)]]], True), ([], True), ([["cleared"]], False)]
    assert (gaps, malformed) == (1, 1)


def test_relay_batches_are_bounded():
    n = p.MAX_KV_EVENTS * 2 + 1
    sent, _, _ = asyncio.run(_relay_run([(0, [removed([h(i)]) for i in range(n)])], want=n))
    assert [len(e) for e, _ in sent] == [p.MAX_KV_EVENTS, p.MAX_KV_EVENTS, 1]
    assert n < MAX_PENDING_EVENTS


# -- the protocol message ----------------------------------------------------------------------------
def test_kv_events_message_round_trip_and_bounds():
    msg = p.KvEvents(events=[["stored", [h(1)], None, [1, 2, 3, 4], BS, False], ["cleared"]], reset=True)
    assert p.decode(p.encode(msg)) == msg
    too_many = msgpack.packb({"v": p.PROTOCOL_VERSION, "t": "kv_events", "events": [["cleared"]] *
                              (p.MAX_KV_EVENTS + 1)})
    assert isinstance(p.decode(too_many), p.ProtocolError)
    wrong = msgpack.packb({"v": p.PROTOCOL_VERSION, "t": "kv_events", "events": "all", "reset": False})
    assert isinstance(p.decode(wrong), p.ProtocolError)


# -- the exact index ---------------------------------------------------------------------------------
def chain(tokens: list[int], first: int = 0, parent=None) -> list:
    """A stored event for the full blocks of `tokens`, hashed h(first), h(first+1), ..."""
    n = len(tokens) // BS
    return ["stored", [h(first + i) for i in range(n)], parent, tokens[:n * BS], BS, False]


def test_index_matches_what_the_engine_stored():
    index = ExactIndex(100)
    prompt = list(range(100, 114))  # 3 full blocks and 2 tokens
    index.apply([chain(prompt[:8]), chain(prompt[8:12], first=2, parent=h(1))])
    assert index.match(token_block_keys(prompt, BS)) == 3
    assert index.match(token_block_keys([*prompt[:8], 0, 0, 0, 0], BS)) == 2  # differs in block 3
    assert index.match(token_block_keys([1, *prompt[1:]], BS)) == 0  # differs in block 1: nothing after counts
    index.apply([["removed", [h(1)]]])  # the engine dropped block 2: block 3 is no longer reachable by a prefix
    assert index.match(token_block_keys(prompt, BS)) == 1
    index.apply([["cleared"]])
    assert index.match(token_block_keys(prompt, BS)) == 0 and len(index) == 0


def test_index_cannot_match_what_tokens_do_not_key():
    index = ExactIndex(100)
    prompt = list(range(12))
    index.apply([["stored", [h(0)], None, prompt[:4], BS, True],  # a salted (extra-keyed) root
                 ["stored", [h(1), h(2)], h(0), prompt[4:12], BS, False]])
    assert index.match(token_block_keys(prompt, BS)) == 0
    index.apply([["stored", [h(5)], h(404), prompt[:4], BS, False]])  # an unknown parent
    assert index.match(token_block_keys(prompt, BS)) == 0


def test_index_reset_bound_and_malformed_events():
    index = ExactIndex(4)
    prompt = list(range(24))  # 6 blocks
    index.apply([chain(prompt)])
    assert len(index) == 4  # bounded: the oldest stored went first
    assert index.match(token_block_keys(prompt, BS)) == 0  # blocks 1 and 2 are forgotten
    index.apply([["stored", [h(9)], None, [1, 2], BS, False], ["bogus"], [], "x", ["removed", 5]])
    assert index.malformed == 5
    index.apply([chain(prompt[:8], first=20)], reset=True)
    assert (len(index), index.resets) == (2, 1) and index.match(token_block_keys(prompt, BS)) == 2


def state(index: ExactIndex) -> tuple:
    """All an index holds and counts, its blocks in their eviction order."""
    return (list(index._blocks.items()), dict(index._keys), index.block_size, index.stored, index.removed,
            index.cleared, index.resets, index.malformed)


def test_index_steps_are_bounded_and_end_where_applying_at_once_does():
    prompt = list(range(48))  # 12 blocks, more than the index holds: its parents are evicted as it is stored
    messages = [([chain(prompt), ["bogus"], ["removed", [h(11), h(3), h(404), h(10)]], chain(prompt[:8], first=30),
                  ["cleared"], chain(prompt[:12], first=40)], False),
                ([chain(prompt[:16], first=50)], True)]
    at_once = ExactIndex(5)
    for events, reset in messages:
        at_once.apply(events, reset)
    assert at_once.match(token_block_keys(prompt, BS)) == 4 and at_once.resets == 1
    for max_blocks in (1, 2, 3, 5, 7):
        index = ExactIndex(5)
        for events, reset in messages:
            index.feed(events, reset)
        steps, more = 0, True
        while more:
            done = index.stored + index.removed
            more = index.step(max_blocks)
            steps += 1
            assert index.stored + index.removed - done <= max_blocks  # a stored event is cut between blocks
            assert steps < 100
        assert steps > 1 and index.queued == 0
        assert state(index) == state(at_once), max_blocks
    index = ExactIndex(100)
    index.feed([chain(prompt)])
    assert index.step(max_blocks=100, max_tokens=2 * BS) and index.stored == 2  # tokens bound a step too
    assert index.step(max_blocks=100, max_tokens=1) and index.stored == 3  # at least one block a step
    assert not index.step() and index.match(token_block_keys(prompt, BS)) == 12


def test_index_queue_is_bounded():
    index = ExactIndex(100)
    index.feed([chain(list(range(8)))] * (MAX_QUEUED_EVENTS + 1))
    index.step(max_blocks=1)  # part of the first event applied
    index.feed([chain(list(range(12)), first=10)])  # more than the steps keep up with: as if lost
    assert index.queued == 2  # the reset, then this
    assert not index.step() and index.resets == 1 and len(index) == 3 and index.stored == 1 + 3


def test_a_match_stops_at_the_cap():
    prompt = list(range(2 * MAX_MATCH_BLOCKS))  # at 1 token a block, the block cap is reached first
    index = ExactIndex(len(prompt))
    index.apply([["stored", [h(i) for i in range(len(prompt))], None, prompt, 1, False]])
    assert len(index) == len(prompt)
    assert len(token_block_keys(prompt, 1)) == MAX_MATCH_BLOCKS
    assert index.match(token_block_keys(prompt, 1)) == MAX_MATCH_BLOCKS  # the engine holds twice as many
    size = 2 * MAX_MATCH_TOKENS // MAX_MATCH_BLOCKS  # at this size, the token cap is reached first
    long = list(range(MAX_MATCH_TOKENS + 10 * size))
    assert len(token_block_keys(long, size)) == MAX_MATCH_TOKENS // size < MAX_MATCH_BLOCKS


# -- the policy ---------------------------------------------------------------------------------------
class FakeReplica:
    def __init__(self, index: int, kv_events: bool = True) -> None:
        self.index, self.identity, self.state = index, f"m/{index}#1", ReplicaState.READY
        self.capacity = self.runtime_capacity = 4
        self.info = {"kv_events": kv_events}
        self.inflight: dict = {}

    @property
    def free_slots(self) -> int:
        return self.capacity - len(self.inflight)


def job(tokens: list[int] | None, text: str = "hello") -> Job:
    j = Job("m", {"messages": [{"role": "user", "content": text}]}, 60)
    j.admitted = Admitted()  # as admission makes it, with the prompt's token ids
    j.admitted.prompt_tokens = tokens
    return j


def test_policy_routes_by_the_engines_blocks():
    policy = make_replica_choice("prefix")
    replicas = [FakeReplica(0), FakeReplica(1)]
    prompt = list(range(40))
    for r in replicas:
        policy.exact(r)  # known to report its cache
    policy.kv_events(replicas[1], [chain(prompt)], False)
    for _ in range(3):  # the replica holding it, whatever the round-robin cursor says
        assert policy.choose(replicas, job(prompt)) is replicas[1]
    assert policy.decisions[Decision.PREFIX_HIT] == 3
    view = policy.replica_view(replicas[1])
    assert view["kv_index"]["blocks"] == 10 and view["prefix_matches"]["exact"] == 3
    # the engine dropped it: nothing to go on
    policy.kv_events(replicas[1], [["cleared"]], False)
    policy.choose(replicas, job(prompt))
    assert policy.decisions[Decision.PREFIX_HIT] == 3 and policy.decisions[Decision.LEAST_INFLIGHT] == 1


def test_policy_falls_back_without_token_ids_and_forgets_a_restart():
    policy = make_replica_choice("prefix")
    replicas = [FakeReplica(0), FakeReplica(1)]
    first = policy.choose(replicas, job(None, "x" * 2000))  # no token ids: the approximate index records it
    assert policy.choose(replicas, job(None, "x" * 2000)) is first
    assert policy.replica_view(first)["prefix_matches"]["approximate_fallback"] >= 1
    prompt = list(range(40))
    policy.kv_events(replicas[0], [chain(prompt)], False)
    assert policy.choose(replicas, job(prompt)) is replicas[0]
    replicas[0].identity = "m/0#2"  # a new worker: its cache is empty
    assert policy.replica_view(replicas[0]).get("kv_index") is None
    before = policy.decisions[Decision.PREFIX_HIT]
    policy.choose(replicas, job(prompt))
    assert policy.decisions[Decision.PREFIX_HIT] == before


def test_policy_after_lost_events_trusts_the_approximate_index_where_it_knows_more():
    policy = make_replica_choice("prefix")
    replicas = [FakeReplica(0), FakeReplica(1)]
    prompt, text = list(range(40)), "y" * 2000
    chosen = policy.choose(replicas, job(prompt, text))  # nothing known: least-inflight; recorded approximately
    policy.kv_events(chosen, [chain(prompt)], False)
    assert policy.choose(replicas, job(prompt, text)) is chosen
    exact_before = policy.replica_view(chosen)["prefix_matches"]["exact"]
    policy.kv_events(chosen, [], True)  # a gap: the exact index starts over, empty
    assert policy.choose(replicas, job(prompt, text)) is chosen  # the approximate index still says so
    view = policy.replica_view(chosen)
    assert view["kv_index"]["resets"] == 1 and view["prefix_matches"]["exact"] == exact_before
    assert view["prefix_matches"]["approximate_fallback"] >= 1


def test_policy_routes_a_prompt_past_the_cap_as_if_it_matched_the_cap():
    """A replica that holds the cap's worth of a prompt four times as long is its prefix hit:
    the share is of the blocks matched (those under the cap), not of the whole prompt."""
    policy = make_replica_choice("prefix")
    replicas = [FakeReplica(0), FakeReplica(1)]
    prompt = list(range(4 * MAX_MATCH_BLOCKS))
    for r in replicas:
        policy.exact(r)
    held = prompt[:MAX_MATCH_BLOCKS]
    policy.kv_events(replicas[0], [["stored", [h(1_000_000 + i) for i in range(4)], None, [9, 9, 9, 9], 1, False]],
                     False)  # holds another prompt: the same block size, none of this one
    policy.kv_events(replicas[1], [["stored", [h(i) for i in range(len(held))], None, held, 1, False]], False)
    for _ in range(2):  # whatever the round-robin cursor says
        assert policy.choose(replicas, job(prompt)) is replicas[1]
    assert policy.decisions[Decision.PREFIX_HIT] == 2


def one_turn() -> asyncio.Future:
    """Resolved in the next loop turn: what call_soon scheduled before it has run."""
    loop = asyncio.get_running_loop()
    turn = loop.create_future()
    loop.call_soon(turn.set_result, None)
    return turn


def big_message(n: int) -> list:
    """`n` blocks stored as the relay sends them (256 a stored event, each chained on the last)."""
    prompt = list(range(n * BS))
    return [chain(prompt[i * BS:(i + 256) * BS], first=i, parent=h(i - 1) if i else None) for i in range(0, n, 256)]


def test_a_huge_kv_events_message_is_applied_over_several_loop_turns_in_order():
    n = 4 * APPLY_BLOCKS_PER_STEP + 300
    first = [*big_message(n), ["bogus"]]
    later = [["removed", [h(5), h(n - 1)]]]  # one from the first piece, one from the last: only in order do both go
    last = [chain(list(range(40)), first=n + 10, parent=h(n - 2))]
    at_once = ExactIndex(100_000)
    for events in (first, later, last):
        at_once.apply(events)
    prompt = list(range(n * BS))
    assert at_once.match(token_block_keys(prompt, BS)) == 5

    async def main() -> None:
        policy = make_replica_choice("prefix")
        replica = FakeReplica(0)
        index = policy.exact(replica)
        index.max_blocks = at_once.max_blocks
        for events in (first, later, last):  # one loop turn: the messages of one frame
            policy.kv_events(replica, events, False)
        assert (index.stored, index.removed) == (APPLY_BLOCKS_PER_STEP, 0)  # the first piece only
        assert index.draining and index.queued
        steps = [APPLY_BLOCKS_PER_STEP]  # blocks each step applied
        step = index.step

        def counted(*args):
            done = index.stored + index.removed + index.malformed
            more = step(*args)
            steps.append(index.stored + index.removed + index.malformed - done)
            return more
        index.step = counted
        policy.choose([replica], job(prompt))  # a match meanwhile sees what is applied so far
        turns = 0
        while index.queued:
            await one_turn()
            turns += 1
            assert turns < 100, "the queue never drained"
        assert turns >= 2  # this coroutine ran between the steps: they did not hold the loop in one turn
        assert max(steps) <= APPLY_BLOCKS_PER_STEP
        assert sum(steps) == at_once.stored + at_once.removed + at_once.malformed
        assert not index.draining and policy.replica_view(replica)["kv_index"]["queued"] == 0
        assert state(index) == state(at_once)

    asyncio.run(main())


def test_a_restart_drops_the_kv_events_not_yet_applied():
    async def main() -> None:
        policy = make_replica_choice("prefix")
        replica = FakeReplica(0)
        policy.kv_events(replica, big_message(3 * APPLY_BLOCKS_PER_STEP), False)
        old = policy.exact(replica)
        assert old.stored == APPLY_BLOCKS_PER_STEP and old.queued
        replica.identity = "m/0#2"  # a new worker: the new index starts empty, the old one is no longer fed
        policy.kv_events(replica, [chain([1, 2, 3, 4])], False)
        new = policy.exact(replica)
        assert new is not old and len(new) == 1 and not new.queued
        for _ in range(3):
            await one_turn()
        assert old.stored == APPLY_BLOCKS_PER_STEP and not old.draining

    asyncio.run(main())


class FakeEngine:
    """vLLM's publisher as its source reads: a PUB of [topic, seq, payload] and a ROUTER
    that answers [id, b"", start] with the buffered messages from `start`, then an end marker."""

    def __init__(self, d: str) -> None:
        self.ctx = zmq.asyncio.Context()
        self.endpoint, self.replay_endpoint = f"ipc://{d}/events", f"ipc://{d}/replay"
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.bind(self.endpoint)
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.bind(self.replay_endpoint)
        self.buffer: list[tuple[int, list[bytes]]] = []
        self.seq = 0
        self.replays = 0
        self.task = asyncio.create_task(self.serve_replays())

    async def publish(self, events: list, drop: bool = False, keep: bool = True) -> None:
        """`drop`: lost on the way (not sent live); `keep`: in the replay buffer."""
        message = frame(self.seq, events)
        if keep:
            self.buffer.append((self.seq, message))
        if not drop:
            await self.pub.send_multipart(message)
        self.seq += 1

    async def serve_replays(self) -> None:
        while True:
            client, _, start = await self.router.recv_multipart()
            self.replays += 1
            for seq, message in self.buffer:
                if seq >= int.from_bytes(start, "big"):
                    await self.router.send_multipart([client, b"", *message])
            await self.router.send_multipart([client, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])

    def close(self) -> None:
        self.task.cancel()
        self.pub.close(0)
        self.router.close(0)
        self.ctx.term()


async def _replay_run(script) -> tuple[list, KvEventRelay, FakeEngine]:
    sent: list[tuple[list, bool]] = []
    with tempfile.TemporaryDirectory() as d:
        engine = FakeEngine(d)
        ctx = zmq.Context()
        relay = KvEventRelay(ctx, engine.endpoint, lambda events, reset: sent.append((events, reset)),
                             engine.replay_endpoint)
        try:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 10
            while not sent:  # probes until the subscription is through (a lost probe is replayed too)
                await engine.publish([removed([h(0)])])
                await asyncio.sleep(0.05)
                assert loop.time() < deadline, "the relay never heard the publisher"
            while relay.replaying or sum(len(e) for e, _ in sent) < engine.seq:
                await asyncio.sleep(0.02)
                assert loop.time() < deadline, f"relay sent {sent}"
            assert not any(reset for _, reset in sent)  # the probes came through, replayed or live
            sent.clear()
            want = await script(engine)
            while sum(len(e) for e, _ in sent) + sum(r for _, r in sent) < want:
                await asyncio.sleep(0.02)
                assert loop.time() < deadline, f"relay sent {sent}"
        finally:
            relay.close()
            ctx.term()
            engine.close()
    return sent, relay, engine


def test_relay_fills_a_gap_from_the_replay_socket():
    async def script(engine: FakeEngine) -> int:
        await engine.publish([removed([h(1)])], drop=True)  # lost live, still in the engine's buffer
        await engine.publish([removed([h(2)])])
        return 2
    sent, relay, engine = asyncio.run(_replay_run(script))
    assert sent == [([["removed", [h(1)]], ["removed", [h(2)]]], False)]  # in order, no reset
    assert relay.replayed >= 1 and engine.replays >= 1


def test_relay_resets_when_the_replay_cannot_fill_the_gap():
    async def script(engine: FakeEngine) -> int:
        await engine.publish([removed([h(1)])], drop=True, keep=False)  # gone from the buffer too
        await engine.publish([removed([h(2)])])
        return 2
    sent, relay, _ = asyncio.run(_replay_run(script))
    assert sent == [([["removed", [h(2)]]], True)]
    assert relay.gaps >= 1


async def _tokenize_against(pieces: list[bytes], limit: int | None = None):
    """PromptTokenizer against a real local HTTP server that sends its answer in `pieces`,
    each flushed on its own with a loop turn between them (as a long answer arrives)."""
    from aiohttp import web

    from supervisor.admission.prompt_tokens import MAX_ANSWER_BYTES, PromptTokenizer

    async def tokenize(request):
        assert (await request.json())["messages"]
        answer = web.StreamResponse(headers={"Content-Type": "application/json"})
        await answer.prepare(request)
        for piece in pieces:
            await answer.write(piece)
            await asyncio.sleep(0.01)
        await answer.write_eof()
        return answer

    app = web.Application()
    app.router.add_post("/tokenize", tokenize)
    runner = web.AppRunner(app)
    await runner.setup()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    await web.SockSite(runner, sock).start()
    tokenizer = PromptTokenizer(timeout_s=10, max_answer_bytes=limit or MAX_ANSWER_BYTES)
    try:
        tokens = await tokenizer.tokens(f"http://127.0.0.1:{port}/tokenize",
                                        {"messages": [{"role": "user", "content": "hi"}]}, "chat")
        return tokens, tokenizer.failures
    finally:
        await tokenizer.close()
        await runner.cleanup()


def test_tokenizer_reads_a_long_answer_that_arrives_in_pieces():
    ids = list(range(40_000))  # ~230 KB of JSON: more than one read of the socket
    body = json.dumps({"count": len(ids), "max_model_len": 4096, "tokens": ids}).encode()
    pieces = [body[i:i + 50_000] for i in range(0, len(body), 50_000)]
    assert len(pieces) > 3
    tokens, failures = asyncio.run(_tokenize_against(pieces))
    assert tokens == ids and failures == 0


def test_tokenizer_refuses_an_answer_over_its_bound():
    body = json.dumps({"tokens": list(range(1000))}).encode()
    tokens, failures = asyncio.run(_tokenize_against([body[:3000], body[3000:]], limit=len(body) - 1))
    assert tokens is None and failures == 1


def test_a_long_tokenize_answer_is_parsed_off_the_event_loop():
    """A 1M-token answer (8 MB of JSON) once took json.loads and a type check on the event loop,
    holding it for as long as they took (issue 42, B7). Now it is parsed in a thread, a piece at a
    time, so that the loop runs between pieces: its longest stall is a fraction of that work's."""
    ids = list(range(100_000, 1_100_000))
    body = json.dumps({"count": len(ids), "max_model_len": 2**21, "tokens": ids}).encode()

    def as_before() -> float:  # the old parse, on the loop
        started = time.perf_counter()
        tokens = json.loads(body)["tokens"]
        assert all(type(t) is int for t in tokens)
        return time.perf_counter() - started

    async def run():
        stalls = [0.0]

        async def ticker():
            while True:
                before = time.perf_counter()
                await asyncio.sleep(0)
                stalls.append(time.perf_counter() - before)

        watch = asyncio.create_task(ticker())
        try:
            result = await _tokenize_against([body[i:i + 2**20] for i in range(0, len(body), 2**20)])
        finally:
            watch.cancel()
        return result, max(stalls)

    # the best of three: a busy machine only adds to a stall (a parse on the loop stalls it every time)
    stall = math.inf
    for _ in range(3):
        (tokens, failures), one = asyncio.run(run())
        assert tokens == ids and failures == 0
        stall = min(stall, one)
    work = min(as_before() for _ in range(2))
    assert stall < work / 3, f"the loop stalled {stall * 1000:.0f} ms; the whole parse takes {work * 1000:.0f} ms"


def test_a_tokenize_answer_of_anything_but_ints_gives_no_ids():
    from supervisor.admission.prompt_tokens import PIECE_BYTES, parse_answer

    many = list(range(PIECE_BYTES // 3))  # more than one piece
    assert parse_answer(json.dumps({"tokens": many}).encode()) == many
    assert parse_answer(b'{"tokens": []}') == [] and parse_answer(b'{"count": 1}') is None
    for bad in (many[:-1] + [True], many[:-1] + [1.0], many[:-1] + ["x"], many + ["a,b"]):
        assert parse_answer(json.dumps({"tokens": bad}).encode()) is None, bad[-1]
    assert parse_answer(b'[1, 2]') is None and parse_answer(b'{"tokens": [1, 2') is None
