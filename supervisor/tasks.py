"""Background tasks that never end silently: the one done-callback that says so.

`spawn` starts a task (`watch`, a future already made) whose failure is logged with its
traceback; a `forever` task (a loop ended only by a cancel) is reported for any other
end, a return included. `on_failure(task)` is called after the log: a loop that must go
on starts itself again there. `TaskSet` holds the tasks it started until they end (a
task nobody holds may be collected mid-run) and cancels what is left on close."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine

log = logging.getLogger("llm_pool.tasks")


def watch(task: asyncio.Future, what: str | None = None, *, forever: bool = False,
          on_failure: Callable[[asyncio.Future], None] | None = None) -> asyncio.Future:
    """Log `task`'s failure as `what` (default: its name); see the module's docstring."""
    def ended(done: asyncio.Future) -> None:
        if done.cancelled():
            return
        exc = done.exception()
        if exc is None and not forever:
            return
        name = what or (done.get_name() if isinstance(done, asyncio.Task) else "a background task")
        log.error("%s %s", name, "failed" if exc is not None else "ended, and only a cancel should end it",
                  exc_info=exc)
        if on_failure is not None:
            on_failure(done)
    task.add_done_callback(ended)
    return task


def spawn(coro: Coroutine, name: str | None = None, *, what: str | None = None, forever: bool = False,
          on_failure: Callable[[asyncio.Future], None] | None = None) -> asyncio.Task:
    """Start `coro` as a task named `name`, watched (`watch`)."""
    task = asyncio.create_task(coro, name=name)
    watch(task, what, forever=forever, on_failure=on_failure)
    return task


class TaskSet:
    """Watched tasks held until they end."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task] = set()

    def spawn(self, coro: Coroutine, name: str | None = None) -> asyncio.Task:
        task = spawn(coro, name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def __len__(self) -> int:
        return len(self._tasks)

    async def close(self) -> None:
        """Cancel every task still running and wait for them to end."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
