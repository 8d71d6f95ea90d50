"""The processes the bench starts (a pool, a llama-server, any server under test) and what
it measures of them: CPU time and peak RSS. Every child runs in its own process group, dies
with the bench, and is stopped with all it started (procutil.tree.stop_tree)."""

from __future__ import annotations

import functools
import os
import signal
import secrets
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import psutil
import tomli_w

from pool_bench.report import say
from procutil.net import free_port
from procutil.tree import process_tree, stop_tree
from runtime_worker.lifeline import die_with_parent
from testkit import ROOT
from testkit.waits import wait_for

# Die with the bench even if it is SIGKILLed (Linux); SIGTERM so a supervisor still stops
# its workers gracefully.
_DIE_WITH_BENCH = functools.partial(die_with_parent, signal.SIGTERM)


class Proc:
    """A child process in its own process group, logging to a file. Its
    descendants are recorded whenever seen and are killed when it stops."""

    live: list[Proc] = []

    def __init__(self, name: str, argv: list[str], log_path: Path, env: dict | None = None,
                 cwd: Path | None = None) -> None:
        self.name = name
        self.log_path = log_path
        self.seen: set[int] = set()
        self._log = open(log_path, "ab")
        self.popen = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=self._log,
                                      stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                                      cwd=cwd, start_new_session=True, preexec_fn=_DIE_WITH_BENCH)
        self.pid = self.popen.pid
        Proc.live.append(self)

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def tree(self) -> list[psutil.Process]:
        if not self.alive():  # reaped: its pid may be another process's now
            return []
        procs = process_tree(self.pid)
        self.seen.update(p.pid for p in procs[1:])
        return procs

    def tree_rss(self) -> int:
        total = 0
        for p in self.tree():
            try:
                total += p.memory_info().rss
            except psutil.Error:
                pass
        return total

    def stop(self, timeout: float = 20) -> None:
        if self in Proc.live:
            Proc.live.remove(self)
        for left in stop_tree(self.popen, self.seen, timeout, group=True):
            say(f"{self.name}: descendant {left} still alive: SIGKILL")
        self._log.close()

    @classmethod
    def stop_all(cls) -> None:
        for proc in reversed(list(cls.live)):
            try:
                proc.stop(timeout=10)
            except Exception as exc:  # keep stopping the others
                say(f"stopping {proc.name}: {exc}")


def wait_http(proc: Proc, url: str, timeout: float, ok=(200,), headers: dict | None = None) -> None:
    with httpx.Client(timeout=3, headers=headers) as client:
        def up() -> bool:
            if not proc.alive():
                raise RuntimeError(f"{proc.name} exited with {proc.popen.returncode}:\n{proc.log_tail()}")
            try:
                return client.get(url).status_code in ok
            except httpx.TransportError:
                return False

        try:
            wait_for(up, timeout, interval=0.2, what=f"{proc.name} at {url}")
        except AssertionError as exc:
            raise RuntimeError(f"{exc}:\n{proc.log_tail()}") from None


class PoolProc(Proc):
    def __init__(self, tmp: Path, name: str, models: list[dict], env: dict | None = None,
                 tenants: list[dict] | None = None, server: dict | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cfg = tmp / f"{name}.toml"
        cfg.write_text(tomli_w.dumps({"server": {"host": "127.0.0.1", "port": self.port,
                                                 "state_dir": str(tmp / f"{name}-state"), **(server or {})},
                                      **({"tenants": tenants} if tenants else {}), "models": models}))
        super().__init__(name, [sys.executable, "-m", "supervisor.cli", "serve", "--config", str(cfg),
                                "--log-level", "warning"],
                         tmp / f"{name}.log", env=env, cwd=ROOT)

    def ready(self, timeout: float = 180) -> PoolProc:
        wait_http(self, self.url + "/ready", timeout)
        self.tree()
        return self

    def workers(self) -> list[dict]:
        rows = httpx.get(self.url + "/admin/workers", timeout=10).json()["workers"]
        for w in rows:
            if w.get("pid"):
                self.seen.add(w["pid"])
            self.seen.update(c["pid"] for c in w.get("children", []))
        return rows

    def rss(self) -> int:
        try:
            return psutil.Process(self.pid).memory_info().rss
        except psutil.Error:
            return 0


def uvicorn_app(tmp: Path, name: str, module: str, env: dict | None = None) -> Proc:
    """`module`'s `app` (a file in `tmp`) under uvicorn with the pool's settings (uvloop, httptools,
    no access log) on a free port, up (its /health answers); its `url` set."""
    port = free_port()
    app = Proc(name, [sys.executable, "-m", "uvicorn", f"{module}:app", "--app-dir", str(tmp), "--host", "127.0.0.1",
                      "--port", str(port), "--loop", "uvloop", "--http", "httptools", "--no-access-log",
                      "--log-level", "warning"], tmp / f"{name}.log", env=env)
    app.url = f"http://127.0.0.1:{port}"
    wait_http(app, app.url + "/health", 60)
    return app


class LlamaProc(Proc):
    def __init__(self, tmp: Path, name: str, binary: str, model: str, ctx: int, slots: int,
                 extra_args: list[str]) -> None:
        self.port = free_port()
        self.key = secrets.token_urlsafe(24)
        self.url = f"http://127.0.0.1:{self.port}"
        # the flags the pool's worker gives its own llama-server child (runtime_worker/backends/llama_server.py)
        argv = [binary, "-m", model, "-c", str(ctx), "-np", str(slots), "--host", "127.0.0.1",
                "--port", str(self.port), "--api-key", self.key, "--no-webui", *extra_args]
        super().__init__(name, argv, tmp / f"{name}.log")

    def ready(self, timeout: float = 180) -> LlamaProc:
        wait_http(self, self.url + "/health", timeout, headers={"Authorization": f"Bearer {self.key}"})
        return self


class CpuMeter:
    """User + system CPU seconds that some processes spend between start and stop:
    a cost per request or per token that, unlike throughput, holds up on a busy machine."""

    def __init__(self, pids: list[int]) -> None:
        self.procs = []
        for pid in pids:
            try:
                self.procs.append(psutil.Process(pid))
            except psutil.Error:
                pass

    def total(self) -> float:
        t = 0.0
        for p in self.procs:
            try:
                c = p.cpu_times()
                t += c.user + c.system
            except psutil.Error:
                pass
        return t


class RssSampler(threading.Thread):
    """Peak RSS of some processes while a load runs."""

    def __init__(self, pids: list[int], interval: float = 0.2) -> None:
        super().__init__(daemon=True)
        self.procs = {}
        for pid in pids:
            try:
                self.procs[pid] = psutil.Process(pid)
            except psutil.Error:
                pass
        self.peak = {pid: 0 for pid in self.procs}
        self.interval = interval
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            for pid, p in self.procs.items():
                try:
                    self.peak[pid] = max(self.peak[pid], p.memory_info().rss)
                except psutil.Error:
                    pass
            self.halt.wait(self.interval)

    def __enter__(self) -> RssSampler:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.halt.set()
        self.join()

