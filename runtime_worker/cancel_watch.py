"""After a cancel leaves the worker with no job, its native runtime must go
quiet within a grace period. One that still burns CPU then works on something
nobody waits for: llama-server applying a huge chat template, say, which no
closed connection interrupts. That is a hidden busy slot, so the worker exits
and its supervisor restarts the runtime."""

from __future__ import annotations

import psutil

BUSY_CORES = 0.2  # CPU use (in cores) of the runtime's process tree that counts as working (an idle one: ~0)
WATCH_GRACES = 3  # how long a cancel is watched, in grace periods: the work may start late


def tree_cpu_seconds(pid: int) -> float:
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0.0
    total = 0.0
    for proc in procs:
        try:
            times = proc.cpu_times()
            total += times.user + times.system
        except psutil.Error:
            pass
    return total


class CancelWatch:
    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self.until: float | None = None  # the cancel is watched until then
        self._sample: tuple[float, float] | None = None  # (time, CPU seconds of the tree)
        self._busy_since: float | None = None

    def arm(self, now: float) -> None:
        """A job was cancelled."""
        self.until = now + WATCH_GRACES * self.grace_s

    def disarm(self) -> None:
        """A new job makes the runtime busy for a reason, or the watch is over."""
        self.until = None
        self._sample = self._busy_since = None

    def busy_for(self, pid: int | None, idle: bool, now: float) -> float | None:
        """Called every heartbeat. Returns how long the runtime has been busy with
        no job, once that is past the grace period; else None."""
        if self.until is None or pid is None:
            return None
        if now > self.until and self._busy_since is None:
            self.disarm()
            return None
        if not idle:  # other jobs still run: their work cannot be told apart
            self._sample = self._busy_since = None
            return None
        cpu = tree_cpu_seconds(pid)
        previous, self._sample = self._sample, (now, cpu)
        if previous is None or now <= previous[0]:
            return None
        if (cpu - previous[1]) / (now - previous[0]) < BUSY_CORES:
            self._busy_since = None  # quiet now; it must then stay busy a whole grace period
            return None
        if self._busy_since is None:
            self._busy_since = previous[0]
        busy = now - self._busy_since
        return busy if busy >= self.grace_s else None
