"""When to restart a crashed replica: pure functions, the clock passed in; and the
restart that backs off (PendingRestart).

First restart at once; then exponential backoff with full jitter up to a cap;
the streak resets after the replica stayed up `stable_s`. Too many crashes in
`window_s`, or a boot failure (the runtime cannot load: bad path, corrupt
model), make the replica fatal instead of looping."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Coroutine
from dataclasses import dataclass, field

from protocol.errors import WorkerExit
from supervisor.tasks import spawn


@dataclass
class RestartPolicy:
    base_s: float = 0.5
    cap_s: float = 30.0
    stable_s: float = 60.0
    max_crashes: int = 5
    window_s: float = 120.0


@dataclass
class CrashHistory:
    crash_times: list[float] = field(default_factory=list)
    streak: int = 0  # consecutive crashes without a stable period between


def restart_delay(policy: RestartPolicy, history: CrashHistory, *, now: float, up_since: float | None,
                  exit_code: int | None, rng: random.Random | None = None) -> float | None:
    """Record a crash at `now`; return seconds to wait before restarting, or None for fatal."""
    if exit_code == WorkerExit.BOOT_FAILURE:
        return None
    if up_since is not None and now - up_since >= policy.stable_s:
        history.streak = 0
    history.crash_times = [t for t in history.crash_times if now - t < policy.window_s] + [now]
    if len(history.crash_times) > policy.max_crashes:
        return None
    history.streak += 1
    if history.streak == 1:
        return 0.0
    ceiling = min(policy.cap_s, policy.base_s * 2 ** (history.streak - 2))
    return (rng or random).uniform(ceiling / 2, ceiling)


class PendingRestart:
    """A replica's crash restart while it backs off (BACKOFF): the task that starts its next
    worker, and when (monotonic)."""

    def __init__(self) -> None:
        self.task: asyncio.Task | None = None
        self.due = 0.0

    @property
    def pending(self) -> bool:
        return self.task is not None and not self.task.done()

    def start(self, restart: Coroutine, due: float, name: str) -> None:
        self.due = due
        self.task = spawn(restart, name)

    def is_current(self) -> bool:
        """Whether the running task is this restart (not one cancelled or replaced since)."""
        return self.task is asyncio.current_task()

    def cancel(self, forget: bool = False) -> None:
        """`forget`: it is no longer pending, from this loop turn (a cancelled task is done only later)."""
        if self.task is not None:
            self.task.cancel()
            if forget:
                self.task = None

    async def cancel_and_wait(self) -> None:
        """Cancel it, and wait until a start it began has killed its worker."""
        task, self.task = self.task, None
        if task and task is not asyncio.current_task():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
