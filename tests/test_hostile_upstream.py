"""A hostile (or broken) runtime behind a real pool: an openai_remote model
pointed at a small HTTP server in this test that answers each request by its
prompt: a line with no end, a gzip bomb, a choice index of twenty million, an
answer too big for one frame, an HTML page, a redirect, a stream cut short.
Each fails its own job with a 502 (an error event when streamed); the worker,
its other jobs and a bystander model go on, and the worker's memory peak stays
bounded."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest

from tests.conftest import synthetic
from tests.pool import Pool
from testkit.hostile_upstream import CHAT, MiB, serve_hostile

BUDGET = 16 * MiB  # the pool's max_job_output_bytes in this test; the line cap stays at its default (8 MiB)


@pytest.fixture(scope="module")
def upstream():
    server = serve_hostile()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def pool(upstream, tmp_path_factory):
    p = Pool(tmp_path_factory.mktemp("hostile-upstream"), [
        {"name": "hostile", "backend": "openai_remote", "target_inflight": 8,
         "options": {"base_url": upstream + "/v1", "model": "m"}},
        synthetic("bystander", tps=20, tokens=60)], server={"max_job_output_bytes": BUDGET})
    p.start()
    yield p
    p.stop()


def ask(pool: Pool, prompt: str, stream: bool = False) -> httpx.Response:
    return pool.http.post(CHAT, json={"model": "hostile", "stream": stream,
                                      "messages": [{"role": "user", "content": prompt}]})


def failure(r: httpx.Response) -> dict:
    """The error a client saw: a 502's body, or a stream's error event (a stream never ends "stop" then)."""
    if r.status_code != 200:
        assert r.status_code == 502, r.text
        return r.json()["error"]
    events = stream_events(r)
    assert not any(c.get("finish_reason") == "stop" for e in events for c in e.get("choices") or ()), r.text
    errors = [e["error"] for e in events if "error" in e]
    assert errors, r.text
    return errors[0]


def peak_rss(pid: int) -> int:
    """The process's resident-set high-water mark (VmHWM), in bytes."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def stream_events(r: httpx.Response) -> list[dict]:
    return [json.loads(line[6:]) for line in r.text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


def bystanders(pool: Pool):
    """An honest stream on the hostile model's worker and one on another model, both running meanwhile."""
    ex = ThreadPoolExecutor(2)
    honest = ex.submit(ask, pool, "slow")
    other = ex.submit(pool.http.post, CHAT, json={"model": "bystander", "messages": [{"role": "user",
                                                                                       "content": "x"}]})
    return ex, honest, other


def assert_bystanders_served(ex, honest, other, pool: Pool, pids: dict) -> None:
    r = honest.result()
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "".join(
        f"t{i} " for i in range(30)), r.text
    assert r.json()["choices"][0]["finish_reason"] == "stop"
    r = other.result()
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 60
    ex.shutdown()
    assert {w["model"]: w["pid"] for w in pool.workers()} == pids  # no worker died or was restarted
    assert all(w["restarts"] == 0 for w in pool.workers())


def test_oversized_answers_fail_their_job_within_bounded_memory(pool):
    pids = {w["model"]: w["pid"] for w in pool.workers()}
    worker = pids["hostile"]
    ex, honest, other = bystanders(pool)
    before = psutil.Process(worker).memory_info().rss
    for prompt, words in [("endless-line", "line longer than"), ("bomb", "max_job_output_bytes"),
                          ("flood", "max_job_output_bytes")]:
        for stream in (True, False):
            error = failure(ask(pool, prompt, stream))
            assert error["code"] == "runtime_error", (prompt, stream, error)
            assert (words if stream else "max_job_output_bytes") in error["message"], (prompt, stream, error)
    # Bound: the worker's peak (VmHWM) grows less than 4 x the 16 MiB budget over its resting size; a
    # 40 MiB line read whole (twice over, as it grows), or a 256 MiB inflated bomb, would pass it.
    grown = peak_rss(worker) - before
    assert grown < 4 * BUDGET, f"worker peak grew {grown / MiB:.0f} MiB"
    # an embeddings answer within the budget but over the frame cap: its job fails, named, not "lost track"
    r = pool.http.post("/v1/embeddings", json={"model": "hostile", "input": "x"})
    assert r.status_code == 502 and "frame cap" in r.json()["error"]["message"], r.text
    assert_bystanders_served(ex, honest, other, pool, pids)
    print(f"worker peak RSS growth: {grown / MiB:.0f} MiB")


def test_a_choice_index_past_n_is_a_protocol_error_not_an_allocation(pool):
    pids = {w["model"]: w["pid"] for w in pool.workers()}
    before = peak_rss(pids["hostile"])
    supervisor_before = psutil.Process(pool.proc.pid).memory_info().rss
    ex, honest, other = bystanders(pool)
    for prompt in ("huge-index", "far-choice"):
        for stream in (True, False):
            error = failure(ask(pool, prompt, stream))
            assert error["code"] == "protocol_error" and "choice index" in error["message"], (prompt, stream, error)
    # Bound: 32 MiB, for peaks of the worker and (resident) of the supervisor; a list of
    # 2x10^7 finish reasons, or 3x10^6 choices, takes hundreds of MiB.
    assert peak_rss(pids["hostile"]) - before < 32 * MiB
    assert psutil.Process(pool.proc.pid).memory_info().rss - supervisor_before < 32 * MiB
    assert_bystanders_served(ex, honest, other, pool, pids)


@pytest.mark.parametrize("prompt", ["html", "json", "redirect", "cut", "no-finish"])
def test_a_broken_answer_is_never_a_success(pool, prompt):
    if prompt != "json":  # a JSON answer is right for a request that wants it whole
        assert failure(ask(pool, prompt))["code"] == "runtime_error"
    assert failure(ask(pool, prompt, stream=True))["code"] == "runtime_error"


def test_sse_lines_are_found_across_any_chunking():
    """Pure: the reader's lines, whatever the chunk boundaries, line endings or comment lines."""
    import asyncio

    from runtime_worker.backends.base import JobError
    from runtime_worker.upstream import sse_data

    class Body:  # what sse_data reads: UpstreamBody.chunks()
        def __init__(self, pieces):
            self.pieces = pieces

        async def chunks(self):
            for piece in self.pieces:
                yield piece

    def lines(pieces, cap=64):
        async def run():
            return [d async for d in sse_data(Body(pieces), cap)]
        return asyncio.run(run())

    text = b": ping\n\ndata: {\"a\": 1}\r\n\nevent: x\ndata:{\"b\":2}\n\ndata: [DONE]\n\n"
    want = [b'{"a": 1}', b'{"b":2}', b"[DONE]"]
    for size in (1, 2, 3, 7, len(text)):
        assert lines([text[i:i + size] for i in range(0, len(text), size)]) == want, size
    assert lines([b"data: x\n", b"data: y"]) == [b"x", b"y"]  # an unfinished last line still counts
    for pieces in ([b"data: " + b"z" * 100 + b"\n"], [b"data: "] + [b"z"] * 100):  # over the 64 byte cap
        with pytest.raises(JobError, match="longer than"):
            lines(pieces)
    assert lines([b"\n" * 10_000, b": c\n" * 1000, b"data: ok\n"]) == [b"ok"]  # long lines of nothing: fine


def test_the_choices_a_runtime_may_send_are_those_asked_for():
    """Pure: a choice index is below n (times the prompts of a legacy completions batch), never a list that long."""
    from runtime_worker.backends.base import JobError
    from protocol.choices import choice_limit
    from runtime_worker.openai_events import choice_index

    assert choice_limit({}, "chat") == 1 and choice_limit({"n": 3}, "chat") == 3
    assert choice_limit({"n": 2, "prompt": ["a", "b", [1, 2]]}, "completions") == 6
    assert choice_limit({"n": 2, "prompt": ["a", "b"]}, "chat") == 2  # a batch only in legacy completions
    assert choice_limit({"n": 2, "prompt": [1, 2, 3]}, "completions") == 2  # one prompt of tokens
    assert choice_limit({"n": 128, "prompt": ["a"] * 100}, "completions") == 2048  # the ceiling
    assert choice_limit({"n": True}, "chat") == choice_limit({"n": "9"}, "chat") == 1
    assert choice_index({"index": 2}, 3) == 2 and choice_index({}, 1) == 0
    for bad in ({"index": 3}, {"index": -1}, {"index": 20_000_000}, {"index": "0"}, {"index": 1.5}, []):
        with pytest.raises(JobError) as err:
            choice_index(bad, 3)
        assert err.value.code == "protocol_error"
