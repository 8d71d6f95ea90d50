"""The bench's sections, in report order: the key that --sections names, and the function
that runs one and adds its part to the report (it may raise: the bench then reports the
section failed, stops what it started, and goes on with the next)."""

from __future__ import annotations

from typing import Callable

from pool_bench import capacity, memory, peer, streaming
from pool_bench.bench import Bench

SECTIONS: dict[str, Callable[[Bench], None]] = {
    "1": streaming.run,  # streaming through a real llama-server: direct vs pool
    "2": capacity.run,  # scheduler capacity: synthetic backend vs bare FastAPI
    "3": peer.run,  # a peer: LiteLLM's proxy vs llm-pool (openai_remote)
    "4": memory.run,  # memory: what sections 1-3 recorded
    # "5": the relay, N streams x rate, pool vs a bare SSE server: a function (bench) that
    # calls pool_bench/relay.py's run(cases, seconds, bench.tmp) and bench.emit()s its table
}
