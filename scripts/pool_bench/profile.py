"""A py-spy profile of a process while a load runs (speedscope format: https://www.speedscope.app),
and its top functions by self time, in µs per request. py-spy is the bench extra's; without it,
or without the right to read the process's memory (ptrace), the bench says so and goes on
without a profile.

py-spy samples without pausing the process (--nonblocking): paused 200 times a second, the
supervisor served 60% fewer requests on a 2-core machine, and py-spy then counted threads
parked on a lock as busy. Unpaused, a thread is sampled only while it runs, so a function's
samples / RATE is the CPU time spent in it (a stack read while it changes may be torn: rare)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Callable

from pool_bench.children import CpuMeter, Proc
from pool_bench.load import Round
from pool_bench.report import say
from testkit.waits import wait_for

ATTACHED = "Sampling process"  # what py-spy record says once it samples
RATE = 200  # samples a second
OFF = "LLM_POOL_BENCH_NO_PROFILE"  # set by --against for its runs: they are timed, not studied


def py_spy() -> str | None:
    beside = Path(sys.executable).parent / "py-spy"  # the venv's, when the bench runs from it
    return str(beside) if beside.exists() else shutil.which("py-spy")


def record(pid: int, path: Path, tmp: Path, load: Callable[[], Round]) -> str | None:
    """Run `load()` with py-spy recording `pid` into `path`. Returns what to tell the reader:
    where the profile is, and its top functions; or why there is none; None when profiles
    are off."""
    if os.environ.get(OFF):
        return None
    binary = py_spy()
    if binary is None:
        return "No profile: py-spy is not installed (pip install -e '.[bench]')."
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    spy = Proc("py-spy", [binary, "record", "--nonblocking", "--format", "speedscope", "--rate", str(RATE),
                          "-o", str(path), "--pid", str(pid)], tmp / "py-spy.log")
    try:
        try:
            wait_for(lambda: ATTACHED in spy.log_tail() or not spy.alive(), 30, interval=0.1, what="py-spy attached")
        except AssertionError:
            return f"No profile: py-spy did not start sampling within 30 s: {spy.log_tail(500)!r}"
        if not spy.alive():
            return f"No profile: py-spy could not attach to the supervisor: {spy.log_tail(500).strip()!r}"
        meter = CpuMeter([pid])
        before = meter.total()
        done = load().done
        cpu = meter.total() - before
        spy.popen.send_signal(signal.SIGINT)  # py-spy writes the file when interrupted
        try:
            spy.popen.wait(60)
        except subprocess.TimeoutExpired:
            return "No profile: py-spy did not write its file within 60 s of being stopped."
    finally:
        spy.stop()
    if not path.exists():
        return f"No profile: py-spy wrote no file: {spy.log_tail(500).strip()!r}"
    say(f"profile: {path}")
    sampled, top = top_self(path, 10)
    if not done or not sampled:
        return f"Profile of the supervisor under this load: {path} (py-spy, speedscope): no requests or no samples."
    per_request = cpu * 1e6 / done
    listed = ", ".join(f"{name} {per_request * seconds / sampled:.0f}" for name, seconds in top)
    return (f"Profile of the supervisor under this load (c = 16, {done} requests, {per_request:.0f} µs of CPU per "
            f"request): {path} (py-spy, speedscope). The top functions by self time, µs of CPU per request (their "
            f"share of the samples times that CPU): {listed}.")


def top_self(path: Path, n: int) -> tuple[float, list[tuple[str, float]]]:
    """The CPU seconds sampled over all threads, and the `n` functions with the most self time
    (the innermost frame of each sample; a function's lines together) and their seconds."""
    doc = json.loads(path.read_text())
    frames = doc["shared"]["frames"]
    self_time: Counter = Counter()
    for prof in doc["profiles"]:
        for stack, seconds in zip(prof["samples"], prof["weights"]):  # py-spy's unit: seconds
            if stack:  # speedscope's stacks run from the root to the leaf
                self_time[label(frames[stack[-1]])] += seconds
    return sum(self_time.values()), self_time.most_common(n)


def label(frame: dict) -> str:
    """'function (folder/file.py)': the frame's function, its lines together."""
    return f"{frame.get('name')} ({'/'.join(Path(frame.get('file') or '?').parts[-2:])})"
