"""The bench's sections, in report order: the key that --sections names, and the function
that runs one and adds its part to the report (it may raise: the bench then reports the
section failed, stops what it started, and goes on with the next)."""

from __future__ import annotations

from typing import Callable

from pool_bench import (capacity, deadlines, fairness, memory, messages, peer, prefix, relay, scale, streaming,
                        ttft, warm_swap)
from pool_bench.bench import Bench

SECTIONS: dict[str, Callable[[Bench], None]] = {
    "1": streaming.run,  # streaming through a real llama-server: direct vs pool
    "2": capacity.run,  # scheduler capacity: synthetic backend vs bare FastAPI
    "3": peer.run,  # a peer: LiteLLM's proxy vs llm-pool (openai_remote)
    "4": memory.run,  # memory: what sections 1-3 recorded
    "5": relay.section,  # relay of N streams x rate: a bare SSE server vs the pool
    "6": ttft.run,  # added time to first token: tiny GGUF on llama-server -t 1, concurrency 1
    "7": prefix.run,  # cache-aware replica choice: prefix vs least_inflight on llama-server replicas
    "8": fairness.run,  # tenants: VTC service difference fair vs FIFO, light p99 under a flood, 3:1, admission µs
    "9": scale.section,  # 10,000 streams at 1 tok/s: a bare SSE server vs the pool, clients in 4 processes
    "10": messages.run,  # Messages against chat: relay CPU per token (synthetic), added TTFT (llama-server)
    "11": deadlines.run,  # deadlines + fallbacks vs FIFO under 2x overload, admission CPU, SmolLM2 prediction error
    "12": warm_swap.run,  # warm swaps: the next turn after an unload and a load, warm vs cold; two models swapping
}
ON_REQUEST = frozenset({"7", "8", "9", "10", "11", "12"})  # run only when --sections names them (minutes each; the quick test skips them)
