"""What ops sees of each replica's processes: psutil for the worker and its
tree, NVML for GPU memory when a GPU is present (None otherwise, never a guess)."""

from __future__ import annotations

import asyncio
import socket
import time

import psutil

from supervisor.replica import Replica

# kept so cpu_percent() measures since the last look; only live processes stay (see _forget_dead)
_procs: dict[int, psutil.Process] = {}


def _proc(pid: int) -> psutil.Process:
    proc = _procs.get(pid)
    if proc is None or not proc.is_running():
        proc = _procs[pid] = psutil.Process(pid)
        proc.cpu_percent(None)  # first call primes the counter
    return proc


def _forget_dead() -> None:
    """Drop exited processes (or reused pids: is_running compares creation times),
    so the cache holds no more entries than there are live workers."""
    for pid, proc in list(_procs.items()):
        if not proc.is_running():
            del _procs[pid]


def gpu_memory_by_pid() -> dict[int, int] | None:
    try:
        import pynvml  # from nvidia-ml-py, optional
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # no driver, no GPU
        return None
    used: dict[int, int] = {}
    try:
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            for info in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if info.usedGpuMemory is not None:
                    used[info.pid] = used.get(info.pid, 0) + int(info.usedGpuMemory)
    finally:
        pynvml.nvmlShutdown()
    return used


LOCAL_NODE = socket.gethostname()  # the `node` of a local replica's row


def process_view(pid: int, gpu: dict[int, int] | None) -> dict:
    """RSS, CPU and GPU memory of a worker and its children, on the host it runs on
    (here, or a Ray node's actor: ray_placement.WorkerHost.poll)."""
    view = {"rss_bytes": None, "cpu_percent": None, "children": [], "gpu_memory_bytes": None}
    try:
        proc = _proc(pid)
        with proc.oneshot():
            view["rss_bytes"] = proc.memory_info().rss
            view["cpu_percent"] = proc.cpu_percent(None)
        tree = [proc]
        for child in proc.children(recursive=True):
            try:
                view["children"].append({"pid": child.pid, "name": child.name(),
                                         "rss_bytes": child.memory_info().rss})
                tree.append(child)
            except psutil.Error:
                pass
        if gpu is not None:
            view["gpu_memory_bytes"] = sum(gpu.get(p.pid, 0) for p in tree)
    except psutil.Error:
        pass
    return view


async def refresh_remote_views(replicas: list[Replica], timeout_s: float = 2.0) -> None:
    """Ask the actors of Ray-placed replicas for their process view now, so that
    worker_views shows it as fresh as a local one (a slow node: its last one)."""
    remote = [asyncio.ensure_future(_quietly(r.proc.refresh())) for r in replicas if r.cfg.remote and r.pid]
    if remote:
        await asyncio.wait(remote, timeout=timeout_s)


async def _quietly(refresh) -> None:
    try:
        await refresh
    except Exception:  # the actor is gone: its watch reports that
        pass


def worker_views(replicas: list[Replica]) -> list[dict]:
    _forget_dead()
    gpu = gpu_memory_by_pid() if any(not r.cfg.remote for r in replicas) else None
    views = []
    for r in replicas:
        view = {
            "model": r.cfg.name, "replica": r.index, "backend": r.cfg.backend, "pid": r.pid,
            "node": LOCAL_NODE, "node_id": None,
            "state": r.state.value, "restarts": r.restarts, "last_exit_code": r.last_exit_code,
            "uptime_s": round(time.time() - r.started_at, 1) if r.pid and r.started_at else None,
            "inflight": len(r.inflight), "capacity": r.capacity, "runtime_capacity": r.runtime_capacity,
            "rss_bytes": None, "cpu_percent": None, "children": [], "gpu_memory_bytes": None,
            "log_path": str(r.log_path), "last_error": r.last_error, "runtime_info": r.info,
            "protocol_errors": r.protocol_errors, "unknown_job_replies": r.unknown_job_replies,
            "routing": r.owner.choice.replica_view(r),  # replica choice: decisions, prompt cache hits
        }
        if r.cfg.remote:  # on a Ray node (the last one it ran on, while it is down): its actor's view
            view["node"] = getattr(r.proc, "node", None)
            view["node_id"] = getattr(r.proc, "node_id", None)
            if r.pid:
                view.update(r.proc.view)
        elif r.pid:
            view.update(process_view(r.pid, gpu))
        views.append(view)
    return views
