"""10. The Messages surface against the chat one, in one run:
- relay CPU per token: the same streams (synthetic runtime, same schedule) as chat completions
  and as Anthropic messages, the supervisor's user + system CPU / tokens delivered;
- added time to first token: the tiny GGUF on `llama-server -t 1`, one request at a time, its
  own /v1/chat/completions and /v1/messages against the same two through the pool.
Targets interleave within each round (pool_bench.interleave), so ratios see one machine state."""

from __future__ import annotations

import json
import os
import time

import httpx

from pool_bench.bench import Bench
from pool_bench.children import CpuMeter, PoolProc
from pool_bench.interleave import interleaved
from pool_bench.load import Round, load, pct
from pool_bench.report import errors_note, loadavg, ms, table
from pool_bench.ttft import tiny_pair, ttft_rounds

TTFT_TOKENS = 16
RELAY_RATE, RELAY_TOKENS = 100.0, 100  # tokens/s of each synthetic stream, tokens per answer


def stream_call(url: str, model: str, max_tokens: int, family: str, key: str | None = None):
    """One streamed request per call, as chat completions or as messages: time to the first
    text, and the output tokens from the final usage."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    path = "/v1/chat/completions" if family == "chat" else "/v1/messages"

    async def one(client, i: int, r: Round) -> None:
        body = {"model": model, "max_tokens": max_tokens, "stream": True,
                "messages": [{"role": "user", "content": f"Request {i}: the sea is"}]}
        if family == "chat":
            body["stream_options"] = {"include_usage": True}
        for attempt in (1, 2):
            try:
                await stream(client, body, r)
                return
            except httpx.RemoteProtocolError:  # llama-server closes a kept-alive connection after a stream:
                if attempt == 2:                # a request on it gets no answer and is sent again
                    raise

    async def stream(client, body: dict, r: Round) -> None:
        t0 = time.perf_counter()
        first, tokens = None, 0
        async with client.stream("POST", url + path, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                await resp.aread()
                raise RuntimeError(f"HTTP {resp.status_code}: {resp.text[:200]}")
            async for line in resp.aiter_lines():
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                event = json.loads(line[5:])
                if "error" in event and event.get("type") in (None, "error"):
                    raise RuntimeError(f"stream error: {event['error']}")
                text = ((event.get("choices") or [{}])[0].get("delta") or {}).get("content") if family == "chat" \
                    else (event.get("delta") or {}).get("text")
                if text and first is None:
                    first = time.perf_counter()
                usage = event.get("usage") or {}
                tokens = usage.get("completion_tokens", usage.get("output_tokens", tokens))
        if first is None:
            raise RuntimeError("no text streamed")
        r.latencies.append(time.perf_counter() - t0)
        r.ttfts.append(first - t0)
        r.tokens += tokens

    return one


def relay_cpu(bench: Bench) -> str:
    rounds, requests, conc = (2, 16, 8) if bench.quick else (6, 96, 32)
    pool = PoolProc(bench.tmp, "pool-messages-relay", [{
        "name": "syn", "backend": "synthetic", "target_inflight": conc,
        "options": {"capacity": conc, "tokens_per_second": RELAY_RATE, "output_tokens": RELAY_TOKENS}}])
    try:
        pool.ready()
        meters = {f: {"supervisor": CpuMeter([pool.pid])} for f in ("chat", "messages")}
        for family in meters:  # warm-up, not measured
            load(stream_call(pool.url, "syn", RELAY_TOKENS, family), 4, 4, 60)
        results = interleaved(meters, [conc], rounds,
                              lambda f, c: load(stream_call(pool.url, "syn", RELAY_TOKENS, f), requests, c, 120),
                              meters, "relay", "tok/s")
    finally:
        pool.stop()
    chat, msgs = results[("chat", conc)], results[("messages", conc)]
    per_tok = {f: r.cpu * 1e6 / r.tokens if r.tokens else None for f, r in (("chat", chat), ("messages", msgs))}
    ratio = per_tok["messages"] / per_tok["chat"] if per_tok["chat"] and per_tok["messages"] else None
    bench.out["sections"]["messages_relay"] = {"chat_us_per_tok": per_tok["chat"],
                                               "messages_us_per_tok": per_tok["messages"], "ratio": ratio,
                                               "tokens": [chat.tokens, msgs.tokens]}
    rows = [[f, f"{r.tokens:,}", f"{per_tok[f] or 0:.1f}"] for f, r in (("chat", chat), ("messages", msgs))]
    return (table(["surface", "tokens", "supervisor CPU µs/token"], rows)
            + f"\n\nMessages / chat: **{ratio or 0:.2f}x**. {conc} streams at a time x {RELAY_RATE:g} tok/s, "
              f"{RELAY_TOKENS} tokens each, {rounds} interleaved rounds of {requests} requests.")


def added_ttft(bench: Bench, failures: list[str]) -> str:
    rounds, per_round = ttft_rounds(bench)
    load_before = loadavg()
    with tiny_pair(bench, "messages-ttft") as pair:
        if pair is None:
            return "TTFT skipped: needs llama-server and the tiny GGUF"
        direct, pool = pair
        targets = {f"{side} {family}": (url, key, family) for side, url, key in
                   (("direct", direct.url, direct.key), ("pool", pool.url, None)) for family in ("chat", "messages")}
        for url, key, family in targets.values():  # warm-up, not measured
            load(stream_call(url, "tiny", TTFT_TOKENS, family, key), 3, 1, 30)

        def measure(t: str, c: int):
            url, key, family = targets[t]
            return load(stream_call(url, "tiny", TTFT_TOKENS, family, key), per_round, c, 60)

        results = interleaved(targets, [1], rounds, measure, {}, "ttft", "tok/s")
    rows, out = [], {}
    for family in ("chat", "messages"):
        d, p = results[(f"direct {family}", 1)], results[(f"pool {family}", 1)]
        added = pct(p.ttfts, 50) - pct(d.ttfts, 50) if d.ttfts and p.ttfts else None
        out[family] = {"direct_p50": pct(d.ttfts, 50), "pool_p50": pct(p.ttfts, 50), "added_p50": added}
        rows.append([family, f"{len(d.ttfts)}/{len(p.ttfts)}", ms(pct(d.ttfts, 50)), ms(pct(p.ttfts, 50)),
                     ms(added)])
        failures += [n for n in (errors_note(f"direct {family}", d), errors_note(f"pool {family}", p)) if n]
    bench.out["sections"]["messages_ttft"] = out
    return (table(["surface", "requests direct/pool", "direct TTFT p50 ms", "pool TTFT p50 ms", "added p50 ms"],
                  rows)
            + f"\n\n{TTFT_TOKENS}-token answers, one request at a time, {rounds} interleaved rounds of "
              f"{per_round}. 1-min load average: {load_before} before, {loadavg()} after, {os.cpu_count()} CPUs.")


def run(bench: Bench) -> None:
    failures: list[str] = []
    text = relay_cpu(bench) + "\n\n" + added_ttft(bench, failures)
    bench.emit("10. Messages against chat: relay CPU per token, added TTFT", text, failures)
