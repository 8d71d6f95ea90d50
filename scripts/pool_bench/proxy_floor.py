"""The floors of section 6: what a streamed request's first token pays to cross a proxy at
least, read beside the pool's added time to first token.

- proxy: one FastAPI process (the pool's uvicorn settings) that forwards the request to
  llama-server over aiohttp and streams its bytes back as they come: any Python proxy's
  one hop;
- proxy+zmq: the same app handing the request over ZeroMQ to an asyncio worker process
  (zmq_worker.py: uvloop, the socket's FD watched by the loop, a task per request) that
  makes that call and sends each chunk back: the floor of a design with a worker process
  between the edge and the runtime, as the pool's. Neither reads nor reshapes the chunks (the pool does)."""

from __future__ import annotations

import sys
from pathlib import Path

from pool_bench.children import Proc, uvicorn_app

PROXY_APP = '''
import contextlib, os, aiohttp
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
UPSTREAM = os.environ["BENCH_UPSTREAM"] + "/v1/chat/completions"
HEADERS = {"Authorization": "Bearer " + os.environ["BENCH_UPSTREAM_KEY"], "Content-Type": "application/json"}

@contextlib.asynccontextmanager
async def lifespan(app):
    global session
    session = aiohttp.ClientSession()
    yield
    await session.close()

app = FastAPI(lifespan=lifespan)

@app.post("/v1/chat/completions")
async def chat(request: Request):
    resp = await session.post(UPSTREAM, data=await request.body(), headers=HEADERS)

    async def relay():
        try:
            async for data in resp.content.iter_any():
                yield data
        finally:
            resp.release()
    return StreamingResponse(relay(), status_code=resp.status, media_type="text/event-stream")

@app.get("/health")
async def health():
    return {"status": "ok"}
'''

# the app's end: each request a key, its chunks queued by the one reader of the DEALER, an
# empty frame for its end
PROXY_ZMQ_APP = '''
import asyncio, contextlib, itertools, os
import zmq, zmq.asyncio
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
streams, keys = {}, itertools.count()

@contextlib.asynccontextmanager
async def lifespan(app):
    global sock
    sock = zmq.asyncio.Context().socket(zmq.DEALER)
    sock.connect(os.environ["BENCH_ZMQ_ADDR"])
    async def replies():
        while True:
            key, data = await sock.recv_multipart()
            if (queue := streams.get(key)) is not None:
                queue.put_nowait(data)
    task = asyncio.create_task(replies())
    yield
    task.cancel()

app = FastAPI(lifespan=lifespan)

@app.post("/v1/chat/completions")
async def chat(request: Request):
    key = b"%d" % next(keys)
    queue = streams[key] = asyncio.Queue()
    await sock.send_multipart([key, await request.body()])

    async def relay():
        try:  # a dead worker fails the stream (its client counts an error), never holds it
            while data := await asyncio.wait_for(queue.get(), 30):
                yield data
        finally:
            streams.pop(key, None)
    return StreamingResponse(relay(), media_type="text/event-stream")

@app.get("/health")
async def health():
    return {"status": "ok"}
'''

def start(tmp: Path, upstream: str, key: str) -> tuple[Proc, Proc, Proc]:
    """The proxy, the proxy+zmq app and its worker, all in front of the llama-server at `upstream`."""
    env = {"BENCH_UPSTREAM": upstream, "BENCH_UPSTREAM_KEY": key,
           "BENCH_ZMQ_ADDR": f"ipc://{tmp}/bench-proxy-zmq.sock"}
    for module, text in (("bench_proxy_app", PROXY_APP), ("bench_proxy_zmq_app", PROXY_ZMQ_APP)):
        (tmp / f"{module}.py").write_text(text)
    worker = Proc("proxy-zmq-worker", [sys.executable, str(Path(__file__).with_name("zmq_worker.py")),
                                       env["BENCH_ZMQ_ADDR"], "proxy"], tmp / "proxy-zmq-worker.log", env=env)
    procs = [worker]
    try:
        procs.append(uvicorn_app(tmp, "proxy", "bench_proxy_app", env))
        procs.append(uvicorn_app(tmp, "proxy-zmq", "bench_proxy_zmq_app", env))
    except BaseException:
        for proc in procs:
            proc.stop()
        raise
    return procs[1], procs[2], worker
