"""Deterministic generator for scheduler tests and benchmarks.

Options: tokens_per_second (0 = as fast as possible), ttft_ms, capacity,
output_tokens (length of a full answer), load_ms. The text is a fixed
function of the last message, so tests can compare runs. As fast as possible,
a request wanted whole ("stream": false) gets its text in one piece, as a
native server answers it; otherwise the text comes token by token.

`grandchild` (for tests) starts a child process in its own session with no
parent-death signal, the way vLLM's engine processes hang below its server:
only the supervisor's tree kill can end it if the worker dies.

`chaos` (fault injection for tests) makes every job's first event a bad
frame instead of a token: "garbage" (not msgpack), "wrong_types", "bad_version",
"oversized" (over the frame cap), "unknown_job" (a done for a job that does
not exist, after which the job runs normally), "bad_batch_item" (a batch of a
good delta and a malformed one of the job), "bad_batch" (a batch holding an
item that is not a message); "lone_surrogate" makes the
first token text that cannot be encoded (half of a UTF-16 pair, as a
runtime's JSON can carry). With `chaos_prompt`, only jobs whose last
message is that text get the chaos; the others run normally.
"""

from __future__ import annotations

import asyncio
import functools
import sys
import zlib
from collections.abc import AsyncIterator

import msgpack

from protocol import MAX_FRAME_BYTES, PROTOCOL_VERSION
from runtime_worker.backends.base import Backend, Event, Finished, RawFrame, TextDelta

WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel",
         "india", "juliet", "kilo", "lima", "mike", "november", "oscar", "papa")


def synthetic_tokens(prompt: str, count: int) -> tuple[str, ...]:
    return _tokens(zlib.crc32(prompt.encode()), count)


@functools.lru_cache(maxsize=1024)  # keyed by the prompt's checksum: the client's text is never held
def _tokens(seed: int, count: int) -> tuple[str, ...]:
    return tuple(" " + WORDS[(seed + 7 * i) % len(WORDS)] for i in range(count))


def chaos_frame(kind: str, job: str) -> bytes:
    delta = {"v": PROTOCOL_VERSION, "t": "delta", "job": job, "text": "x"}
    frames = {
        "garbage": lambda: b"\xc1 not msgpack",
        "wrong_types": lambda: msgpack.packb({**delta, "text": 12345}),
        "bad_version": lambda: msgpack.packb({**delta, "v": 99}),
        "oversized": lambda: msgpack.packb({**delta, "text": "x" * (MAX_FRAME_BYTES + 10)}),
        "unknown_job": lambda: msgpack.packb({"v": PROTOCOL_VERSION, "t": "done", "job": "no-such-job",
                                              "finish_reason": "stop", "usage": {}}),
        # batches (several messages in one frame): one bad item naming the job; an item that is no map
        "bad_batch_item": lambda: msgpack.packb([delta, {**delta, "text": 12345}]),
        "bad_batch": lambda: msgpack.packb([delta, 7]),
    }
    return frames[kind]()


# malformed KV events (protocol.KvEvents items), each in its own way
KV_CHAOS_EVENTS = [[], "stored", ["stored"], ["stored", [[1]], None, [1, 2, 3, 4], 4, False],
                   ["stored", [b"\x02" * 32], None, [1, 2, 3], 4, False], ["stored", [{}], None, [], 1, False],
                   ["removed", 7], ["removed", [[]]], ["exploded"], [None], {"type": "BlockStored"}]


class SyntheticBackend(Backend):
    name = "synthetic"
    endpoints = frozenset({"chat", "completions", "tokenize"})
    # Its text is a fixed function of the prompt: any sampling setting gives that text, so these
    # are honoured; tools, response_format, logprobs, n > 1, stop, ... are refused by name.
    honours = frozenset({"messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p",
                         "seed", "user", "metadata", "store", "prompt_cache_key"})

    child: asyncio.subprocess.Process | None = None

    async def start(self) -> tuple[int, dict]:
        if self.options.get("grandchild"):
            self.child = await asyncio.create_subprocess_exec(
                sys.executable, "-c", "import time; time.sleep(3600)", start_new_session=True)
        load_ms = float(self.options.get("load_ms", 0))
        if load_ms:
            await asyncio.sleep(load_ms / 1000)
        info = {"child_pid": self.child.pid} if self.child else {}
        if self.options.get("chaos") == "kv_events":  # reports its cache, as a vLLM worker with KV events
            info["kv_events"] = True
        return int(self.options.get("capacity", 1)), info

    def run(self, job: str, request: dict) -> AsyncIterator[Event]:
        messages = request.get("messages") or []
        prompt = str(messages[-1].get("content", "")) if messages and isinstance(messages[-1], dict) else ""
        input_tokens = sum(len(str(m.get("content", "")).split()) for m in messages if isinstance(m, dict))
        return self._generate(job, request, prompt, input_tokens)

    def complete(self, job: str, request: dict) -> AsyncIterator[Event]:
        prompt = request.get("prompt")
        prompt = prompt if isinstance(prompt, str) else str(prompt)
        return self._generate(job, request, prompt, len(prompt.split()))

    async def call(self, endpoint: str, job: str, request: dict, headers: dict | None = None) -> AsyncIterator[Event]:
        """/tokenize (its only call): a word is a token, as its prompts are counted; `messages`
        (chat, vLLM's form) or `content` (llama-server's) or `prompt`."""
        messages = request.get("messages")
        if isinstance(messages, list):
            words = [w for m in messages if isinstance(m, dict) for w in str(m.get("content", "")).split()]
        else:
            words = str(request.get("content", request.get("prompt", ""))).split()
        tokens = [zlib.crc32(w.encode()) % 32000 for w in words]
        yield Finished("stop", len(tokens), 0, result={"tokens": tokens, "count": len(tokens)})

    async def _generate(self, job: str, request: dict, prompt: str, input_tokens: int) -> AsyncIterator[Event]:
        chaos = self.options.get("chaos")
        if self.options.get("chaos_prompt") not in (None, prompt):
            chaos = None
        if chaos == "kv_events":  # KV events the supervisor must survive, then an ordinary answer
            if self.kv_events_sink is not None:
                self.kv_events_sink(KV_CHAOS_EVENTS, False)
                self.kv_events_sink([["stored", [b"\x01" * 32], None, [1, 2, 3, 4], 4, False]], True)
            chaos = None
        if chaos == "lone_surrogate":
            yield TextDelta("\ud83d")
            await asyncio.Event().wait()  # the worker fails the job; wait for its cancel
        elif chaos:
            yield RawFrame(chaos_frame(chaos, job))
            if chaos != "unknown_job":
                await asyncio.Event().wait()  # the supervisor fails the job; wait for its cancel
        full = int(self.options.get("output_tokens", 16))
        limit = request.get("max_completion_tokens") or request.get("max_tokens")
        count = full if limit is None else min(full, int(limit))
        tps = float(self.options.get("tokens_per_second", 0))
        tokens = synthetic_tokens(prompt, count)
        if not tps and tokens and request.get("stream") is False:
            tokens = ("".join(tokens),)  # wanted whole, as fast as possible: one text, as a native server answers it
        loop = asyncio.get_running_loop()
        start = loop.time() + float(self.options.get("ttft_ms", 0)) / 1000
        for i, token in enumerate(tokens):
            # absolute schedule: no drift however late a wake-up is
            delay = start + (i / tps if tps else 0) - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            yield TextDelta(token)
        yield Finished("length" if count < full else "stop", input_tokens, count)

    async def stop(self) -> None:
        if self.child and self.child.returncode is None:
            self.child.kill()
            await self.child.wait()
