"""Relay of many concurrent streams: the pool (synthetic runtime) against one
bare Starlette process that streams the same SSE chunks on the same schedule,
and against that app with the schedule kept by a worker process that sends it
each token over ZeroMQ (bare+zmq: the floor of a relay with a worker behind it).

    python scripts/pool_bench/relay.py [--quick] [--cases 64x200,256x50] [--seconds S] [--rounds R]

Each case is N streams x R tokens/s per stream, for about `seconds`. The
streams start spread over one token interval (real streams are not in phase)
and each produces rate x seconds tokens on an absolute schedule. The client
is one aiohttp process on the same machine. Measured per target:
- delivered tok/s: content tokens received / wall time of the case;
- CPU per token: user + system CPU of the server side (bare: its one process;
  bare+zmq: the app and its worker; pool: the supervisor and its workers) / tokens;
- inter-token gap p99: per stream, the time between one token's arrival and
  the next one's (the first token, TTFT, is not a gap; tokens that arrive in
  one read count as gap 0 after the first).
The targets' runs alternate within one invocation, so all see the same
machine load; the ratios are what to read on a shared machine.

Self-contained apart from testkit (Pool, wait_for), procutil (free_port) and the
synthetic backend's token text."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
for _path in (ROOT, ROOT / "scripts"):  # run alone too: the packages, testkit, pool_bench
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import aiohttp  # noqa: E402

from runtime_worker.backends.synthetic import synthetic_tokens  # noqa: E402
from pool_bench.children import CpuMeter  # noqa: E402
from pool_bench.load import pct  # noqa: E402
from procutil.net import free_port  # noqa: E402
from testkit.pool import Pool  # noqa: E402
from testkit.waits import wait_for  # noqa: E402

DEFAULT_CASES = [(16, 50.0), (64, 50.0), (256, 50.0), (512, 50.0), (64, 200.0)]
QUICK_CASES = [(16, 50.0), (64, 200.0)]
PROMPT = "relay"
TOKEN_MARK = b'"delta":{"content":'  # a content chunk (the opening one has a role first)
WORKER_WAIT_S = 30.0  # bare+zmq: how much longer than the schedule's gap the app waits for its worker's next token


def model_name(rate: float) -> str:
    return f"relay-{rate:g}"


# -- the bare servers ---------------------------------------------------------------------------------

def dumps(obj) -> str:
    return json.dumps(obj, separators=(",", ":"))


def chunker(model: str):
    """Chat chunks shaped as the pool's, of one stream: chunk(delta, finish_reason) -> bytes."""
    head = dumps({"id": "chatcmpl_" + os.urandom(16).hex(), "object": "chat.completion.chunk",
                  "created": int(time.time()), "model": model})[:-1]

    def chunk(delta: dict, finish_reason=None) -> bytes:
        tail = dumps({"choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}]})
        return f"data: {head},{tail[1:]}\n\n".encode()
    return chunk


async def scheduled(tokens: list[str], rate: float):
    """The synthetic runtime's schedule: token i at start + i / rate."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    for i, token in enumerate(tokens):
        delay = start + i / rate - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        yield token


def bare_app(zmq_addr: str | None = None):
    """One Starlette app that streams chat chunks shaped as the pool's, on the synthetic
    runtime's schedule. With `zmq_addr`, the tokens come from a worker process over ZeroMQ
    (zmq_worker.py: it keeps the schedule and sends each token's text as it comes; the app
    makes the chunks): the floor of a relay with a worker process behind it, as the pool's."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    streams: dict[bytes, asyncio.Queue] = {}  # the worker's streams, by key
    link = {}

    async def from_worker(key: bytes, job: dict):
        queue = streams[key] = asyncio.Queue()
        try:
            await link["sock"].send_multipart([key, dumps(job).encode()])
            # a dead worker fails the stream (its client counts an error), never holds it
            while token := await asyncio.wait_for(queue.get(), WORKER_WAIT_S + 1 / job["rate"]):
                yield token.decode()
        finally:
            streams.pop(key, None)

    async def chat(request: Request):
        body = await request.json()
        model = body["model"]
        rate = float(model.rsplit("-", 1)[1])
        count = int(body.get("max_tokens") or 16)
        prompt = str(body["messages"][-1]["content"])
        chunk = chunker(model)
        if zmq_addr is None:
            tokens = scheduled(synthetic_tokens(prompt, count), rate)
        else:
            tokens = from_worker(os.urandom(8), {"prompt": prompt, "count": count, "rate": rate})

        async def stream():
            opening = chunk({"role": "assistant", "content": ""})
            async for token in tokens:
                out = chunk({"content": token})
                if opening:
                    out, opening = opening + out, b""
                yield out
            yield chunk({}, "length") + b"data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def health(request: Request):
        return JSONResponse({"status": "ok"})

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if zmq_addr is None:
            yield
            return
        import zmq
        import zmq.asyncio
        sock = link["sock"] = zmq.asyncio.Context().socket(zmq.DEALER)
        sock.connect(zmq_addr)

        async def replies():
            while True:
                key, token = await sock.recv_multipart()
                if (queue := streams.get(key)) is not None:
                    queue.put_nowait(token)
        task = asyncio.create_task(replies())
        yield
        task.cancel()
        sock.close(0)

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]), Route("/health", health)],
                     lifespan=lifespan)


def serve_bare(port: int, zmq_addr: str | None = None) -> None:
    import uvicorn
    uvicorn.run(bare_app(zmq_addr), host="127.0.0.1", port=port, loop="uvloop", http="httptools",
                access_log=False, log_level="warning")


class Bare:
    """The bare server in its own process; with_worker: the app and its ZeroMQ worker."""

    def __init__(self, tmp: Path, with_worker: bool = False) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        name = "relay-bare-zmq" if with_worker else "relay-bare"
        self.log = open(tmp / f"{name}.log", "ab")
        self.procs = []
        argv = [sys.executable, __file__, "--serve-bare", str(self.port)]
        if with_worker:
            addr = f"ipc://{tmp}/{name}.sock"
            worker = [sys.executable, str(Path(__file__).with_name("zmq_worker.py")), addr, "relay"]
            self.procs.append(subprocess.Popen(worker, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT))
            argv += ["--zmq-addr", addr]
        # the app first: pids()[0] is the process that serves HTTP
        self.procs.insert(0, subprocess.Popen(argv, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT))

    def start(self) -> Bare:
        import httpx

        def up() -> bool:
            for proc in self.procs:
                if proc.poll() is not None:
                    raise RuntimeError(f"a bare relay process exited with {proc.returncode}")
            try:
                return httpx.get(self.url + "/health", timeout=2).status_code == 200
            except httpx.TransportError:
                return False
        wait_for(up, 30, what="bare relay server")
        return self

    def pids(self) -> list[int]:
        return [proc.pid for proc in self.procs]

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.log.close()


def pool_pids(pool: Pool) -> list[int]:
    return [pool.proc.pid, *(p.pid for p in pool.descendants())]


# -- measuring ----------------------------------------------------------------------------------------

async def one_stream(session: aiohttp.ClientSession, url: str, body: bytes, delay: float,
                     gaps: list[float]) -> int:
    """One streamed request; returns the tokens it received, appends its gaps."""
    await asyncio.sleep(delay)
    tokens = 0
    last = None
    rest = b""
    async with session.post(url + "/v1/chat/completions", data=body,
                            headers={"Content-Type": "application/json"}) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {(await resp.read())[:200]!r}")
        async for data in resp.content.iter_any():
            now = time.perf_counter()
            events = (rest + data).split(b"\n\n")
            rest = events.pop()
            # every synthetic token is one word after a space, and the compact JSON has no other
            # space than the one of "data: ": merged deltas (a client behind) still count token by token
            k = sum(e.count(b" ") - 1 for e in events if TOKEN_MARK in e)
            if k:
                if last is not None:
                    gaps.append(now - last)
                gaps.extend([0.0] * (k - 1))  # tokens that came in the same read
                tokens += k
                last = now
    return tokens


async def drive(url: str, n: int, rate: float, seconds: float) -> dict:
    count = max(2, int(rate * seconds))
    body = json.dumps({"model": model_name(rate), "stream": True, "max_tokens": count,
                       "messages": [{"role": "user", "content": PROMPT}]}).encode()
    gaps: list[float] = []
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        started = time.perf_counter()
        results = await asyncio.gather(*(one_stream(session, url, body, i / n / rate, gaps) for i in range(n)),
                                       return_exceptions=True)
        wall = time.perf_counter() - started
    errors = [r for r in results if isinstance(r, BaseException)]
    tokens = sum(r for r in results if isinstance(r, int))
    return {"tokens": tokens, "wall": wall, "gaps": gaps, "errors": [repr(e)[:200] for e in errors[:3]],
            "error_count": len(errors), "expected": n * count}


def arun(coro):
    try:
        import uvloop  # a cheaper client leaves more of the cores to the servers under test
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def measure(url: str, pids: list[int], n: int, rate: float, seconds: float) -> dict:
    """`pids`: the server's processes, the one that serves HTTP first (the pool's supervisor)."""
    meter, front = CpuMeter(pids), CpuMeter(pids[:1])
    before, front_before = meter.total(), front.total()
    r = arun(drive(url, n, rate, seconds))
    cpu, front_cpu = meter.total() - before, front.total() - front_before
    tokens = r["tokens"]
    return {"tok_s": tokens / r["wall"] if r["wall"] else 0.0,
            "cpu_us_per_tok": cpu * 1e6 / tokens if tokens else None,
            "front_cpu_us_per_tok": front_cpu * 1e6 / tokens if tokens else None,
            "gap_p99_ms": (pct(r["gaps"], 99) or 0) * 1000, "tokens": tokens, "expected": r["expected"],
            "errors": r["error_count"], "error_sample": r["errors"]}


# -- the section --------------------------------------------------------------------------------------

TARGETS = ("bare", "bare+zmq", "pool")


def run(cases: list[tuple[int, float]], seconds: float, tmp: Path, rounds: int = 1,
        say=lambda msg: print(msg, file=sys.stderr, flush=True)) -> list[dict]:
    """Measure each case on every target, alternating their order. With several rounds, tok/s
    and CPU per token are the rounds' mean, the gap p99 the worst round's."""
    rates = sorted({rate for _, rate in cases})
    most = max(n for n, _ in cases)
    models = [{"name": model_name(rate), "backend": "synthetic", "target_inflight": most, "max_queue": 4 * most,
               "options": {"capacity": most, "tokens_per_second": rate, "output_tokens": 1_000_000}}
              for rate in rates]
    room = 4 * most + 64  # every stream comes from this one address
    pool = Pool(tmp, models, server={"max_connections": room, "max_connections_per_client": room})
    bare, bare_zmq = Bare(tmp), Bare(tmp, with_worker=True)
    out = []
    try:
        pool.start()
        bare.start()
        bare_zmq.start()
        targets = {"bare": (bare.url, bare.pids()), "bare+zmq": (bare_zmq.url, bare_zmq.pids()),
                   "pool": (pool.url, pool_pids(pool))}
        for rate in rates:  # warm-up: connections, imports, first-request paths
            for url, _ in targets.values():
                arun(drive(url, 4, rate, 0.2))
        for i, (n, rate) in enumerate(cases):
            got: dict[str, list[dict]] = {name: [] for name in TARGETS}
            for rnd in range(rounds):
                order = TARGETS if (i + rnd) % 2 == 0 else TARGETS[::-1]
                for name in order:
                    url, pids = targets[name]
                    m = measure(url, pids, n, rate, seconds)
                    got[name].append(m)
                    say(f"relay {n}x{rate:g} {name}: {m['tok_s']:.0f} tok/s, "
                        f"{m['cpu_us_per_tok'] or 0:.0f} us/tok, gap p99 {m['gap_p99_ms']:.1f} ms"
                        + (f", {m['errors']} errors {m['error_sample']}" if m["errors"] else ""))

            def avg(name: str, key: str) -> float | None:
                values = [m[key] for m in got[name] if m[key] is not None]
                return sum(values) / len(values) if values else None
            row = {"n": n, "rate": rate, "expected_tokens": sum(m["expected"] for m in got["pool"]),
                   # of the pool's CPU, the supervisor's (the rest: its workers, the runtime's side of the relay)
                   "supervisor_cpu_us_per_tok": avg("pool", "front_cpu_us_per_tok")}
            for name in TARGETS:
                key = name.replace("+", "_")
                row |= {f"{key}_tok_s": avg(name, "tok_s"), f"{key}_cpu_us_per_tok": avg(name, "cpu_us_per_tok"),
                        f"{key}_gap_p99_ms": max(m["gap_p99_ms"] for m in got[name]),
                        f"{key}_errors": sum(m["errors"] for m in got[name]),
                        f"{key}_tokens": sum(m["tokens"] for m in got[name])}
            out.append(row)
    finally:
        bare.stop()
        bare_zmq.stop()
        pool.stop()
    return out


def markdown(rows: list[dict]) -> str:
    def num(v, fmt="{:,.0f}") -> str:
        return "-" if v is None else fmt.format(v)

    def ratio(a, b) -> str:
        return "-" if not a or not b else f"{a / b:.2f}"
    lines = ["| N streams × tok/s | delivered bare / pool (tok/s) | CPU per token bare / pool | pool/bare CPU "
             "| of it the supervisor / bare | gap p99 bare / pool | pool/bare gap |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['n']} × {r['rate']:g} | {num(r['bare_tok_s'])} / {num(r['pool_tok_s'])} "
            f"| {num(r['bare_cpu_us_per_tok'])} / {num(r['pool_cpu_us_per_tok'])} µs "
            f"| {ratio(r['pool_cpu_us_per_tok'], r['bare_cpu_us_per_tok'])} "
            f"| {ratio(r.get('supervisor_cpu_us_per_tok'), r['bare_cpu_us_per_tok'])} "
            f"| {num(r['bare_gap_p99_ms'], '{:.1f}')} / {num(r['pool_gap_p99_ms'], '{:.1f}')} ms "
            f"| {ratio(r['pool_gap_p99_ms'], r['bare_gap_p99_ms'])} |")
    lines += ["", "| N streams × tok/s | bare+zmq CPU per token (app + worker) | bare+zmq/bare CPU "
              "| pool/(bare+zmq) CPU | gap p99 bare+zmq |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['n']} × {r['rate']:g} | {num(r['bare_zmq_cpu_us_per_tok'])} µs "
            f"| {ratio(r['bare_zmq_cpu_us_per_tok'], r['bare_cpu_us_per_tok'])} "
            f"| {ratio(r['pool_cpu_us_per_tok'], r['bare_zmq_cpu_us_per_tok'])} "
            f"| {num(r['bare_zmq_gap_p99_ms'], '{:.1f}')} ms |")
    errors = [f"{r['n']}x{r['rate']:g}: " + ", ".join(f"{name} {r[name.replace('+', '_') + '_errors']}"
                                                      for name in TARGETS) + " failed streams"
              for r in rows if any(r[name.replace("+", "_") + "_errors"] for name in TARGETS)]
    return "\n".join(lines + ([""] + errors if errors else []))


def section(bench) -> None:
    """Section 5 of scripts/bench."""
    cases, seconds = (QUICK_CASES, 3.0) if bench.quick else (DEFAULT_CASES, 10.0)
    rows = run(cases, seconds, bench.tmp)
    bench.out["sections"]["relay"] = rows
    keys = [name.replace("+", "_") for name in TARGETS]
    shortfalls = [(k, f"{r['n']}x{r['rate']:g}: {k} " + (f"{r[k + '_errors']} failed streams, " if r[k + "_errors"] else "")
                   + f"delivered {r[k + '_tokens']} of {r['expected_tokens']} tokens")
                  for r in rows for k in keys if r[k + "_errors"] or r[k + "_tokens"] != r["expected_tokens"]]
    # the pool falling short fails the bench; a reference floor that could not keep up on this machine
    # (a busy one) is said beside its table: its ratios for that row are not to be trusted
    failures = [line for k, line in shortfalls if k == "pool"]
    text = markdown([{**r, **{k + "_errors": 0 for k in keys}} for r in rows])  # failures listed by emit
    floors = [line for k, line in shortfalls if k != "pool"]
    if floors:
        text += "\n\nA floor that fell short on this machine (its ratios in that row are not to be trusted):\n" \
            + "\n".join(f"- {line}" for line in floors)
    text += (f"\n\n{seconds:g} s streams of the synthetic runtime, the targets in turn; the bare server is "
             "one Starlette process streaming the same chunks on the same schedule; bare+zmq is that app "
             "with the schedule kept by a worker process that sends each token's text over ZeroMQ (the "
             "floor of a relay with a worker process behind it, as the pool's). CPU: user + system of "
             "the server side (pool: supervisor and workers; bare+zmq: app and worker) per delivered token. "
             "bare+zmq sends each token alone: where tokens come faster than one wake-up each, the pool, "
             "which sends what a wake-up has ready as one frame, costs less than it.")
    bench.emit("5. Relay of many streams: a bare SSE server vs the pool", text, failures)


def parse_cases(text: str) -> list[tuple[int, float]]:
    cases = []
    for item in text.split(","):
        n, rate = item.lower().split("x")
        cases.append((int(n), float(rate)))
    return cases


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="two small cases, 3 s each (a smoke test)")
    ap.add_argument("--cases", help="comma-separated NxRATE, e.g. 64x200,256x50")
    ap.add_argument("--seconds", type=float, help="length of each stream (default 10, quick 3)")
    ap.add_argument("--rounds", type=int, default=1, help="runs of every target per case")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    ap.add_argument("--serve-bare", type=int, help=argparse.SUPPRESS)  # the bare server's own process
    ap.add_argument("--zmq-addr", help=argparse.SUPPRESS)  # ... with its tokens from this worker
    args = ap.parse_args(argv)
    if args.serve_bare:
        serve_bare(args.serve_bare, args.zmq_addr)
        return 0
    cases = parse_cases(args.cases) if args.cases else QUICK_CASES if args.quick else DEFAULT_CASES
    seconds = args.seconds or (3.0 if args.quick else 10.0)
    with tempfile.TemporaryDirectory(prefix="relay-bench-") as tmp:
        rows = run(cases, seconds, Path(tmp), rounds=args.rounds)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    print(markdown(rows))
    print(f"\n{seconds:g} s streams, {args.rounds} round(s) per case, the targets in turn; "
          f"{os.cpu_count()} CPUs, 1-min load {os.getloadavg()[0]:.2f} after.")
    return 1 if any(r[name.replace("+", "_") + "_errors"] for r in rows for name in TARGETS) else 0


if __name__ == "__main__":
    sys.exit(main())
