"""Restart policy as pure functions with an injected clock."""

import random

from protocol.errors import WorkerExit
from supervisor.replicas.restart_policy import CrashHistory, RestartPolicy, restart_delay
from supervisor.states import MODEL_TRANSITIONS, IllegalTransition, ModelState, transition

POLICY = RestartPolicy(base_s=1, cap_s=8, stable_s=60, max_crashes=5, window_s=100)


def test_first_restart_is_immediate_then_backoff_grows_to_the_cap():
    history, rng = CrashHistory(), random.Random(1)
    delays = [restart_delay(POLICY, history, now=t, up_since=t - 1, exit_code=-9, rng=rng)
              for t in (0, 30, 60, 90, 120, 150)]
    assert delays[0] == 0
    ceilings = [1, 2, 4, 8, 8]
    for delay, ceiling in zip(delays[1:], ceilings):
        assert ceiling / 2 <= delay <= ceiling  # jittered below the ceiling


def test_stable_run_resets_the_streak():
    history = CrashHistory()
    restart_delay(POLICY, history, now=0, up_since=-1, exit_code=-9)
    assert restart_delay(POLICY, history, now=10, up_since=9, exit_code=-9) > 0
    assert restart_delay(POLICY, history, now=200, up_since=100, exit_code=-9) == 0  # up 100 s >= stable_s


def test_too_many_crashes_in_the_window_is_fatal():
    history = CrashHistory()
    results = [restart_delay(POLICY, history, now=t, up_since=t - 1, exit_code=1) for t in range(6)]
    assert all(r is not None for r in results[:5]) and results[5] is None


def test_boot_failure_is_fatal_at_once():
    assert restart_delay(POLICY, CrashHistory(), now=0, up_since=None, exit_code=WorkerExit.BOOT_FAILURE) is None


def test_state_transitions_are_checked():
    assert transition(MODEL_TRANSITIONS, ModelState.UNLOADED, ModelState.LOADING) is ModelState.LOADING
    try:
        transition(MODEL_TRANSITIONS, ModelState.UNLOADED, ModelState.LOADED)
    except IllegalTransition as exc:
        assert "unloaded -> loaded" in str(exc)
    else:
        raise AssertionError("unloaded -> loaded must be refused")
