"""What ops sees of each replica's processes, and the one owner of the blocking
reads behind it. ProcessSampler walks the supervisor's process tree (each local
worker with what it started, and the supervisor itself) with psutil, and asks
NVML for GPU memory when a GPU is present (None otherwise, never a guess), in a
thread of its own: every SAMPLE_EVERY_S, and on demand. The event loop only
reads its last Sample: the admin views, /metrics and the engine's footprints.
A Ray-placed replica's view comes from its node (node_host.host.WorkerHost.poll)."""

from __future__ import annotations

import asyncio
import logging
import math
import socket
import threading
import time
from dataclasses import dataclass, field

import psutil

from procutil.sample import TreeSampler, gpu_memory_by_pid
from procutil.tree import child_pids
from protocol.errors import exit_text
from supervisor.replicas.replica import Replica

log = logging.getLogger("llm_pool.observe")

SAMPLE_EVERY_S = 2.0  # the period of the sampler's passes (also the span of each cpu_percent)
FRESH_WAIT_S = 5.0  # an on-demand pass not done in this long: the last sample is shown
LOCAL_NODE = socket.gethostname()  # the `node` of a local replica's row


@dataclass(frozen=True)
class Sample:
    """One pass over the supervisor's process tree; replaced whole by the next."""
    taken_at: float = -math.inf  # time.monotonic() when the pass began
    views: dict[int, dict] = field(default_factory=dict)  # per child of the supervisor: procutil view
    supervisor_rss: int | None = None
    gpu_known: bool = False  # NVML answered: a view's gpu_memory_bytes is a figure, not None


class ProcessSampler:
    """Samples the process trees of the supervisor's children (its local workers) in a
    daemon thread; `sample` is the last pass, read on the loop without blocking.
    `request()` asks for a pass that begins after the call (concurrent callers share it)."""

    def __init__(self, period_s: float = SAMPLE_EVERY_S) -> None:
        self.period_s = period_s
        self.sample = Sample()
        self._trees = TreeSampler()  # its psutil handles (cpu_percent state): this thread's alone
        self._me = psutil.Process()
        self._wake = threading.Event()
        self._lock = threading.Lock()  # guards _waiters, which both sides touch
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []
        self._stopped = False
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the thread (once); its first pass runs at once."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="process-sampler", daemon=True)
            self._thread.start()
            self._wake.set()

    def stop(self) -> None:
        """The thread ends after the pass it is in (a daemon: it never holds the process)."""
        self._stopped = True
        self._wake.set()

    def view(self, pid: int | None) -> dict | None:
        """The last view of a local worker's tree; None when no pass saw it yet."""
        return self.sample.views.get(pid) if pid else None

    def request(self) -> asyncio.Future:
        """A future that is done once a pass that began after this call has ended."""
        self.start()
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._lock:
            self._waiters.append((loop, future))
        self._wake.set()
        return future

    async def fresh(self, max_age_s: float = 0.0) -> None:
        """Return once the sample began at most `max_age_s` ago (0: after this call);
        after FRESH_WAIT_S with the last one, saying so."""
        if time.monotonic() - self.sample.taken_at <= max_age_s:
            return
        try:
            await asyncio.wait_for(self.request(), FRESH_WAIT_S)
        except TimeoutError:
            log.warning("no process sample within %.0fs; showing one from %.1fs ago", FRESH_WAIT_S,
                        time.monotonic() - self.sample.taken_at)

    def _run(self) -> None:
        while True:
            self._wake.wait(self.period_s)
            self._wake.clear()
            if self._stopped:
                return
            with self._lock:
                waiters, self._waiters = self._waiters, []
            try:
                self.sample = self._take()
            except Exception:  # one bad pass must not end the sampling; the last sample stays
                log.exception("sampling the worker processes failed")
            for loop, future in waiters:
                try:
                    loop.call_soon_threadsafe(_resolve, future)
                except RuntimeError:  # its loop is closed: nobody waits any more
                    pass

    def _take(self) -> Sample:
        taken_at = time.monotonic()
        children = child_pids(self._me.pid)
        gpu = gpu_memory_by_pid() if children else None
        views = {pid: self._trees.view(pid, gpu) for pid in children}
        self._trees.forget_dead()
        return Sample(taken_at, views, self._me.memory_info().rss, gpu is not None)


def _resolve(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


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


def replica_view(sampler: ProcessSampler, r: Replica) -> dict | None:
    """The last view of a replica's process tree: its actor's for a Ray-placed one
    (the last it saw), the sampler's for a local one; None when there is none."""
    if not r.pid:
        return None
    return (r.proc.view or None) if r.cfg.remote else sampler.view(r.pid)


async def worker_views(replicas: list[Replica], sampler: ProcessSampler) -> list[dict]:
    """One row per replica, its processes as of now: a local sample begun after the call,
    and each remote actor asked at the same time."""
    await asyncio.gather(sampler.fresh(0.0), refresh_remote_views(replicas))
    views = []
    for r in replicas:
        view = {
            "model": r.cfg.name, "replica": r.index, "backend": r.cfg.backend, "pid": r.pid,
            "node": LOCAL_NODE, "node_id": None, "node_address": None,
            "state": r.state.value, "restarts": r.restarts,
            "planned_restarts": r.planned_restarts, "last_exit_code": r.last_exit_code,
            # "SIGKILL" for an exit by signal (the code is then negative), else "code N"; the
            # runtime's own exit when its worker reported that its runtime died
            "last_exit": None if r.last_exit_code is None else exit_text(r.last_exit_code),
            # who ended it ("pool", "operator", "planned", "outside", "self") and why, in words (exits.py)
            "last_exit_by": r.last_exit_by, "last_exit_why": r.last_exit_why,
            "crashes": sum(r.crashes.values()), "crashes_by": dict(r.crashes),  # unplanned exits, apart from restarts
            "worker_exit_code": r.worker_exit_code, "restart_drain_left_s": r.restart_drain_left_s,
            "restart_in_s": r.restart_in_s,  # a crash restart's back-off countdown
            "uptime_s": round(time.time() - r.started_at, 1) if r.pid and r.started_at else None,
            "inflight": len(r.inflight), "capacity": r.capacity, "runtime_capacity": r.runtime_capacity,
            "newcomer_slots": r.newcomer_slots,
            "rss_bytes": None, "cpu_percent": None, "children": [], "gpu_memory_bytes": None,
            "log_path": str(r.log_path), "last_error": r.last_error, "runtime_info": r.info,
            "protocol_errors": r.link.protocol_errors, "unknown_job_replies": r.link.unknown_job_replies,
            # output tokens counted as they streamed, and of those, the ones only a job's end counted
            "output_tokens": r.link.streamed_tokens, "output_tokens_at_end": r.link.settled_tokens,
            "routing": r.owner.choice.replica_view(r),  # replica choice: decisions, prompt cache hits
        }
        if r.cfg.remote:  # on a Ray node (the last one it ran on, while it is down)
            view["node"] = getattr(r.proc, "node", None)
            view["node_id"] = getattr(r.proc, "node_id", None)
            view["node_address"] = getattr(r.proc, "node_ip", None)  # hosts can share a name; addresses differ
        view.update(replica_view(sampler, r) or {})
        views.append(view)
    return views
