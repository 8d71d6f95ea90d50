"""When to restart a crashed replica: pure functions, the clock passed in.

First restart at once; then exponential backoff with full jitter up to a cap;
the streak resets after the replica stayed up `stable_s`. Too many crashes in
`window_s`, or a boot failure (the runtime cannot load: bad path, corrupt
model), make the replica fatal instead of looping."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from protocol.errors import WorkerExit


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
