"""The cancel watch on a fake clock and fake CPU readings."""

from __future__ import annotations

from runtime_worker import cancel_watch
from runtime_worker.cancel_watch import CancelWatch


def drive(monkeypatch, rates: list[float], grace: float = 3.0, idle: bool = True) -> list[float | None]:
    """Feed one reading a second, the runtime using `rates[i]` cores during second i."""
    cpu = [0.0]
    monkeypatch.setattr(cancel_watch, "tree_cpu_seconds", lambda pid: cpu[0])
    watch = CancelWatch(grace)
    watch.arm(0.0)
    out = [watch.busy_for(1, idle, 0.0)]
    for second, rate in enumerate(rates, start=1):
        cpu[0] += rate
        out.append(watch.busy_for(1, idle, float(second)))
    return out


def test_a_runtime_busy_a_whole_grace_period_after_the_cancel_is_reported(monkeypatch):
    assert drive(monkeypatch, [1.0, 1.0, 1.0]) == [None, None, None, 3.0]


def test_work_that_starts_late_is_still_caught_and_quiet_spells_reset_the_count(monkeypatch):
    assert drive(monkeypatch, [0.0, 1.0, 1.0, 0.1, 1.0, 1.0, 1.0]) == [None] * 7 + [3.0]


def test_a_quiet_runtime_or_one_with_other_jobs_is_left_alone(monkeypatch):
    assert drive(monkeypatch, [0.1] * 12) == [None] * 13
    assert drive(monkeypatch, [1.0] * 5, idle=False) == [None] * 6
    # the watch ends WATCH_GRACES grace periods after the cancel
    assert drive(monkeypatch, [0.0] * 9 + [1.0] * 5) == [None] * 15
