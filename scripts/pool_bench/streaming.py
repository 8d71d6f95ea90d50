"""1. Streaming through a real llama-server (the tiny test GGUF, and the demo model when
present): tokens/s, time to first token and CPU per token at concurrency 1, 2 and 4, a
llama-server started here vs the pool (llama_server backend, same binary, model and flags)."""

from __future__ import annotations

import os

from pool_bench import memory
from pool_bench.bench import Bench
from pool_bench.children import CpuMeter, LlamaProc, PoolProc, RssSampler
from pool_bench.interleave import interleaved
from pool_bench.load import load, pct, streaming_call
from pool_bench.report import errors_note, loadavg, ms, num, per_1k_tokens, ratio, say, table


def requests(quick: bool, model: str, c: int) -> int:
    if quick:
        return max(4, 2 * c)
    if model == "tiny":
        return max(24, 8 * c)
    return max(6, 2 * c)


def run(bench: Bench) -> None:
    if not bench.binary:
        bench.note("section 1 skipped: no llama-server binary (set LLAMA_SERVER_BIN or run "
                   "scripts/install-llama-server)")
        return
    rows, data, notes = [], [], []
    load_before = loadavg()
    concs = [1, 2, 4]
    rounds = 1 if bench.quick else 2
    for m in bench.llama_models():
        say(f"section 1: {m['name']}: starting llama-server and the pool")
        extra = [*m["args"], "--ignore-eos"]
        direct = LlamaProc(bench.tmp, f"llama-direct-{m['name']}", bench.binary, m["path"], m["ctx"], 4, extra)
        pool = PoolProc(bench.tmp, f"pool-{m['name']}", [{
            "name": m["name"], "backend": "llama_server", "target_inflight": 4, "max_queue": 256,
            "load_timeout_s": 180.0,
            "options": {"model": m["path"], "binary": bench.binary, "ctx_size": m["ctx"], "extra_args": extra}}])
        try:
            direct.ready()
            pool.ready()
            targets = {"direct": (direct.url, direct.key), "pool": (pool.url, None)}
            for name, (url, key) in targets.items():  # warm-up, not measured
                load(streaming_call(url, m["name"], 8, key), 2, 1, 60)
            meters = {"direct": {"llama": CpuMeter([direct.pid])},
                      "pool": {"pool": CpuMeter([pool.pid, *(w["pid"] for w in pool.workers() if w["pid"])]),
                               "llama": CpuMeter([c["pid"] for w in pool.workers() for c in w["children"]])}}
            idle_rss = pool.rss()
            cap = 20 if bench.quick else 30 if m["name"] == "tiny" else 25

            def measure(t: str, c: int):
                url, key = targets[t]
                return load(streaming_call(url, m["name"], m["max_tokens"], key),
                            requests(bench.quick, m["name"], c), c, cap)

            with RssSampler([pool.pid]) as sampler:
                results = interleaved(targets, concs, rounds, measure, meters, m["name"], "tok/s")
            memory.record(bench, f"llama_server pool ({m['name']})", pool, idle_rss, sampler.peak.get(pool.pid))
        finally:
            pool.stop()
            direct.stop()
        for c in concs:
            d, p = results[("direct", c)], results[("pool", c)]
            dt = d.tokens / d.wall if d.wall else None
            pt = p.tokens / p.wall if p.wall else None
            rows.append([m["name"], c, m["max_tokens"], f"{d.done}/{p.done}", num(dt), num(pt), ratio(pt, dt),
                         f"{ms(pct(d.ttfts, 50))} / {ms(pct(d.ttfts, 95))}",
                         f"{ms(pct(p.ttfts, 50))} / {ms(pct(p.ttfts, 95))}",
                         ms(pct(p.ttfts, 50) - pct(d.ttfts, 50)) if d.ttfts and p.ttfts else "-",
                         per_1k_tokens(d, "llama"), per_1k_tokens(p, "llama"), per_1k_tokens(p, "pool")])
            data.append({"model": m["name"], "concurrency": c, "direct_tok_s": dt, "pool_tok_s": pt,
                         "direct_ttft_p50": pct(d.ttfts, 50), "pool_ttft_p50": pct(p.ttfts, 50),
                         "direct_ttft_p95": pct(d.ttfts, 95), "pool_ttft_p95": pct(p.ttfts, 95),
                         "requests": [d.done, p.done], "errors": [len(d.errors), len(p.errors)],
                         "cpu_s": {"direct": d.cpu_by, "pool": p.cpu_by},
                         "tokens": [d.tokens, p.tokens]})
            notes += [n for n in (errors_note(f"{m['name']} c={c} direct", d),
                                  errors_note(f"{m['name']} c={c} pool", p)) if n]
    bench.out["sections"]["streaming"] = data
    text = table(["model", "conc", "max_tokens", "requests direct/pool", "direct tok/s", "pool tok/s",
                  "pool/direct", "direct TTFT p50 / p95 ms", "pool TTFT p50 / p95 ms", "TTFT p50 added ms",
                  "llama-server CPU ms/1k tok direct", "llama-server CPU ms/1k tok in pool",
                  "pool CPU ms/1k tok (supervisor + worker)"], rows)
    text += ("\n\ntok/s: completion tokens of all requests / wall time, aggregated over "
             f"{rounds} interleaved round(s); every request generates exactly max_tokens (--ignore-eos). "
             "CPU ms/1k tok: user + system CPU of those processes during the measured rounds, per 1000 "
             "completion tokens (steadier than tokens/s on a shared machine). 1-min load average: "
             f"{load_before} before, {loadavg()} after, {os.cpu_count()} CPUs.")
    bench.emit("1. Streaming through llama-server: direct vs pool", text, notes)
