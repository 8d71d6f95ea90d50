"""What a process tree uses: RSS, CPU and children of a process, and GPU memory per
pid from NVML when a GPU is present (None otherwise, never a guess). Every call
here blocks (it reads /proc, or asks the driver): callers on an event loop run
it in a thread."""

from __future__ import annotations

import psutil

from procutil.tree import descendant_pids


def empty_view() -> dict:
    return {"rss_bytes": None, "cpu_percent": None, "children": [], "gpu_memory_bytes": None}


class TreeSampler:
    """Views of process trees. It keeps one psutil handle per root it was asked about,
    so that cpu_percent() measures since the last view; only live ones stay (see
    forget_dead). Not thread-safe: one thread uses one sampler."""

    def __init__(self) -> None:
        self.procs: dict[int, psutil.Process] = {}

    def _proc(self, pid: int) -> psutil.Process:
        proc = self.procs.get(pid)
        if proc is None or not proc.is_running():
            proc = self.procs[pid] = psutil.Process(pid)
            proc.cpu_percent(None)  # first call primes the counter
        return proc

    def forget_dead(self) -> None:
        """Drop exited processes (or reused pids: is_running compares creation times),
        so the cache holds no more entries than there are live roots."""
        for pid, proc in list(self.procs.items()):
            if not proc.is_running():
                del self.procs[pid]

    def view(self, pid: int, gpu: dict[int, int] | None) -> dict:
        """RSS and CPU of `pid`, its descendants ({pid, name, rss_bytes} each), and the GPU
        memory of the tree when `gpu` (gpu_memory_by_pid) is known. Values stay None
        for a process that is gone."""
        view = empty_view()
        try:
            proc = self._proc(pid)
            with proc.oneshot():
                view["rss_bytes"] = proc.memory_info().rss
                view["cpu_percent"] = proc.cpu_percent(None)
            tree = [proc]
            for child_pid in descendant_pids(pid):
                try:
                    child = psutil.Process(child_pid)
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


def gpu_memory_by_pid() -> dict[int, int] | None:
    """Bytes of GPU memory per pid over all GPUs; None without NVML (no nvidia-ml-py,
    no driver, no GPU)."""
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
