"""2. Scheduler capacity: the synthetic backend (as fast as possible) through the whole HTTP
stack vs a bare FastAPI endpoint on the same uvicorn settings that returns the same JSON
(the stack's own ceiling): requests/s, latency and CPU per request. A third target, bare
FastAPI + ZeroMQ, relays each request body over a pyzmq DEALER to a blocking ROUTER echo
in another process, which answers the same JSON: the floor of any design that hands a
request to a worker process over ZeroMQ, for the pool's figures to be read against. A fourth,
bare+zmq+async, has the same app relay to an asyncio echo instead (uvloop, the socket's FD
watched by the loop, a task per request that sends the answer): the floor of a worker that can
run many jobs at once, as the pool's does, before it does anything else."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import httpx

from pool_bench import memory, profile
from pool_bench.bench import Bench, synthetic_model
from pool_bench.children import CpuMeter, PoolProc, Proc, RssSampler, uvicorn_app
from pool_bench.interleave import interleaved
from pool_bench.load import load, pct, plain_call
from pool_bench.report import errors_note, loadavg, ms, num, per_request_us, ratio, say, table

BARE_APP = '''
import json, os
from fastapi import FastAPI, Request
BODY = json.loads(open(os.environ["BENCH_BARE_BODY"]).read())
app = FastAPI()

@app.post("/v1/chat/completions")
async def chat(request: Request):
    await request.json()
    return BODY

@app.get("/health")
async def health():
    return {"status": "ok"}
'''

# the same endpoint, its answer from another process over ZeroMQ (one DEALER, replies matched by a key)
BARE_ZMQ_APP = '''
import asyncio, contextlib, itertools, os
import zmq, zmq.asyncio
from fastapi import FastAPI, Request, Response
waiting, keys = {}, itertools.count()

@contextlib.asynccontextmanager
async def lifespan(app):
    global sock
    sock = zmq.asyncio.Context().socket(zmq.DEALER)
    sock.connect(os.environ["BENCH_ZMQ_ADDR"])
    async def replies():
        while True:
            key, body = await sock.recv_multipart()
            if (answer := waiting.pop(key, None)) is not None:  # else a reply nobody waits for: dropped
                answer.set_result(body)
    task = asyncio.create_task(replies())
    yield
    task.cancel()

app = FastAPI(lifespan=lifespan)

@app.post("/v1/chat/completions")
async def chat(request: Request):
    await request.json()
    key = b"%d" % next(keys)
    waiting[key] = asyncio.get_running_loop().create_future()
    await sock.send_multipart([key, await request.body()])
    return Response(await waiting[key], media_type="application/json")

@app.get("/health")
async def health():
    return {"status": "ok"}
'''
ZMQ_ECHO = '''
import os, zmq
sock = zmq.Context().socket(zmq.ROUTER)
sock.bind(os.environ["BENCH_ZMQ_ADDR"])
answer = open(os.environ["BENCH_BARE_BODY"], "rb").read()
while True:
    peer, key, _ = sock.recv_multipart()
    sock.send_multipart([peer, key, answer])
'''

# the echo as a worker that runs its jobs concurrently: each request a task, as the pool's worker
# runs each job (it answers at once). The FD is edge-triggered: read until EAGAIN, and look
# again after a send (which may take the edge).
ZMQ_ASYNC_ECHO = '''
import asyncio, os, uvloop, zmq
answer = open(os.environ["BENCH_BARE_BODY"], "rb").read()

async def main():
    loop = asyncio.get_running_loop()
    sock = zmq.Context().socket(zmq.ROUTER)
    sock.bind(os.environ["BENCH_ZMQ_ADDR"])

    async def job(peer, key):
        sock.send_multipart([peer, key, answer], zmq.NOBLOCK)
        if sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            loop.call_soon(drain)

    def drain():
        while True:
            try:
                peer, key, _ = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            loop.create_task(job(peer, key))

    loop.add_reader(sock.getsockopt(zmq.FD), drain)
    drain()
    await asyncio.Event().wait()

uvloop.run(main())
'''


PROFILE = "profile-section2-c16.speedscope.json"  # beside results.json


def start_bare_zmq(tmp: Path, asynchronous: bool = False) -> tuple[Proc, Proc]:
    """The bare app relaying over ZeroMQ, and its echo, blocking or asyncio (start_bare_app
    wrote the body first)."""
    name = "zmq-async-echo" if asynchronous else "zmq-echo"
    (tmp / "bench_bare_zmq_app.py").write_text(BARE_ZMQ_APP)
    (tmp / f"bench_{name}.py").write_text(ZMQ_ASYNC_ECHO if asynchronous else ZMQ_ECHO)
    env = {"BENCH_BARE_BODY": str(tmp / "bare_body.json"), "BENCH_ZMQ_ADDR": f"ipc://{tmp}/bench-{name}.sock"}
    echo = Proc(name, [sys.executable, str(tmp / f"bench_{name}.py")], tmp / f"{name}.log", env=env)
    return uvicorn_app(tmp, f"bare-{name}", "bench_bare_zmq_app", env), echo


def start_bare_app(tmp: Path, body: dict) -> Proc:
    (tmp / "bench_bare_app.py").write_text(BARE_APP)
    (tmp / "bare_body.json").write_text(json.dumps(body))
    return uvicorn_app(tmp, "bare", "bench_bare_app", {"BENCH_BARE_BODY": str(tmp / "bare_body.json")})


def run(bench: Bench) -> None:
    concs = [1, 4, 16, 64]
    rounds = 1 if bench.quick else 2
    requests = 150 if bench.quick else 2000
    cap = 5 if bench.quick else 12
    load_before = loadavg()
    say("section 2: starting the synthetic pool and a bare FastAPI endpoint")
    pool = PoolProc(bench.tmp, "pool-synthetic", [synthetic_model("synth", 64, 16)])
    bare = bare_zmq = echo = bare_async = async_echo = None
    rows, data, notes, profiled = [], [], [], None
    try:
        pool.ready()
        body = httpx.post(pool.url + "/v1/chat/completions", timeout=30, json={
            "model": "synth", "max_tokens": 16, "messages": [{"role": "user", "content": "hello"}]}).json()
        bare = start_bare_app(bench.tmp, body)
        bare_zmq, echo = start_bare_zmq(bench.tmp)
        bare_async, async_echo = start_bare_zmq(bench.tmp, asynchronous=True)
        targets = {"bare": bare.url, "bare+zmq": bare_zmq.url, "bare+zmq+async": bare_async.url, "pool": pool.url}
        for url in targets.values():
            load(plain_call(url, "synth", 16), 50, 4, 20, raw_url=url)
        idle_rss = pool.rss()
        meters = {"bare": {"bare": CpuMeter([bare.pid])},
                  "bare+zmq": {"app": CpuMeter([bare_zmq.pid]), "echo": CpuMeter([echo.pid])},
                  "bare+zmq+async": {"app": CpuMeter([bare_async.pid]), "echo": CpuMeter([async_echo.pid])},
                  "pool": {"supervisor": CpuMeter([pool.pid]),
                           "worker": CpuMeter([w["pid"] for w in pool.workers() if w["pid"]])}}

        def measure(t: str, c: int):
            return load(plain_call(targets[t], "synth", 16), requests, c, cap, raw_url=targets[t])

        with RssSampler([pool.pid]) as sampler:
            results = interleaved(targets, concs, rounds, measure, meters, "", "req/s")
        memory.record(bench, "synthetic pool (c<=64)", pool, idle_rss, sampler.peak.get(pool.pid))
        # after the measured rounds: py-spy pauses the process to sample it, which would bend their figures
        profiled = profile.record(pool.pid, Path(bench.args.out) / PROFILE, bench.tmp, lambda: load(
            plain_call(pool.url, "synth", 16), 3 * requests, 16, 3 * cap, raw_url=pool.url))
    finally:
        pool.stop()
        for proc in (bare, bare_zmq, echo, bare_async, async_echo):
            if proc:
                proc.stop()
    floor_rows = []
    for c in concs:
        b, z, p = results[("bare", c)], results[("bare+zmq", c)], results[("pool", c)]
        a = results[("bare+zmq+async", c)]
        bq = b.done / b.wall if b.wall else None
        zq = z.done / z.wall if z.wall else None
        aq = a.done / a.wall if a.wall else None
        pq = p.done / p.wall if p.wall else None
        floor_rows.append([c, num(aq), ratio(pq, aq), f"{per_request_us(a, 'app')} + {per_request_us(a, 'echo')}",
                           f"{per_request_us(p, 'supervisor')} + {per_request_us(p, 'worker')}"])
        rows.append([c, f"{b.done}/{p.done}", num(bq), num(zq), num(pq), ratio(pq, bq), ratio(zq, bq), ratio(pq, zq),
                     f"{ms(pct(b.latencies, 50))} / {ms(pct(b.latencies, 99))}",
                     f"{ms(pct(p.latencies, 50))} / {ms(pct(p.latencies, 99))}",
                     per_request_us(b), f"{per_request_us(z, 'app')} + {per_request_us(z, 'echo')}",
                     f"{per_request_us(p, 'supervisor')} + {per_request_us(p, 'worker')}"])
        data.append({"concurrency": c, "bare_rps": bq, "bare_zmq_rps": zq, "bare_zmq_async_rps": aq, "pool_rps": pq,
                     "cpu_s": {"bare": b.cpu_by, "bare+zmq": z.cpu_by, "bare+zmq+async": a.cpu_by, "pool": p.cpu_by},
                     "bare_p50": pct(b.latencies, 50), "bare_p99": pct(b.latencies, 99),
                     "pool_p50": pct(p.latencies, 50), "pool_p99": pct(p.latencies, 99),
                     "requests": [b.done, z.done, p.done, a.done]})
        notes += [n for n in (errors_note(f"c={c} bare", b), errors_note(f"c={c} bare+zmq", z),
                              errors_note(f"c={c} bare+zmq+async", a),
                              errors_note(f"c={c} pool", p)) if n]
    bench.out["sections"]["capacity"] = data
    text = table(["conc", "requests bare/pool", "bare FastAPI req/s", "bare+zmq req/s", "pool req/s", "pool/bare",
                  "bare+zmq/bare", "pool/(bare+zmq)", "bare p50 / p99 ms", "pool p50 / p99 ms", "bare CPU µs/req",
                  "bare+zmq CPU µs/req (app + echo)", "pool CPU µs/req (supervisor + worker)"], rows)
    text += ("\n\nNon-streaming POST /v1/chat/completions, 16 output tokens; synthetic backend with "
             "capacity 64 at tokens_per_second 0; bare FastAPI = same uvicorn settings (uvloop, httptools, "
             "no access log), same JSON body; bare+zmq = the same app relaying each body over ZeroMQ (ipc) "
             "to a blocking echo process that answers that JSON: what one hop to a worker process over "
             "ZeroMQ costs at least. Load: one client process (uvloop, one raw keep-alive HTTP/1.1 "
             "connection per concurrent caller; httpx's pool would cap the ceiling near 500 req/s) on the "
             f"same machine as the servers. 1-min load average: {load_before} before, {loadavg()} after.")
    text += "\n\n" + table(["conc", "bare+zmq+async req/s", "pool/(bare+zmq+async)",
                             "bare+zmq+async CPU µs/req (app + echo)", "pool CPU µs/req (supervisor + worker)"],
                            floor_rows)
    text += ("\n\nbare+zmq+async: the same relay to an asyncio echo (uvloop; a task per request, as the "
             "pool's worker runs each job): the floor of a worker process that runs jobs concurrently.")
    if profiled:
        text += f"\n\n{profiled}"
        bench.out["sections"]["capacity_profile"] = profiled
    bench.emit("2. Scheduler capacity: synthetic backend vs bare FastAPI", text, notes)
