"""The supervisor watches its own event loop: a task sleeps PERIOD_S at a time
and measures how much later than asked it woke. Lag means something held the
loop (a big answer built at once, a blocking call); past the workers'
liveness window, it would cost every worker. Each measure goes to /metrics (a
gauge and a histogram); one over WARN_S is also a warning in the log."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from supervisor.tasks import spawn

log = logging.getLogger("llm_pool.loop_lag")

PERIOD_S = 0.25
WARN_S = 1.0


class LoopLag:
    def __init__(self, on_sample: Callable[[float], None], period_s: float = PERIOD_S, warn_s: float = WARN_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.on_sample = on_sample  # called with each measure, in seconds
        self.period_s = period_s
        self.warn_s = warn_s
        self.clock = clock
        self._task: asyncio.Task | None = None

    def observe(self, lag_s: float) -> None:
        self.on_sample(lag_s)
        if lag_s > self.warn_s:
            log.warning("the event loop was blocked for %.2fs (workers give up on a silent supervisor after "
                        "liveness_s)", lag_s)

    async def _run(self) -> None:
        while True:
            asked = self.clock() + self.period_s
            await asyncio.sleep(self.period_s)
            self.observe(max(0.0, self.clock() - asked))

    def start(self) -> None:
        # a failure is a bug: said (tasks.watch), and the measure goes on
        self._task = spawn(self._run(), "loop-lag", what="the loop lag measure", on_failure=self._ended)

    def _ended(self, task: asyncio.Future) -> None:
        if task is self._task:  # not closed meanwhile
            self.start()

    async def close(self) -> None:
        if self._task is not None:
            task, self._task = self._task, None
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
