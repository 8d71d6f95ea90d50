"""Waiting on a condition with a deadline: never sleep-and-hope."""

from __future__ import annotations

import asyncio
import time


def wait_for(condition, timeout: float = 10.0, interval: float = 0.02, what: str = "condition"):
    """Poll `condition()` until it returns a truthy value (returned); fail after `timeout` seconds."""
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
