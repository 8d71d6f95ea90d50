"""Process lifecycle of the supervisor's workers: spawn one, and sweep workers
left behind by a supervisor that died. Stopping or killing a worker's tree is
procutil.tree's (the Ray node host stops its worker the same way)."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from pathlib import Path
from typing import Protocol

import psutil

import protocol as p

from procutil.tree import ChildTree, kill_tree
from protocol.owner import OWNER_ENV
from protocol.redact import POOL_SECRET_ENV, worker_env
from supervisor.config import ModelConfig, ServerConfig

log = logging.getLogger("llm_pool.process")


# A worker's process: the worker and every process seen under it (procutil.tree)
WorkerProcess = ChildTree


# The environment a worker must not see is decided here alone (withheld_env); a replica hands
# it to its launcher as names to leave out, so a worker on another node goes without them too.
# The pool's own secrets (its API and admin keys, tenants' key_env) reach no worker.
_pool_secret_env: set[str] = set(POOL_SECRET_ENV)


def withhold_env(names) -> None:
    """Keep these environment variables (tenants' key_env) out of every worker started from now on."""
    _pool_secret_env.update(names)


def withheld_env(model_key_env=frozenset(), own_key: str | None = None) -> frozenset[str]:
    """The variables a worker must not see: the pool's own secrets, and every model's
    api_key_env (`model_key_env`) but its own model's (`own_key`)."""
    return frozenset(_pool_secret_env) | (frozenset(model_key_env) - {own_key})


class Launcher(Protocol):
    """Starts a worker (process.spawn_worker; ray_placement.RayLauncher, which also
    has the `endpoint` its workers dial; a fake in the state-machine tests).
    Raises OSError when it cannot."""

    async def __call__(self, args: list[str], log_path: Path, env: dict[str, str]) -> WorkerProcess: ...


def replica_env(cfg: ModelConfig, index: int, model_key_env: frozenset[str]) -> dict[str, str | None]:
    """What replica `index` of `cfg` puts in its worker's environment: None leaves a name out
    (protocol.redact.worker_env): every withheld_env."""
    env: dict[str, str | None] = dict.fromkeys(withheld_env(model_key_env, cfg.options.get("api_key_env")))
    if cfg.replica_devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = cfg.replica_devices[index]
    return env


def worker_args(cfg: ModelConfig, server: ServerConfig, endpoint: str, identity: str) -> list[str]:
    """A replica's worker's command line (its options, secrets among them, follow Hello, in Setup)."""
    return [
        "--endpoint", endpoint, "--replica", identity, "--backend", cfg.backend,
        # the runtime is sized for the regular slots and the newcomer slots above them
        "--target-inflight", str(cfg.target_inflight + cfg.newcomer_slots),
        "--heartbeat-s", str(server.heartbeat_s), "--liveness-s", str(server.liveness_s),
        "--stop-timeout-s", str(cfg.stop_timeout_s), "--cancel-grace-s", str(cfg.cancel_grace_s),
        "--supervisor-patience-s", str(server.supervisor_patience_s),
        "--max-job-output-bytes", str(server.max_job_output_bytes),
        "--max-upstream-line-bytes", str(server.max_upstream_line_bytes),
    ]


def worker_setup(cfg: ModelConfig, server: ServerConfig, kv_dir: Path | None) -> p.Setup:
    """The answer to a replica's worker's Hello: the model's options, and where its KV is saved."""
    warm_swap = {"dir": str(kv_dir), "budget_mb": server.kv_disk_budget_mb, "min_free_mb": server.kv_min_free_mb,
                 "save_timeout_s": server.kv_save_timeout_s} if kv_dir else {}
    return p.Setup(options=cfg.worker_options, warm_swap=warm_swap)


async def spawn_worker(args: list[str], log_path: Path, extra_env: dict[str, str | None]) -> WorkerProcess:
    """Start `python -m runtime_worker ARGS`. Raises OSError when it cannot
    (log directory not creatable, no such interpreter, out of pids).
    `extra_env` over this process's environment; None values remove a name (the
    replica's withheld_env among them)."""
    env = worker_env(dict(os.environ), extra_env)
    env[OWNER_ENV] = str(os.getpid())
    env.setdefault("PYTHONUNBUFFERED", "1")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab", buffering=0) as log_file:
        return WorkerProcess(await asyncio.create_subprocess_exec(
            sys.executable, "-m", "runtime_worker", *args,
            stdin=asyncio.subprocess.DEVNULL, stdout=log_file, stderr=log_file, env=env,
            start_new_session=True,  # a terminal's Ctrl-C reaches the supervisor only
        ))


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
