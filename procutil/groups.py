"""Process groups: a child started with start_new_session leads its own group, and
what it starts stays in that group unless it makes a session of its own."""

from __future__ import annotations

import asyncio
import os
import signal


def signal_group(pgid: int, sig: int) -> bool:
    """Send `sig` to the process group `pgid`; False when the group is gone (or not ours)."""
    try:
        os.killpg(pgid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


async def stop_group(proc: asyncio.subprocess.Process, timeout_s: float) -> bool:
    """SIGTERM to the group `proc` leads, up to `timeout_s` for `proc` to exit, then
    SIGKILL to what is left of the group. True when `proc` sat out the SIGTERM."""
    ignored = False
    if proc.returncode is None and signal_group(proc.pid, signal.SIGTERM):
        try:
            await asyncio.wait_for(proc.wait(), timeout_s)
        except TimeoutError:
            ignored = True
    signal_group(proc.pid, signal.SIGKILL)
    await proc.wait()
    return ignored
