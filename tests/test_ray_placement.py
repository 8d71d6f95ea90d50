"""RemoteWorker, the supervisor's handle of a worker on a Ray node, against a
fake actor (no Ray needed): the log mirrored in order, the exit reported, a
lost actor counted as a crash, a kill that the actor does not carry out
escalated to killing the actor, the worker's key revoked when it is gone."""

from __future__ import annotations

import asyncio
import concurrent.futures

import pytest

from supervisor.replicas import ray_placement
from supervisor.replicas.ray_placement import ACTOR_LOST, RemoteWorker
from tests.procs import until


class Ref:
    def __init__(self, value=None, error: Exception | None = None, pending: bool = False) -> None:
        self._future: concurrent.futures.Future = concurrent.futures.Future()
        if error is not None:
            self._future.set_exception(error)
        elif not pending:
            self._future.set_result(value)

    def future(self) -> concurrent.futures.Future:
        return self._future


class Method:
    def __init__(self, fn) -> None:
        self.fn = fn

    def remote(self, *args):
        return self.fn(*args)


class FakeActor:
    """WorkerHost's calls: `wait` resolves when the test ends the worker."""

    def __init__(self, chunks: list[bytes], dropped_first: int = 0) -> None:
        self.exit = Ref(pending=True)
        self.output = b"".join(chunks)
        self.chunks = chunks
        self.dropped_first = dropped_first
        self.calls: list[str] = []
        self.wait = Method(lambda: self._call("wait", self.exit))
        self.poll = Method(self._poll)
        self.kill = Method(lambda: self._call("kill", Ref(None)))
        self.stop = Method(lambda timeout: self._call("stop", Ref(0)))

    def _call(self, name: str, ref: Ref) -> Ref:
        self.calls.append(name)
        return ref

    def _poll(self, offset: int) -> Ref:
        self.calls.append("poll")
        end = sum(len(c) for c in self.chunks[:self.calls.count("poll")])  # one more chunk per poll
        dropped = self.dropped_first if offset == 0 else 0
        return Ref({"view": {"rss_bytes": 123, "cpu_percent": 1.0, "children": [], "gpu_memory_bytes": None},
                    "output": self.output[offset + dropped:end], "end": end, "dropped": dropped})


INFO = {"pid": 4242, "host": "gpu-host-a", "node_id": "ab" * 28, "ip": "10.0.0.5"}


@pytest.fixture
def fast(monkeypatch):
    monkeypatch.setattr(ray_placement, "POLL_S", 0.01)
    monkeypatch.setattr(ray_placement, "KILL_GRACE_S", 0.05)
    killed: list = []
    monkeypatch.setattr(ray_placement, "_kill", killed.append)
    return killed


def test_the_log_is_mirrored_in_order_and_the_exit_reported(tmp_path, fast):
    async def go():
        actor = FakeActor([b"one\n", b"two\n", b"three\n"], dropped_first=2)
        revoked = []
        log_path = tmp_path / "m-0.log"
        worker = RemoteWorker(actor, INFO, log_path, on_exit=lambda: revoked.append(True))
        assert (worker.pid, worker.node, worker.returncode) == (4242, "gpu-host-a", None)
        await until(lambda: actor.calls.count("poll") >= 3, what="three polls")
        await worker.refresh()
        assert worker.view["rss_bytes"] == 123
        actor.exit.future().set_result(3)
        assert await worker.wait() == 3
        assert worker.returncode == 3 and revoked == [True] and fast == [actor]
        text = log_path.read_text()
        # the first two bytes were dropped on the node (said so), then every line once, in order
        assert text == "[llm-pool: 2 bytes of this worker's output were dropped]\ne\ntwo\nthree\n", text
        worker.kill_tree()  # after the exit: nothing to do
        assert "kill" not in actor.calls

    asyncio.run(go())


def test_a_lost_actor_is_a_crash_and_its_key_is_revoked(tmp_path, fast):
    async def go():
        actor = FakeActor([b"x\n"])
        revoked = []
        worker = RemoteWorker(actor, INFO, tmp_path / "m-0.log", on_exit=lambda: revoked.append(True))
        actor.exit.future().set_exception(RuntimeError("ActorDiedError: the node died"))
        assert await worker.wait() == ACTOR_LOST
        assert revoked == [True] and fast == [actor]

    asyncio.run(go())


def test_a_kill_the_actor_does_not_carry_out_kills_the_actor(tmp_path, fast):
    async def go():
        actor = FakeActor([b"x\n"])
        worker = RemoteWorker(actor, INFO, tmp_path / "m-0.log", on_exit=lambda: None)
        worker.kill_tree()
        assert "kill" in actor.calls
        await until(lambda: fast == [actor], what="the actor ended")  # after KILL_GRACE_S (0.05 here)
        # (Ray would now end the actor, and its wait fail)
        actor.exit.future().set_exception(RuntimeError())
        assert await worker.wait() == ACTOR_LOST

    asyncio.run(go())


def test_the_actor_hands_out_its_output_in_chunks_under_rays_inline_limit(monkeypatch):
    from types import SimpleNamespace

    from node_host import host as node_host
    from node_host.host import WorkerHost
    monkeypatch.setattr(node_host, "LOG_CHUNK_BYTES", 4)
    monkeypatch.setattr(node_host, "LOG_KEEP_BYTES", 8)
    host = WorkerHost()
    host.worker = SimpleNamespace(pid=1, returncode=0)  # exited: no process view

    async def go():
        stream = asyncio.StreamReader()
        stream.feed_data(b"0123456789ab")  # 12 bytes: the first 4 fall out of what it keeps
        stream.feed_eof()
        await host._keep_output(stream)
        got = await host.poll(0)
        assert (got["output"], got["dropped"], got["end"], got["more"]) == (b"4567", 4, 8, True)
        got = await host.poll(8)
        assert (got["output"], got["dropped"], got["end"], got["more"]) == (b"89ab", 0, 12, False)
        assert (await host.poll(12))["output"] == b""

    asyncio.run(go())
