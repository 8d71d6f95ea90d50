"""Process lifecycle, in one place: spawn a worker, stop or kill its process
tree, and sweep workers left behind by a supervisor that died."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import time
from pathlib import Path

import psutil

log = logging.getLogger("llm_pool.process")

# Set in every worker's environment: which supervisor owns it.
OWNER_ENV = "LLM_POOL_SUPERVISOR_PID"


class WorkerProcess:
    """A spawned worker and every process seen under it. The tree is remembered
    (at spawn, at each `snapshot()`, before each kill) because native runtimes
    run in their own session, out of the worker's process group, and their
    children (vLLM's engine processes) outlive a worker that died: once it is
    gone they can no longer be found from it."""

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
        """Remember the worker's current descendants; forget those that ended.
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
        """SIGKILL the worker, its process group and every descendant seen.
        psutil checks each process's identity first, so a reused pid is spared."""
        self.snapshot()
        if self._proc.returncode is None:  # not reaped: its pid, hence its group id, is still ours
            try:
                os.killpg(self.pid, signal.SIGKILL)  # the worker leads its own session
            except (ProcessLookupError, PermissionError):
                pass
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


# Variables holding the pool's own secrets (its API and admin keys, tenants' key_env): no worker needs
# them, so none gets them (an openai_remote's api_key_env is its own variable, and reaches it).
WITHHELD_ENV: set[str] = {"LLM_POOL_API_KEY", "LLM_POOL_ADMIN_KEY"}


def withhold_env(names) -> None:
    """Keep these environment variables out of every worker started from now on."""
    WITHHELD_ENV.update(names)


async def spawn_worker(args: list[str], log_path: Path, extra_env: dict[str, str]) -> WorkerProcess:
    """Start `python -m runtime_worker ARGS`. Raises OSError when it cannot
    (log directory not creatable, no such interpreter, out of pids)."""
    env = {k: v for k, v in os.environ.items() if k not in WITHHELD_ENV}
    env.update(extra_env)
    env[OWNER_ENV] = str(os.getpid())
    env.setdefault("PYTHONUNBUFFERED", "1")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab", buffering=0) as log_file:
        return WorkerProcess(await asyncio.create_subprocess_exec(
            sys.executable, "-m", "runtime_worker", *args,
            stdin=asyncio.subprocess.DEVNULL, stdout=log_file, stderr=log_file, env=env,
            start_new_session=True,  # a terminal's Ctrl-C reaches the supervisor only
        ))


def process_tree(pid: int) -> list[psutil.Process]:
    """The process and all its descendants (children first found, then deeper)."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def kill_tree(pid: int, sig: int = signal.SIGKILL) -> None:
    for proc in reversed(process_tree(pid)):
        try:
            proc.send_signal(sig)
        except psutil.NoSuchProcess:
            pass


def sweep_stale_workers() -> list[int]:
    """Kill worker trees whose owning supervisor is no longer alive."""
    killed = []
    me = os.getpid()
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmd = proc.info.get("cmdline") or []
        if "runtime_worker" not in cmd:
            continue
        try:
            owner = int(proc.environ().get(OWNER_ENV, "0"))
        except (psutil.Error, ValueError):
            continue
        if owner and owner != me and not psutil.pid_exists(owner):
            log.warning("killing stale worker pid %d (its supervisor %d is gone)", proc.pid, owner)
            kill_tree(proc.pid)
            killed.append(proc.pid)
    return killed
