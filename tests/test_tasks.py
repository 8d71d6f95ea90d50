"""supervisor/tasks.py: the one done-callback by which no background task ends silently
(the replica's, the engine's, the scheduler's driver, the loop lag measure, the live
samples and the remote worker's tasks all go through it)."""

from __future__ import annotations

import asyncio
import logging

from supervisor.tasks import TaskSet, spawn


async def _fail() -> None:
    raise RuntimeError("a bug")


async def _return() -> None:
    return None


async def _forever() -> None:
    await asyncio.Event().wait()


def test_a_failure_is_logged_with_its_traceback_and_handed_on(caplog):
    failed = []

    async def run():
        await asyncio.gather(spawn(_fail(), "bg", on_failure=failed.append), return_exceptions=True)
        await asyncio.sleep(0)  # the done-callbacks run on the next turn

    with caplog.at_level(logging.ERROR, logger="llm_pool.tasks"):
        asyncio.run(run())
    [record] = caplog.records
    assert record.getMessage() == "bg failed" and record.exc_info[1].args == ("a bug",)
    assert len(failed) == 1 and failed[0].get_name() == "bg"


def test_a_loop_that_returns_is_reported_and_a_cancel_or_a_plain_end_is_not(caplog):
    ended = []

    async def run():
        loop = spawn(_return(), "driver", forever=True, what="the dispatch loop", on_failure=ended.append)
        plain = spawn(_return(), "one-shot", on_failure=ended.append)
        cancelled = spawn(_forever(), "cancelled", forever=True, on_failure=ended.append)
        await asyncio.sleep(0)
        cancelled.cancel()
        await asyncio.gather(loop, plain, cancelled, return_exceptions=True)
        await asyncio.sleep(0)
        return loop

    with caplog.at_level(logging.ERROR, logger="llm_pool.tasks"):
        loop = asyncio.run(run())
    assert [r.getMessage() for r in caplog.records] == [
        "the dispatch loop ended, and only a cancel should end it"]
    assert ended == [loop]


def test_a_task_set_holds_its_tasks_until_they_end_and_cancels_the_rest_on_close():
    async def run():
        tasks = TaskSet()
        done = tasks.spawn(_return(), "quick")
        waiting = tasks.spawn(_forever(), "waiting")
        await done
        await asyncio.sleep(0)
        assert len(tasks) == 1
        await tasks.close()
        return waiting

    assert asyncio.run(run()).cancelled()
