"""Scale: many slow streams at once through one supervisor, against the bare Starlette
SSE server of section 5 on the same schedule.

    python scripts/pool_bench/scale.py [--streams 10000] [--rate 1] [--seconds 20] [--clients 4]

N streams of `rate` tokens/s each, started spread over one token interval, each for
about `seconds`. The client is `clients` processes (aiohttp on uvloop), each driving
its share of the streams, so that one client process is not what is measured.
Measured per target (bare and pool in turn, the same N):
- delivered / scheduled tokens (what arrived of rate x seconds x N);
- inter-token gap p99 (section 5's definition; the schedule's own gap is 1/rate);
- server RSS per stream: (peak RSS during the run - RSS before) / N (pool: the
  supervisor alone; its workers' are reported apart: N above 4,096 takes several
  synthetic replicas, as target_inflight is capped per replica);
- CPU per token: user + system CPU of the server side / delivered tokens.
Every process it starts is stopped on exit."""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
for _path in (ROOT, ROOT / "scripts"):  # run alone too: the packages, testkit, pool_bench
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import psutil  # noqa: E402

from pool_bench import relay  # noqa: E402
from pool_bench.children import CpuMeter, RssSampler  # noqa: E402
from pool_bench.load import pct  # noqa: E402
from testkit.pool import Pool  # noqa: E402

DEFAULT_STREAMS, QUICK_STREAMS = 10_000, 1_000
MAX_PER_REPLICA = 4096  # a model's target_inflight per replica (config.py)


def room_for_files(need: int) -> None:
    """Raise this process's open-file soft limit to `need` (each stream is a socket)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (need if hard == resource.RLIM_INFINITY else min(need, hard), hard))


# -- one client process ---------------------------------------------------------------------------------

async def client_share(url: str, first: int, count: int, total: int, rate: float, seconds: float) -> dict:
    """Streams first..first+count of `total`, each delayed by its place in one token interval."""
    import asyncio

    import aiohttp
    tokens_each = max(2, int(rate * seconds))
    body = json.dumps({"model": relay.model_name(rate), "stream": True, "max_tokens": tokens_each,
                       "messages": [{"role": "user", "content": relay.PROMPT}]}).encode()
    gaps: list[float] = []
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        results = await asyncio.gather(*(relay.one_stream(session, url, body, (first + i) / total / rate, gaps)
                                         for i in range(count)), return_exceptions=True)
    errors = [repr(r)[:200] for r in results if isinstance(r, BaseException)]
    return {"tokens": sum(r for r in results if isinstance(r, int)), "expected": count * tokens_each,
            "gaps": gaps, "errors": len(errors), "error_sample": errors[:3]}


def client_main(args) -> int:
    room_for_files(args.share + 256)
    out = relay.arun(client_share(args.url, args.first, args.share, args.total, args.rate, args.seconds))
    Path(args.out).write_text(json.dumps(out))
    return 0


# -- one target -------------------------------------------------------------------------------------------

def measure(url: str, server_pids: list[int], rss_pid: int, n: int, rate: float, seconds: float, clients: int,
            tmp: Path) -> dict:
    """N streams from `clients` processes; the server side's CPU, and `rss_pid`'s RSS growth."""
    shares = [n // clients + (1 if i < n % clients else 0) for i in range(clients)]
    rss_before = psutil.Process(rss_pid).memory_info().rss
    meter = CpuMeter(server_pids)
    cpu_before = meter.total()
    procs, outs, first = [], [], 0
    with RssSampler([rss_pid]) as sampler:
        started = time.perf_counter()
        for i, share in enumerate(shares):
            out = tmp / f"scale-client-{i}.json"
            outs.append(out)
            procs.append(subprocess.Popen(
                [sys.executable, __file__, "--client", "--url", url, "--first", str(first), "--share", str(share),
                 "--total", str(n), "--rate", str(rate), "--seconds", str(seconds), "--out", str(out)],
                cwd=ROOT, start_new_session=True))
            first += share
        try:
            for p in procs:
                p.wait(timeout=seconds * 4 + 120)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        wall = time.perf_counter() - started
    cpu = meter.total() - cpu_before
    parts = [json.loads(o.read_text()) for o in outs if o.exists()]
    tokens = sum(p["tokens"] for p in parts)
    gaps = [g for p in parts for g in p["gaps"]]
    return {"delivered": tokens / max(1, sum(p["expected"] for p in parts)) if parts else 0.0,
            "tokens": tokens, "gap_p99_ms": (pct(gaps, 99) or 0) * 1000, "wall_s": wall,
            "rss_kib_per_stream": (sampler.peak[rss_pid] - rss_before) / 1024 / n,
            "cpu_us_per_tok": cpu * 1e6 / tokens if tokens else None,
            "errors": sum(p["errors"] for p in parts) + (clients - len(parts)),
            "error_sample": [e for p in parts for e in p["error_sample"]][:3]}


def run(n: int, rate: float, seconds: float, clients: int, tmp: Path,
        say=lambda msg: print(msg, file=sys.stderr, flush=True)) -> dict:
    room = n + 256
    room_for_files(room)  # the bare server inherits it
    replicas = -(-n // MAX_PER_REPLICA)  # target_inflight has a cap per replica
    per_replica = -(-n // replicas)
    model = {"name": relay.model_name(rate), "backend": "synthetic", "replicas": replicas,
             "target_inflight": per_replica, "max_queue": n,
             "options": {"capacity": per_replica, "tokens_per_second": rate, "output_tokens": 1_000_000}}
    pool = Pool(tmp, [model], server={"max_connections": room, "max_connections_per_client": room})
    bare = relay.Bare(tmp)
    rows = {}
    try:
        pool.start()
        bare.start()
        for name in ("bare", "pool"):  # warm-up
            url = bare.url if name == "bare" else pool.url
            relay.arun(relay.drive(url, 4, max(rate, 10.0), 0.2))
        worker_rss_before = sum(p.memory_info().rss for p in pool.descendants())
        for name in ("bare", "pool"):
            if name == "bare":
                m = measure(bare.url, bare.pids(), bare.pids()[0], n, rate, seconds, clients, tmp)
            else:
                m = measure(pool.url, relay.pool_pids(pool), pool.proc.pid, n, rate, seconds, clients, tmp)
                m["worker_rss_kib_per_stream"] = (sum(p.memory_info().rss for p in pool.descendants())
                                                  - worker_rss_before) / 1024 / n
            rows[name] = m
            say(f"scale {n}x{rate:g} {name}: delivered {m['delivered']:.3f} of schedule, gap p99 "
                f"{m['gap_p99_ms']:.0f} ms, {m['rss_kib_per_stream']:.1f} KiB/stream, "
                f"{m['cpu_us_per_tok'] or 0:.0f} us/tok" + (f", {m['errors']} errors {m['error_sample']}"
                                                              if m["errors"] else ""))
    finally:
        bare.stop()
        pool.stop()
    return rows


def markdown(n: int, rate: float, seconds: float, clients: int, rows: dict) -> str:
    b, p = rows["bare"], rows["pool"]

    def ratio(a, c) -> str:
        return "-" if not a or not c else f"{a / c:.2f}"
    scheduled = seconds + 1 / rate  # the last stream starts one token interval after the first

    def late(r) -> str:
        return f"{r['wall_s'] / scheduled:.2f}"
    return "\n".join([
        "| target | delivered / scheduled tokens | time taken / scheduled | gap p99 | server RSS per stream "
        "| CPU per token |",
        "|---|---|---|---|---|---|",
        f"| bare | {b['delivered']:.3f} | {late(b)} | {b['gap_p99_ms']:.0f} ms | {b['rss_kib_per_stream']:.1f} KiB "
        f"| {b['cpu_us_per_tok'] or 0:.0f} µs |",
        f"| pool | {p['delivered']:.3f} | {late(p)} | {p['gap_p99_ms']:.0f} ms | {p['rss_kib_per_stream']:.1f} KiB "
        f"(workers {p.get('worker_rss_kib_per_stream', 0):.1f}) | {p['cpu_us_per_tok'] or 0:.0f} µs |",
        "",
        f"{n:,} streams × {rate:g} tok/s for {seconds:g} s, {clients} client processes; pool/bare gap p99 "
        f"{ratio(p['gap_p99_ms'], b['gap_p99_ms'])}, CPU per token {ratio(p['cpu_us_per_tok'], b['cpu_us_per_tok'])}; "
        f"{os.cpu_count()} CPUs."])


def section(bench) -> None:
    """Section 9 of scripts/bench (on request)."""
    n, seconds = (QUICK_STREAMS, 10.0) if bench.quick else (DEFAULT_STREAMS, 20.0)
    rows = run(n, 1.0, seconds, 4, bench.tmp)
    bench.out["sections"]["scale"] = rows
    failures = [f"{name}: {r['errors']} failed streams {r['error_sample']}" for name, r in rows.items() if r["errors"]]
    bench.emit("9. Scale: many slow streams through one supervisor vs a bare SSE server",
               markdown(n, 1.0, seconds, 4, rows), failures)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=DEFAULT_STREAMS)
    ap.add_argument("--rate", type=float, default=1.0, help="tokens/s per stream")
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--clients", type=int, default=4, help="client processes")
    ap.add_argument("--client", action="store_true", help=argparse.SUPPRESS)  # one client process
    ap.add_argument("--url", help=argparse.SUPPRESS)
    ap.add_argument("--first", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--share", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--total", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.client:
        return client_main(args)
    with tempfile.TemporaryDirectory(prefix="scale-bench-") as tmp:
        rows = run(args.streams, args.rate, args.seconds, args.clients, Path(tmp))
    print(markdown(args.streams, args.rate, args.seconds, args.clients, rows))
    return 1 if any(r["errors"] for r in rows.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
