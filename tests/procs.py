"""Process helpers shared by the tests and the scripts that start pools (scripts/bench,
scripts/soak): a free port, the llama-server binary, polling with a deadline, and
stopping a child with everything it started."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def find_llama_server(build: bool = False) -> str | None:
    """$LLAMA_SERVER_BIN, else the build scripts/install-llama-server cached (with
    `build`, it builds one when none is cached: minutes). None when there is none."""
    path = os.environ.get("LLAMA_SERVER_BIN")
    if path:
        return path
    argv = [str(ROOT / "scripts" / "install-llama-server"), *([] if build else ["--cached-only"])]
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=3600 if build else 30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip().splitlines()[-1] if out.returncode == 0 and out.stdout.strip() else None


def wait_for(condition, timeout: float = 10.0, interval: float = 0.02, what: str = "condition"):
    """Poll `condition()` until it returns a truthy value; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


async def until(condition, timeout: float = 5.0, interval: float = 0.01, what: str = "condition") -> None:
    """wait_for inside an event loop: poll `condition()` (the loop runs meanwhile); fail after `timeout` s."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(interval)


def descendants(pid: int) -> set[int]:
    """The pids below `pid` now. Record them while they live: a descendant whose
    parent dies leaves the tree, and only a record can still find it."""
    try:
        return {p.pid for p in psutil.Process(pid).children(recursive=True)}
    except psutil.NoSuchProcess:
        return set()


def stop_tree(proc: subprocess.Popen, seen: set[int], timeout: float, group: bool = False) -> list[str]:
    """Stop a child and all it started: SIGTERM (a supervisor then stops its workers
    gracefully), SIGKILL after `timeout`; SIGKILL to its process group if it leads one
    (`group`: it was started with start_new_session); then SIGKILL to each pid of `seen`
    (its descendants, recorded while they lived) that still lives outside that group.
    Returns those last ones, "pid (name)" each: a clean stop leaves none."""
    if proc.poll() is None:  # not reaped yet, so its pid is still its own
        seen |= descendants(proc.pid)
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if group:  # its group outlives it while a member lives, so the id cannot have been reused
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    left = []
    for pid in seen:
        try:
            p = psutil.Process(pid)
            if p.status() != psutil.STATUS_ZOMBIE and not (group and os.getpgid(pid) == proc.pid):
                left.append(f"{pid} ({p.name()})")
                p.kill()
        except (psutil.Error, ProcessLookupError):
            pass
    return left
