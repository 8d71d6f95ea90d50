"""The worker process of the bench's floors (sections 5 and 6): a ZeroMQ ROUTER served by the
asyncio loop (uvloop, the socket's FD watched, no future per message), a task per request, as
the pool's worker runs each job.

    python scripts/pool_bench/zmq_worker.py ADDR relay|proxy

Each request is [key, body]; `job(send, body)` answers it with frames sent by `send(data)`, and
an empty frame ends the answer (sent here, however the job ends)."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

Job = Callable[[Callable[[bytes], None], bytes], Awaitable[None]]


def serve(addr: str, job: Job) -> None:
    import uvloop
    import zmq

    async def main() -> None:
        loop = asyncio.get_running_loop()
        sock = zmq.Context().socket(zmq.ROUTER)
        sock.bind(addr)

        def send(parts: list[bytes]) -> None:
            sock.send_multipart(parts)
            if sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:  # the FD is edge-triggered: a send may take its edge
                loop.call_soon(drain)

        async def run(peer: bytes, key: bytes, body: bytes) -> None:
            try:
                await job(lambda data: send([peer, key, data]), body)
            finally:
                send([peer, key, b""])

        def drain() -> None:  # read until EAGAIN, which arms the FD again
            while True:
                try:
                    peer, key, body = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    return
                loop.create_task(run(peer, key, body))

        loop.add_reader(sock.getsockopt(zmq.FD), drain)
        drain()
        await asyncio.Event().wait()

    uvloop.run(main())


async def relay_job(send: Callable[[bytes], None], body: bytes) -> None:
    """Section 5's: the synthetic schedule, each token's text as it comes."""
    from pool_bench.relay import scheduled
    from runtime_worker.backends.synthetic import synthetic_tokens
    spec = json.loads(body)
    async for token in scheduled(synthetic_tokens(spec["prompt"], spec["count"]), spec["rate"]):
        send(token.encode())


def proxy_job() -> Job:
    """Section 6's: the request to llama-server (BENCH_UPSTREAM, its key BENCH_UPSTREAM_KEY) over
    one aiohttp session, each piece of its answer as it comes."""
    import aiohttp
    upstream = os.environ["BENCH_UPSTREAM"] + "/v1/chat/completions"
    headers = {"Authorization": "Bearer " + os.environ["BENCH_UPSTREAM_KEY"], "Content-Type": "application/json"}
    session: list[aiohttp.ClientSession] = []

    async def job(send: Callable[[bytes], None], body: bytes) -> None:
        if not session:  # made on the loop that uses it
            session.append(aiohttp.ClientSession())
        async with session[0].post(upstream, data=body, headers=headers) as resp:
            async for data in resp.content.iter_any():
                send(data)
    return job


if __name__ == "__main__":
    root = Path(__file__).resolve().parents[2]
    for path in (root, root / "scripts"):  # run alone: the packages, pool_bench
        if str(path) not in sys.path:
            sys.path.insert(0, str(path))
    serve(sys.argv[1], relay_job if sys.argv[2] == "relay" else proxy_job())
