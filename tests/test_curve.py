"""The ROUTER's CURVE TCP listener (for workers on other hosts), with plain
ZeroMQ peers: only a key the supervisor handed out gets in, every refusal is
logged, and the ipc endpoint of local workers keeps working beside it."""

from __future__ import annotations

import asyncio
import logging

import pytest
import zmq

import protocol as p
from supervisor.replicas.transport import Transport
from tests.procs import until


def _dealer(ctx: zmq.Context, identity: str, endpoint: str, keys=None) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, identity.encode())
    sock.setsockopt(zmq.LINGER, 0)
    if keys:
        sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = keys
    sock.connect(endpoint)
    sock.send(p.encode(p.Hello()))
    return sock


def test_only_keys_handed_out_get_in_and_refusals_are_logged(caplog):
    caplog.set_level(logging.WARNING, logger="llm_pool.curve")

    async def go() -> None:
        transport = Transport()
        transport.start()
        heard: dict[str, list] = {}
        for name in ("local", "good", "stranger", "wrong-server", "plain", "revoked"):
            transport.register(name, lambda msg, name=name: heard.setdefault(name, []).append(msg))
        remote = transport.listen_tcp("127.0.0.1", 0)
        endpoint = f"tcp://127.0.0.1:{remote.port}"
        ctx = zmq.Context()
        peers = []
        try:
            good_public, good_secret = zmq.curve_keypair()
            remote.allow(good_public)
            revoked_public, revoked_secret = zmq.curve_keypair()
            remote.allow(revoked_public)
            remote.revoke(revoked_public)
            stranger_public, stranger_secret = zmq.curve_keypair()
            other_server, _ = zmq.curve_keypair()
            peers += [
                _dealer(ctx, "local", transport.endpoint),  # ipc, no CURVE: a local worker
                _dealer(ctx, "good", endpoint, (remote.server_public, good_public, good_secret)),
                _dealer(ctx, "stranger", endpoint, (remote.server_public, stranger_public, stranger_secret)),
                _dealer(ctx, "wrong-server", endpoint, (other_server, good_public, good_secret)),
                _dealer(ctx, "plain", endpoint),
                _dealer(ctx, "revoked", endpoint, (remote.server_public, revoked_public, revoked_secret)),
            ]
            await until(lambda: "local" in heard and "good" in heard)
            # the refusals are logged: two unknown keys by ZAP, failed handshakes by the monitor
            await until(lambda: sum("refused" in r.getMessage() for r in caplog.records) >= 3)
            await asyncio.sleep(0.3)  # a refused peer that got in anyway would have been heard by now
            assert sorted(heard) == ["good", "local"]
            assert isinstance(heard["good"][0], p.Hello)
            # and the way back works over both endpoints
            transport.send("good", p.Heartbeat())
            transport.send("local", p.Heartbeat())
            for sock in peers[:2]:
                assert await asyncio.to_thread(sock.poll, 2000), "no reply reached the worker"
                assert isinstance(p.decode(sock.recv()), p.Heartbeat)
            messages = [r.getMessage() for r in caplog.records]
            for public in (stranger_public, revoked_public):
                assert any(f"its CURVE key {public.decode()} is not one" in m and "127.0.0.1" in m
                           for m in messages), messages
            assert any("handshake failed" in m for m in messages), messages
            # a refused peer retries ten times a second: that is not ten lines a second
            assert len(messages) <= 6, messages
        finally:
            for sock in peers:
                sock.close()
            ctx.term()
            await transport.close()

    asyncio.run(go())


def test_a_tcp_worker_without_keys_refuses_to_start(monkeypatch):
    from runtime_worker.__main__ import Worker, parse_args
    for name in ("LLM_POOL_CURVE_SERVER_KEY", "LLM_POOL_CURVE_PUBLIC_KEY", "LLM_POOL_CURVE_SECRET_KEY"):
        monkeypatch.delenv(name, raising=False)
    args = parse_args(["--endpoint", "tcp://127.0.0.1:1", "--replica", "x/0", "--backend", "synthetic"])
    with pytest.raises(SystemExit, match="CURVE"):
        Worker(args)


def test_the_worker_takes_its_keys_out_of_its_environment(monkeypatch):
    from protocol.curve import curve_env, take_curve_keys
    env = curve_env(b"s" * 40, b"p" * 40, b"k" * 40)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert take_curve_keys() == (b"s" * 40, b"p" * 40, b"k" * 40)
    import os
    assert not set(env) & set(os.environ)  # a runtime it starts does not inherit the secret
    assert take_curve_keys() is None


def test_frames_sent_in_one_loop_turn_reach_a_worker_in_order_the_first_at_once_the_rest_as_one_batch():
    """Transport sends the first frame for a worker in a loop turn at once (a lone
    request waits for no batch) and what follows it in that turn as one batch after
    the turn; frames to a peer that is not there each call their on_failed, in order,
    after the turn."""
    async def go() -> None:
        transport = Transport()
        transport.start()
        ctx = zmq.Context.instance()
        worker = ctx.socket(zmq.DEALER)
        worker.setsockopt(zmq.IDENTITY, b"w")
        worker.setsockopt(zmq.LINGER, 0)
        heard = []
        transport.register("w", heard.append)
        try:
            worker.connect(transport.endpoint)
            worker.send(p.encode(p.Hello()))
            await until(lambda: heard)
            failed = []
            for i in range(3):
                transport.send("w", p.Cancel(job=f"j{i}"))
                transport.send("nobody", p.Cancel(job=f"x{i}"), on_failed=lambda i=i: failed.append(i))
            assert not failed  # a failed send is told after the turn, never inside send()
            # still in the same turn (these polls block the loop): the first frame left at once,
            # the rest wait for the turn's end
            assert worker.poll(2000)
            assert p.decode_many(worker.recv()) == [p.Cancel(job="j0")]
            assert not worker.poll(100)
            await until(lambda: len(failed) == 3)
            assert failed == [0, 1, 2]
            assert worker.poll(2000)
            frames = worker.recv_multipart()
            assert len(frames) == 1 and p.decode_many(frames[0]) == [p.Cancel(job=f"j{i}") for i in (1, 2)]
            transport.send("w", p.Cancel(job="next"))  # a later turn: a frame of its own, after the batch
            assert await asyncio.to_thread(worker.poll, 2000)
            assert p.decode_many(worker.recv()) == [p.Cancel(job="next")]
        finally:
            worker.close()
            await transport.close()
    asyncio.run(asyncio.wait_for(go(), 20))
