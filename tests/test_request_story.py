"""One request's whole story (GET /admin/requests/story, `llm-pool requests --id`): a real
llama-server killed under a request, and the 502 row's story holds the crash event and the
replica's log lines of its task; requests at once on one llama-server, each story with its
own task's lines and none of the other's; a runtime that names no tasks (synthetic), whose
story's lines are its time window's and say so. Latency over time per model: the live
samples' TTFT, duration and queue wait p50/p95, against the request log's own rows."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from datetime import datetime

import httpx
import pytest

from runtime_worker.backends.base import Finished, RuntimeTasks, TextDelta
from runtime_worker.llama_tasks import TaskTies
from runtime_worker.warm_swap import SLOTS_MAX_BYTES, SlotClient, SlotsTooLarge
from supervisor.telemetry.latency_window import percentile
from supervisor.telemetry.request_log import parse_tasks, tasks_text
from supervisor.telemetry.request_story import line_times, task_lines
from tests.conftest import IGNORE_EOS, llama, synthetic
from tests.pool import wait_for
from tests.test_cli import cli
from testkit.hostile_upstream import MiB, serve_hostile
from testkit.llama import direct_llama_server


def test_log_line_times_come_from_the_worker_stamp_and_llama_servers_clock():
    start = datetime(2026, 12, 5, 10, 0, 0).timestamp()
    lines = [b"[llama-server] 0.00.001.000 I before any stamp",
             b"2026-12-05 10:00:00,250 m/0#1 INFO starting llama-server: /bin/llama-server -m x",
             b"[llama-server] 0.00.500.000 I srv load_model: loading",
             b"a line of its own with no stamp",
             b"[llama-server] 1.02.000.000 I srv slot launch",
             b"2026-12-05 10:00:01,000 m/0#1 INFO HTTP Request: GET /health"]
    times = line_times(lines)
    assert times[0] is None  # before the first stamped line: no time, never a guessed one
    assert abs(times[1] - (start + 0.25)) < 1e-6 and abs(times[2] - (start + 0.75)) < 1e-6
    assert times[3] == times[2]  # carried from the stamped line before it
    assert abs(times[4] - (start + 0.25 + 62)) < 1e-6 and abs(times[5] - (start + 1.0)) < 1e-6


def test_a_requests_own_lines_are_its_tasks_in_the_run_of_llama_server_that_served_it(tmp_path):
    """Task ids begin again at each start of llama-server: the lines of task 0 are those of the
    run that was up when the request was handed over; another slot's task in the same seconds,
    and the worker's info lines, are not its; the worker's errors of its time are."""
    at = datetime(2026, 12, 5, 10, 0, 0).timestamp()
    log = tmp_path / "m-0.log"
    log.write_bytes(b"\n".join([
        b"2026-12-05 09:59:00,000 m/0#1 INFO starting llama-server: /bin/llama-server -m x",
        b"[llama-server] 0.00.100.000 I slot get_availabl: id  0 | task -1 | selected slot by LRU, t_last = -1",
        b"[llama-server] 0.00.100.100 I slot launch_slot_: id  0 | task 0 | processing task, is_child = 0",
        b"[llama-server] 0.00.200.000 I slot      release: id  0 | task 0 | stop processing: n_tokens = 9",
        b"2026-12-05 09:59:58,000 m/0#1 ERROR runtime died: llama-server was killed by SIGKILL",
        b"2026-12-05 09:59:59,000 m/0#2 INFO starting llama-server: /bin/llama-server -m x",
        b"[llama-server] 0.00.900.000 I slot get_availabl: id  1 | task -1 | selected slot by LRU, t_last = -1",
        b"[llama-server] 0.00.900.100 I slot launch_slot_: id  1 | task 0 | processing task, is_child = 0",
        b"[llama-server] 0.01.100.000 I slot get_availabl: id  0 | task -1 | selected slot by LRU, t_last = -1",
        b"[llama-server] 0.01.100.100 I slot launch_slot_: id  0 | task 2 | processing task, is_child = 0",
        b"2026-12-05 10:00:00,500 m/0#2 INFO cancelling job 0123",
        b"[llama-server] 0.01.800.000 I slot print_timing: id  1 | task 0 | prompt eval time = 1 ms / 5 tokens",
        b"[llama-server] 0.01.800.100 I slot      release: id  1 | task 0 | stop processing: n_tokens = 9",
        b"[llama-server] 0.01.900.000 I slot      release: id  0 | task 2 | stop processing: n_tokens = 9",
        b"2026-12-05 10:00:01,500 m/0#2 WARNING no word from the supervisor for 3.0s (stalled?)",
        b"2026-12-05 10:00:09,000 m/0#3 INFO starting llama-server: /bin/llama-server -m x",
        b"[llama-server] 0.00.100.100 I slot launch_slot_: id  1 | task 0 | processing task, is_child = 0",
    ]) + b"\n")
    found = task_lines(log, [(1, 0)], at - 0.1, at - 5, at + 2 + 5)
    assert [line.split(" I slot ")[-1] if " I slot " in line else line[24:] for line in found["lines"]] == [
        "get_availabl: id  1 | task -1 | selected slot by LRU, t_last = -1",
        "launch_slot_: id  1 | task 0 | processing task, is_child = 0",
        "print_timing: id  1 | task 0 | prompt eval time = 1 ms / 5 tokens",
        "     release: id  1 | task 0 | stop processing: n_tokens = 9",
        "m/0#2 WARNING no word from the supervisor for 3.0s (stalled?)"], found
    assert found["note"] is None
    assert task_lines(log, [(1, 5)], at - 0.1, at - 5, at + 7)["note"] == "nothing of task 5 in the log"
    assert parse_tasks(tasks_text([[1, 7], [0, 8]])) == [(1, 7), (0, 8)] and tasks_text(None) is None
    assert parse_tasks(None) == [] and parse_tasks("1:x") == []


def test_a_seed_tells_a_job_in_slots_only_where_no_other_live_job_could_hold_it():
    """llama_tasks.TaskTies on /slots answers as llama-server gives them (only_metrics): a drawn
    seed ties in a busy or an idle slot; a client's seed only in a busy one, and not when
    another live job asked with the same seed; more slots than tasks tie nothing."""
    answer: list = []

    async def slots() -> list:
        return answer

    def slot(index: int, task: int, seed: int, busy: bool = True) -> dict:
        return {"id": index, "id_task": task, "is_processing": busy, "params": {"seed": seed}}

    async def scenario() -> None:
        ties = TaskTies({}, slots)
        drawn = ties.mark("a", {"messages": []}, "chat")["seed"]
        own = ties.mark("b", {"messages": [], "seed": 42}, "chat")
        assert own["seed"] == 42 and ties.mark("c", {"seed": -1}, "chat") == {"seed": -1}
        assert "c" not in ties.live  # -1: llama-server draws a seed of its own for each task, unknown here
        answer[:] = [slot(0, 9, drawn, busy=False), slot(1, 10, 42)]
        assert await ties.lookup("a") == ((0, 9),) and await ties.lookup("b") == ((1, 10),)
        answer[:] = [slot(0, 9, drawn), slot(1, 3, 42, busy=False)]
        assert await ties.lookup("b") is None  # its seed only in an idle slot: maybe an older job's task
        ties.mark("d", {"messages": [], "seed": 42}, "chat")
        answer[:] = [slot(1, 10, 42)]
        assert await ties.lookup("b") is None and await ties.lookup("d") is None  # two live jobs, one seed
        ties.forget("d")
        answer[:] = [slot(1, 10, 42), slot(0, 11, 42)]
        assert await ties.lookup("b") is None  # two tasks for a job of one
        many = ties.mark("e", {"messages": [], "n": 2}, "chat")["seed"]
        answer[:] = [slot(1, 12, many + 1), slot(0, 11, many)]
        assert await ties.lookup("e") == ((0, 11), (1, 12))  # n = 2: the child's seed is the next one
        assert TaskTies({"extra_args": ["--seed", "7"]}, slots).mark("f", {}, "chat") == {}  # the operator's
        assert TaskTies({"extra_body": {"seed": 7}}, slots).fixed == 7

    asyncio.run(scenario())


def test_a_slots_answer_past_its_cap_ties_nothing_and_says_so(tiny_gguf, llama_server_bin, tmp_path, monkeypatch,
                                                             caplog):
    """/slots is read up to SlotClient's byte cap, no further: a real llama-server whose /slots
    holds its slot's long prompt (LLAMA_SERVER_SLOTS_DEBUG=1) ties the job under the cap, and
    past a cap it is smaller than the tie is skipped and logged; a /slots of 64 MiB with no
    length (testkit's hostile upstream) is cut at the cap, neither hanging nor crashing."""
    monkeypatch.setenv("LLAMA_SERVER_SLOTS_DEBUG", "1")  # the child inherits it: each slot's text in /slots
    prompt = "the pool model token " * 600  # about 12600 tokens (bytes, on the tiny GGUF)
    with direct_llama_server(llama_server_bin, tiny_gguf, ["-c", "16384", "-np", "1"], tmp_path / "llama.log") as url:

        async def scenario() -> None:
            async with httpx.AsyncClient() as control:
                whole = SlotClient(control, url)
                ties = TaskTies({}, whole.slots)
                request = ties.mark("a", {"prompt": prompt, "n_predict": 1}, "completions")
                r = await control.post(url + "/completion", json=request, timeout=120)
                assert r.status_code == 200, r.text
                [slot] = await whole.slots()
                size = len(json.dumps([slot]))
                assert "the pool model token" in slot["prompt"] and 12_000 < size < SLOTS_MAX_BYTES, size
                [(index, task)] = await ties.lookup("a")  # under the default cap: tied
                assert (index, task) == (slot["id"], slot["id_task"])
                capped = SlotClient(control, url, max_bytes=size // 2)
                with pytest.raises(SlotsTooLarge):
                    await capped.slots()
                ties.slots = capped.slots
                with caplog.at_level("DEBUG", "runtime_worker"):
                    assert await ties.lookup("a") is None and await ties.lookup("a") is None
                said = [rec.getMessage() for rec in caplog.records if rec.levelname == "WARNING"]
                assert len(said) == 1 and "not tied" in said[0] and f"cap of {size // 2}" in said[0], said
                await whole.aclose()
                await capped.aclose()

        asyncio.run(scenario())
    hostile = serve_hostile()
    try:
        async def endless() -> None:
            async with httpx.AsyncClient() as control:
                started = time.monotonic()
                endless_slots = SlotClient(control, f"http://127.0.0.1:{hostile.server_address[1]}")
                with pytest.raises(SlotsTooLarge, match="read stopped there"):
                    await endless_slots.slots()
                assert time.monotonic() - started < 30
                await endless_slots.aclose()

        asyncio.run(endless())
        written = wait_for(lambda: hostile.RequestHandlerClass.slots_written, 10, what="the hostile /slots' end")
        assert written < 32 * MiB, written  # cut short of its 64 MiB (what the socket buffers took went out)
    finally:
        hostile.shutdown()
        hostile.server_close()


def test_the_tie_is_one_task_beside_the_stream_and_goes_out_with_the_next_event():
    """TaskTies.events: one look at /slots per job, asked after its first event, as one task;
    no event waits on it (the stream's events come while /slots has not answered), the tie
    goes out before the first event after the answer, and the Finished waits for a late one."""

    async def scenario(late: bool) -> list:
        answered, returned = asyncio.Event(), asyncio.Event()

        async def slots() -> list:  # llama-server's answer, when the scenario lets it come
            await answered.wait()
            returned.set()
            return [{"id": 0, "id_task": 4, "is_processing": True, "params": {"seed": ties.live["a"].start}}]

        async def stream(request: dict):
            for i in range(50):
                yield TextDelta(f"t{i}")
                await asyncio.sleep(0)
            if late:  # the job ends before /slots answered: its Finished waits for the answer
                answered.set()
            yield Finished("stop", 1, 50)

        created: list = []  # every task made on this loop while the job runs
        asyncio.get_running_loop().set_task_factory(
            lambda loop, coro, **kw: created.append(coro) or asyncio.Task(coro, loop=loop, **kw))
        ties = TaskTies({}, slots)
        seen = []
        async for event in ties.events("a", {"messages": []}, "chat", stream):
            seen.append(event)
            if len(seen) == 3 and not late:
                answered.set()
                async with asyncio.timeout(5):  # the look is done once this wakes
                    await returned.wait()
        assert ties.live == {} and returned.is_set()
        assert len(created) == 1, created  # the one look: no task per event
        return seen

    for late, at in ((False, 3), (True, 50)):
        seen = asyncio.run(scenario(late))
        kinds = [type(e).__name__ for e in seen]
        assert kinds.count("RuntimeTasks") == 1 and kinds.count("TextDelta") == 50, kinds
        assert kinds.index("RuntimeTasks") == at and seen[at] == RuntimeTasks(((0, 4),)), kinds
        assert kinds[-1] == "Finished"


def test_a_crashed_requests_story_holds_the_crash_event_and_the_log_lines(make_pool, tiny_gguf, llama_server_bin):
    pool = make_pool([llama("tiny", tiny_gguf, llama_server_bin, extra_args=IGNORE_EOS)])
    [runtime] = pool.workers("tiny")[0]["children"]
    result: dict = {}
    generating = threading.Event()

    def ask() -> None:
        with httpx.stream("POST", pool.url + "/v1/chat/completions", headers={"x-request-id": "doomed-1"},
                          timeout=120, json={"model": "tiny", "max_tokens": 100_000, "stream": True,
                                             "messages": [{"role": "user", "content": "hi"}]}) as r:
            result["r"] = r
            for line in r.iter_lines():
                if '"content":"' in line and '"content":""' not in line:
                    generating.set()  # its tokens come: its runtime task is known by now, or soon

    asker = threading.Thread(target=ask)
    asker.start()
    assert generating.wait(60), "no token of the request within 60 s"
    os.kill(runtime["pid"], signal.SIGKILL)
    asker.join(60)
    assert result["r"].headers["x-request-id"] == "doomed-1"

    def told_crash() -> list | None:  # the crash event follows the row by the worker's exit (milliseconds)
        stories = pool.http.get("/admin/requests/story", params={"id": "doomed-1"}).json()["stories"]
        return stories if stories and any(e["kind"] == "crashed" for e in stories[0]["story"]["events"]) else None

    [entry] = wait_for(told_crash, 15, what="the row's story with the crash")
    row, story = entry["row"], entry["story"]
    assert row["status"] == 502 and row["error_code"] == "runtime_crashed", row
    assert story["replica"] == "tiny/0" and story["admission"]["tenant"] == row["tenant"]
    assert story["ttft_ms"] is not None and story["ttft_ms"] <= story["duration_ms"]
    assert story["started"] < story["ended"] <= row["ts"]
    crashes = [e for e in story["events"] if e["kind"] == "crashed" and e["model"] == "tiny"]
    assert crashes and all(story["started"] - 5 <= e["ts"] <= story["ended"] + 5 for e in story["events"])
    lines = story["log"]["lines"]
    assert any("runtime died: llama-server was killed by SIGKILL" in line for line in lines), story["log"]
    assert any("launch_slot" in line for line in lines), story["log"]  # llama-server's own, on its clock
    assert len(lines) <= 200
    # its own lines: those of the llama-server task that served it (and the worker's errors), not a window
    # killed right after its first token, it may die before the worker has read its task from /slots:
    # tied, its lines are that task's only; untied, the story says its lines are a window
    done = cli("requests", "--id", "doomed-1", url=pool.url)
    assert done.returncode == 0, done.stderr
    assert "request doomed-1" in done.stdout and "replica tiny/0" in done.stdout and "crashed tiny/0" in done.stdout
    if story["log"]["tasks"]:
        [(slot, task)] = story["log"]["tasks"]
        assert story["log"]["by"] == "task" and row["runtime_tasks"] == f"{slot}:{task}", story["log"]
        assert all(f"| task {task} |" in line or "| task -1 |" in line for line in lines if "[llama-server]" in line)
        assert f"log of tiny/0, its task {task} (slot {slot})" in done.stdout, done.stdout
    else:
        assert story["log"]["by"] == "window" and row["runtime_tasks"] is None, story["log"]
    missing = cli("requests", "--id", "nobody-here", url=pool.url)
    assert missing.returncode == 1 and "no request with id" in missing.stderr
    assert pool.http.get("/admin/requests/story").status_code == 400


def test_requests_at_once_each_have_their_own_llama_server_tasks_lines(make_pool, tiny_gguf, llama_server_bin):
    """Identical requests on one llama-server with two slots, at once: each row names its own
    task (its seed, drawn by the worker, told them apart in /slots), and each story shows the
    lines of that task only, though the other's ran in the same seconds on the other slot."""
    pool = make_pool([llama("tiny", tiny_gguf, llama_server_bin, slots=2, extra_args=IGNORE_EOS)])
    ids = ["twin-a", "twin-b", "twin-c"]
    started = threading.Barrier(len(ids))
    statuses: dict = {}

    def ask(rid: str) -> None:
        started.wait(30)
        # long enough that two of them run at once however the threads' starts fall (24 tokens took
        # 20 ms on a quiet machine, and three ran one after another)
        r = httpx.post(pool.url + "/v1/chat/completions", headers={"x-request-id": rid}, timeout=120,
                       json={"model": "tiny", "max_tokens": 240, "stream": rid != "twin-c",
                             "messages": [{"role": "user", "content": "the same words"}]})
        statuses[rid] = r.status_code

    askers = [threading.Thread(target=ask, args=(rid,)) for rid in ids]
    for asker in askers:
        asker.start()
    for asker in askers:
        asker.join(120)
    assert statuses == {rid: 200 for rid in ids}

    def stories() -> dict | None:
        found = {rid: pool.http.get("/admin/requests/story", params={"id": rid}).json()["stories"] for rid in ids}
        return found if all(found.values()) else None

    told = {rid: entry for rid, [entry] in wait_for(stories, 15, what="the three rows").items()}
    tasks = {rid: told[rid]["story"]["log"]["tasks"] for rid in ids}
    # the streamed ones are tied (the worker reads /slots after their first token, while they run);
    # the one answered whole may end before /slots answers: then it is untied, and says so
    streamed = ["twin-a", "twin-b"]
    assert all(len(tasks[rid]) == 1 for rid in streamed), tasks
    if not tasks["twin-c"]:
        assert told["twin-c"]["story"]["log"]["by"] == "window", told["twin-c"]["story"]["log"]
    tied = [rid for rid in ids if tasks[rid]]
    assert len({tasks[rid][0][1] for rid in tied}) == len(tied), tasks  # one task each
    for rid in tied:
        row, log = told[rid]["row"], told[rid]["story"]["log"]
        [(slot, task)] = tasks[rid]
        assert log["by"] == "task" and parse_tasks(row["runtime_tasks"]) == [(slot, task)], log
        mine = [line for line in log["lines"] if "[llama-server]" in line]
        for part in ("selected slot", "processing task", "print_timing", "stop processing"):
            assert any(part in line for line in mine), (part, log)
        assert all(f"id  {slot} | task {task} |" in line or f"id  {slot} | task -1 |" in line for line in mine), log
        others = [tasks[other][0][1] for other in tied if other != rid]
        assert not any(f"| task {t} |" in line for t in others for line in log["lines"]), log
    # the seed the worker gave each takes nothing from llama-server's own slot choice: the one that
    # waited for a slot got the slot whose cache held its prompt (by prompt similarity), and used it
    waited = [rid for rid in tied if any("selected slot by LCP similarity" in line
                                         for line in told[rid]["story"]["log"]["lines"])]
    assert all(told[rid]["row"]["cached_tokens"] > 0 for rid in waited), [told[rid]["row"] for rid in waited]
    # two of them ran at once (two slots, three asked together): a time window would have mixed them
    spans = sorted((told[rid]["story"]["started"], told[rid]["story"]["ended"]) for rid in ids)
    assert any(later[0] < earlier[1] for earlier, later in zip(spans, spans[1:])), spans
    done = cli("requests", "--id", "twin-a", url=pool.url)
    [(slot, task)] = tasks["twin-a"]
    assert done.returncode == 0 and f"log of tiny/0, its task {task} (slot {slot}):" in done.stdout, done.stdout


def test_a_refused_requests_story_names_its_tenant_and_the_limit_it_hit(make_pool):
    pool = make_pool([synthetic("syn")], server={"api_key": "sk-default", "admin_key": "admin-secret"},
                     tenants=[{"name": "team", "keys": ["sk-team"], "rpm": 1}])
    for rid, status in (("rl-1", 200), ("rl-2", 429)):
        r = httpx.post(pool.url + "/v1/chat/completions", timeout=30,
                       headers={"x-request-id": rid, "authorization": "Bearer sk-team"},
                       json={"model": "syn", "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == status, r.text
    pool.http.headers["authorization"] = "Bearer admin-secret"  # the admin routes want the admin key
    [entry] = wait_for(lambda: pool.http.get("/admin/requests/story", params={"id": "rl-2"}).json()["stories"], 10,
                       what="the 429's row")
    story = entry["story"]
    assert story["admission"] == {"tenant": "team", "limits": {"rpm": 1}, "refused_by": "rate_limit_exceeded"}
    assert story["replica"] is None and story["log"]["lines"] == [] and story["end"]["status"] == 429
    [served] = pool.http.get("/admin/requests", params={"id": "rl-1"}).json()["requests"]
    [again] = pool.http.get("/admin/requests/story", params={"row": served["id"]}).json()["stories"]
    assert again["row"]["request_id"] == "rl-1" and again["story"]["admission"]["refused_by"] is None
    assert again["story"]["replica"] == "syn/0" and again["story"]["end"]["status"] == 200
    # a runtime that names no task of a request: its lines are its time window's, and say so
    log = again["story"]["log"]
    assert log["by"] == "window" and log["tasks"] == [] and again["row"]["runtime_tasks"] is None
    assert log["note"].startswith("lines by time window, other requests' among them: the synthetic runtime "
                                  "names no task of a request"), log
    assert any("log of syn/0 (±5 s) (lines by time window" in line
               for line in cli("requests", "--id", "rl-1", url=pool.url,
                                   env={"LLM_POOL_ADMIN_KEY": "admin-secret"}).stdout.splitlines())


def test_the_live_samples_carry_each_models_latency_percentiles(make_pool):
    pool = make_pool([synthetic("fast", tps=200, ttft_ms=30, tokens=8),
                      synthetic("slow", tps=100, ttft_ms=200, tokens=20)])
    ids = []
    for i in range(6):
        for model in ("fast", "slow"):
            r = httpx.post(pool.url + "/v1/chat/completions", timeout=30,  # streamed: the TTFT window's
                           headers={"x-request-id": f"lat-{model}-{i}"},
                           json={"model": model, "messages": [{"role": "user", "content": f"hi {i}"}],
                                 "stream": True})
            assert r.status_code == 200
            ids.append(r.headers["x-request-id"])

    def sample_with_all() -> dict | None:
        with httpx.stream("GET", pool.url + "/admin/live", timeout=10) as live:
            for line in live.iter_lines():
                if line.startswith("data: "):
                    history = json.loads(line[6:])
                    break
        for sample in reversed(history):
            figures = [(sample["models"].get(m) or {}).get("latency") for m in ("fast", "slow")]
            if all(f and f["n"] == 6 for f in figures):
                return sample
        return None

    sample = wait_for(sample_with_all, 15, what="a sample whose window holds all 12 requests")
    rows = pool.http.get("/admin/requests", params={"limit": 100}).json()["requests"]
    for model in ("fast", "slow"):
        mine = [r for r in rows if r["model"] == model]
        assert len(mine) == 6
        figures = sample["models"][model]["latency"]
        for stem, column in (("ttft", "ttft_ms"), ("duration", "duration_ms"), ("queued", "queued_ms")):
            values = [r[column] for r in mine]
            assert figures[f"{stem}_p50_ms"] == percentile(values, 50)
            assert figures[f"{stem}_p95_ms"] == percentile(values, 95) == max(values)
    fast, slow = sample["models"]["fast"]["latency"], sample["models"]["slow"]["latency"]
    assert 30 <= fast["ttft_p50_ms"] < slow["ttft_p50_ms"] and slow["ttft_p50_ms"] >= 200
    assert slow["duration_p95_ms"] > fast["duration_p95_ms"]
