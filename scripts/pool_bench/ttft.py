"""6. Added time to first token: the tiny GGUF on `llama-server -t 1` (one thread, so the
runtime leaves the other cores to the pool), one request at a time, a llama-server started
here vs the pool (same binary, model and flags), rounds interleaved. Beside the pool, the
floors of proxy_floor.py in front of the same llama-server: one Python proxy, and one with
a worker process behind it over ZeroMQ, as the pool's."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from pool_bench import proxy_floor
from pool_bench.bench import Bench
from pool_bench.children import LlamaProc, PoolProc
from pool_bench.interleave import interleaved
from pool_bench.load import load, pct, streaming_call
from pool_bench.report import errors_note, loadavg, ms, table

MAX_TOKENS = 16  # random weights may spend a few tokens on no visible text; the rest is section 1's business


@contextlib.contextmanager
def tiny_pair(bench: Bench, name: str) -> Iterator[tuple[LlamaProc, PoolProc] | None]:
    """A llama-server started here and a pool serving the same tiny GGUF with the same flags
    (`-t 1`: the runtime leaves the other cores to the pool), both ready for the block and
    stopped after it; None without llama-server or the tiny GGUF."""
    tiny = next((m for m in bench.llama_models() if m["name"] == "tiny"), None)
    if not bench.binary or tiny is None:
        yield None
        return
    extra = ["-t", "1", "--ignore-eos"]
    direct = LlamaProc(bench.tmp, f"llama-direct-{name}", bench.binary, tiny["path"], 2048, 1, extra)
    pool = PoolProc(bench.tmp, f"pool-{name}", [{
        "name": "tiny", "backend": "llama_server", "target_inflight": 1, "load_timeout_s": 180.0,
        "options": {"model": tiny["path"], "binary": bench.binary, "ctx_size": 2048, "extra_args": extra}}])
    try:
        direct.ready()
        pool.ready()
        yield direct, pool
    finally:
        pool.stop()
        direct.stop()


def ttft_rounds(bench: Bench) -> tuple[int, int]:
    """(interleaved rounds, requests a round) of a TTFT measure: one request at a time."""
    return (2, 5) if bench.quick else (8, 25)


def run(bench: Bench) -> None:
    rounds, per_round = ttft_rounds(bench)
    load_before = loadavg()
    with tiny_pair(bench, "ttft") as pair:
        if pair is None:
            bench.note("section 6 skipped: needs llama-server and the tiny GGUF")
            return
        direct, pool = pair
        floors = proxy_floor.start(bench.tmp, direct.url, direct.key)
        try:
            targets = {"direct": (direct.url, direct.key), "proxy": (floors[0].url, None),
                       "proxy+zmq": (floors[1].url, None), "pool": (pool.url, None)}
            for url, key in targets.values():  # warm-up, not measured
                load(streaming_call(url, "tiny", MAX_TOKENS, key), 3, 1, 30)

            def measure(t: str, c: int):
                url, key = targets[t]
                return load(streaming_call(url, "tiny", MAX_TOKENS, key), per_round, c, 60)

            results = interleaved(targets, [1], rounds, measure, {}, "ttft", "tok/s")
        finally:
            for proc in floors:
                proc.stop()
    d = results[("direct", 1)]

    def added(t: str, q: int) -> float | None:
        r = results[(t, 1)]
        return pct(r.ttfts, q) - pct(d.ttfts, q) if d.ttfts and r.ttfts else None
    p = results[("pool", 1)]
    bench.out["sections"]["ttft"] = {
        "direct_p50": pct(d.ttfts, 50), "direct_p95": pct(d.ttfts, 95),
        "pool_p50": pct(p.ttfts, 50), "pool_p95": pct(p.ttfts, 95),
        "added_p50": added("pool", 50), "added_p95": added("pool", 95),
        "proxy_added_p50": added("proxy", 50), "proxy_added_p95": added("proxy", 95),
        "proxy_zmq_added_p50": added("proxy+zmq", 50), "proxy_zmq_added_p95": added("proxy+zmq", 95),
        "requests": [len(d.ttfts), len(p.ttfts)]}
    text = table(["requests direct/pool", "direct TTFT p50 / p95 ms", "pool TTFT p50 / p95 ms",
                  "added p50 / p95 ms"],
                 [[f"{len(d.ttfts)}/{len(p.ttfts)}", f"{ms(pct(d.ttfts, 50))} / {ms(pct(d.ttfts, 95))}",
                   f"{ms(pct(p.ttfts, 50))} / {ms(pct(p.ttfts, 95))}",
                   f"{ms(added('pool', 50))} / {ms(added('pool', 95))}"]])
    text += (f"\n\nTime to the first streamed content token, {MAX_TOKENS}-token answers, one request at a "
             f"time on a kept-alive connection, {rounds} interleaved rounds of {per_round}. 1-min load "
             f"average: {load_before} before, {loadavg()} after, {os.cpu_count()} CPUs.")
    text += "\n\n" + table(
        ["in front of the same llama-server", "requests", "TTFT p50 / p95 ms", "added p50 / p95 ms"],
        [[t, len(results[(t, 1)].ttfts),
          f"{ms(pct(results[(t, 1)].ttfts, 50))} / {ms(pct(results[(t, 1)].ttfts, 95))}",
          f"{ms(added(t, 50))} / {ms(added(t, 95))}"] for t in ("proxy", "proxy+zmq", "pool")])
    text += ("\n\nThe floors, measured in the same rounds: proxy = one FastAPI process (the pool's uvicorn "
             "settings) relaying llama-server's bytes over aiohttp; proxy+zmq = that app handing each request "
             "over ZeroMQ to an asyncio worker process that makes the call and sends each chunk back (the "
             "pool's design, without reading or reshaping a chunk).")
    notes = [n for n in (errors_note(t, results[(t, 1)]) for t in targets) if n]
    bench.emit("6. Added time to first token (tiny GGUF, llama-server -t 1, concurrency 1)", text, notes)
