"""Process lifecycle, in one place: spawn a worker, stop a process tree with a
deadline, and sweep workers left behind by a supervisor that died."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from pathlib import Path

import psutil

log = logging.getLogger("llm_pool.process")

# Set in every worker's environment: which supervisor owns it.
OWNER_ENV = "LLM_POOL_SUPERVISOR_PID"


async def spawn_worker(args: list[str], log_path: Path, extra_env: dict[str, str]) -> asyncio.subprocess.Process:
    env = dict(os.environ)
    env.update(extra_env)
    env[OWNER_ENV] = str(os.getpid())
    env.setdefault("PYTHONUNBUFFERED", "1")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab", buffering=0) as log_file:
        return await asyncio.create_subprocess_exec(
            sys.executable, "-m", "runtime_worker", *args,
            stdin=asyncio.subprocess.DEVNULL, stdout=log_file, stderr=log_file, env=env,
            start_new_session=True,  # a terminal's Ctrl-C reaches the supervisor only
        )


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


async def stop_process(proc: asyncio.subprocess.Process, timeout_s: float) -> int | None:
    """SIGTERM, wait up to `timeout_s`, then SIGKILL of the whole tree (a native
    runtime can hang on SIGTERM). Children are collected before signalling so
    none is missed once the parent is gone."""
    if proc.returncode is not None:
        return proc.returncode
    tree = process_tree(proc.pid)
    try:
        proc.send_signal(signal.SIGTERM)
    except ProcessLookupError:
        pass
    try:
        await asyncio.wait_for(proc.wait(), timeout_s)
    except TimeoutError:
        log.warning("pid %d ignored SIGTERM for %.1fs; killing its tree", proc.pid, timeout_s)
    for p in reversed(tree):
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    return await proc.wait()


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
