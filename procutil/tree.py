"""Process trees: a process's descendants, remembered while they live, and the one
way each kind of child is stopped with everything it started: the supervisor's
workers and the Ray node host's (ChildTree), the tests' and scripts' children
(stop_tree), and what a dead owner left behind (kill_tree)."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import time

import psutil

from procutil.groups import signal_group

log = logging.getLogger("llm_pool.process")


def child_pids(pid: int) -> list[int]:
    """The pids of `pid`'s children now. Linux lists them per thread in
    /proc/PID/task/TID/children (proc(5)): a few small reads, where psutil's
    children() reads the stat file of every process on the machine."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:  # gone (or no /proc at all: then psutil says which)
        if os.path.isdir("/proc/self/task"):
            return []
        return _psutil_children(pid)
    found: list[int] = []
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
                found.extend(int(c) for c in f.read().split())
        except FileNotFoundError:  # the thread ended; or a kernel without the file
            if not os.path.exists(f"/proc/{pid}/task/{tid}"):
                continue
            return _psutil_children(pid)
    return found


def _psutil_children(pid: int) -> list[int]:
    try:
        return [p.pid for p in psutil.Process(pid).children()]
    except psutil.NoSuchProcess:
        return []


def descendant_pids(pid: int) -> list[int]:
    """The pids below `pid` now, children first found, then deeper."""
    found: list[int] = []
    level = [pid]
    while level and len(found) < 100_000:  # a pid loop cannot exist; the bound guards a broken /proc
        level = [c for parent in level for c in child_pids(parent)]
        found.extend(level)
    return found


def process_tree(pid: int) -> list[psutil.Process]:
    """The process and all its descendants (children first found, then deeper)."""
    tree = []
    for p in (pid, *descendant_pids(pid)):
        try:
            tree.append(psutil.Process(p))
        except psutil.NoSuchProcess:
            if p == pid:
                return []
    return tree


def descendants(pid: int) -> set[int]:
    """The pids below `pid` now. Record them while they live: a descendant whose
    parent dies leaves the tree, and only a record can still find it."""
    return set(descendant_pids(pid))


def kill_tree(pid: int, sig: int = signal.SIGKILL) -> None:
    """Signal a process and its descendants, deepest first."""
    for proc in reversed(process_tree(pid)):
        try:
            proc.send_signal(sig)
        except psutil.NoSuchProcess:
            pass


class ChildTree:
    """A spawned child (an asyncio subprocess that leads its own session) and every
    process seen under it. The tree is remembered (at spawn, at each `snapshot()`,
    before each kill) because native runtimes run in their own session, out of the
    child's process group, and their children (vLLM's engine processes) outlive a
    child that died: once it is gone they can no longer be found from it."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self._proc = proc
        self.pid = proc.pid
        self._tree: dict[int, psutil.Process] = {}
        self._snapshot_at = 0.0
        self.snapshot()

    @property
    def returncode(self) -> int | None:
        return self._proc.returncode

    async def wait(self) -> int:
        return await self._proc.wait()

    def snapshot(self, max_age_s: float = 0.0) -> None:
        """Remember the child's current descendants; forget those that ended.
        With `max_age_s`, skip it when the last one is that recent: a scan reads
        every process's /proc entry, too dear for every heartbeat on a busy host."""
        now = time.monotonic()
        if max_age_s and now - self._snapshot_at < max_age_s:
            return
        self._snapshot_at = now
        alive = {pid: p for pid, p in self._tree.items() if p.is_running()}
        if self._proc.returncode is None:
            for p in process_tree(self.pid)[1:]:
                alive.setdefault(p.pid, p)
        self._tree = alive

    def descendants(self) -> list[psutil.Process]:
        self.snapshot()
        return list(self._tree.values())

    def kill_tree(self) -> None:
        """SIGKILL the child, its process group and every descendant seen.
        psutil checks each process's identity first, so a reused pid is spared."""
        self.snapshot()
        if self._proc.returncode is None:  # not reaped: its pid, hence its group id, is still ours
            signal_group(self.pid, signal.SIGKILL)  # the child leads its own session
            try:
                self._proc.kill()
            except ProcessLookupError:
                pass
        for p in self._tree.values():
            try:
                p.kill()
            except psutil.Error:
                pass

    async def stop(self, timeout_s: float) -> int:
        """SIGTERM, wait up to `timeout_s`, then SIGKILL of the whole tree (a
        native runtime can hang on SIGTERM)."""
        if self._proc.returncode is None:
            self.snapshot()
            try:
                self._proc.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                await asyncio.wait_for(asyncio.shield(self._proc.wait()), timeout_s)
            except TimeoutError:
                log.warning("pid %d ignored SIGTERM for %.1fs; killing its tree", self.pid, timeout_s)
        self.kill_tree()
        return await self._proc.wait()


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
        signal_group(proc.pid, signal.SIGKILL)
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
